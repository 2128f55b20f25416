"""What every settings dataclass is made of: `opt` fields, the options a worker and a router
share (the internal plane's TLS, API keys, protected metrics, log level, the conversion cache),
and the checks their `__post_init__` raise ConfigError with."""
import dataclasses
from dataclasses import field
from pathlib import Path
from typing import Any

from pdserve.common import config_options as cv
from pdserve.common.errors import ConfigError

LOG_LEVELS = ("debug", "info", "warning", "error")


def default_cache_dir() -> str:
    """Where converted models (tokenizer, dequantized GGUF weights) are kept by default."""
    return str(Path.home() / ".cache" / "pdserve")


def opt(default: object = dataclasses.MISSING, *, help: str, parse: cv.Parser, flag: str | None = None,
        factory: object = dataclasses.MISSING, secret: bool = False) -> Any:
    """A settings field: its default, help text, parser and (when not its name) flag. A secret
    reaches a child process in its environment, never on its command line (`child_environ`)."""
    meta = {"help": help, "parse": parse, "flag": flag, "secret": secret}
    return field(default=default, default_factory=factory, metadata=meta,  # type: ignore[call-overload]
                 repr=not secret)


def tls_dir_option() -> Any:
    """The internal plane's credentials: a worker's and a router's `--tls-dir`."""
    return opt(None, parse=cv.optional(cv.parse_str),
               help="folder with ca.crt, tls.crt and tls.key: mutual TLS on every internal gRPC call "
                    "(`pdserve certs` makes them)")


def insecure_internal_option() -> Any:
    return opt(False, parse=cv.parse_bool,
               help="internal gRPC in plain text, without --tls-dir: anyone who reaches the port can read and write "
                    "the KV cache (logged as a warning)")


def api_key_option(use: str) -> Any:
    return opt((), parse=cv.parse_api_keys, secret=True,
               help=f"{use} (prefer PDSERVE_API_KEY: a flag shows in the process list)")


def api_keys_file_option(use: str) -> Any:
    return opt(None, parse=cv.optional(cv.parse_str), help=use)


def protect_metrics_option() -> Any:
    return opt(False, parse=cv.parse_bool,
               help="/metrics requires an API key too (the router's, each worker's --metrics-port and serve's "
                    "--serve-metrics-port; /health* stays open)")


def check(is_ok: bool, name: str, value: object, reason: str) -> None:
    if not is_ok:
        raise ConfigError(name, value, reason)


def check_positive(settings: object, *names: str) -> None:
    for name in names:
        value = getattr(settings, name)
        check(value is None or value > 0, name, value, "must be > 0")
