"""Where each setting's value comes from: flag > environment variable > config file > default.

`resolve_sources` reads a process's flags (the model may also come first, as `vllm serve`
takes it), its `PDSERVE_*` environment and the file named by `--config` / `PDSERVE_CONFIG`,
and labels each value with its source, so that `build_section` can name it in a ConfigError.
Apart from the `settings` package (the pod name, a child's environment, a worker's runtime
defaults), no other module reads the environment.
"""
import logging
import os
import re
from collections.abc import Mapping, Sequence
from typing import TypeVar

from pdserve.common import config_options as cv
from pdserve.common.errors import ConfigError

log = logging.getLogger(__name__)

# Kubernetes puts `<SERVICE>_PORT=tcp://10.0.0.1:8000` into every pod for each Service of its
# namespace (service links): a Service named `pdserve` sets PDSERVE_PORT, one named
# `pdserve-metrics` PDSERVE_METRICS_PORT. No pdserve setting takes such a URL, so one is ignored.
SERVICE_LINK = re.compile(r"(tcp|udp|sctp)://[^\s/]+:\d+")
REDACTED = "<redacted>"
CONFIG_ENV = "PDSERVE_CONFIG"

T = TypeVar("T")
Target = cv.Target


def resolve_sources(prog: str, options: list[cv.Option], argv: Sequence[str] | None,
                    environ: Mapping[str, str] | None) -> tuple[dict[Target, object], dict[Target, str]]:
    """Each set field's value and the label of the source it came from (e.g. `--port`)."""
    env = os.environ if environ is None else environ
    cli = vars(cv.build_parser(prog, options).parse_args(argv))
    positional_model = cli.pop("model_tag", None)
    if positional_model is not None:
        given = cli.setdefault("model", positional_model)
        if given != positional_model:
            raise ConfigError("--model", given, f"names another model than the positional {positional_model!r}")
    config_path = cli.pop("config", None) or env.get(CONFIG_ENV)
    in_file = cv.file_values(config_path, options) if config_path else {}
    values: dict[Target, object] = {}
    labels: dict[Target, str] = {}
    for o in options:
        dest = o.flag.replace("-", "_")
        if dest in cli:
            raw, label = cli[dest], f"--{o.flag}"
        elif o.env_var in env and not is_service_link(o.env_var, env[o.env_var]):
            raw, label = env[o.env_var], o.env_var
        elif o.flag in in_file:
            raw, label = in_file[o.flag], f"{o.flag} (in {config_path})"
        else:
            continue
        try:
            value = o.parse(raw)
        except ValueError as exc:
            raise ConfigError(label, REDACTED if o.is_secret else raw, str(exc)) from None
        values.update((t, value) for t in o.targets)
        labels.update((t, label) for t in o.targets)
    return values, labels


def is_service_link(name: str, value: str) -> bool:
    """Whether `name=value` is a Kubernetes service link rather than a setting (logged when so)."""
    if SERVICE_LINK.fullmatch(value.strip()) is None:
        return False
    log.warning("ignoring %s=%r: a Kubernetes service link, not a pdserve setting (set enableServiceLinks: "
                "false in the pod spec to keep it out)", name, value)
    return True


def build_section(cls: type[T], section: str, options: list[cv.Option], values: dict[Target, object],
                  labels: dict[Target, str], **extra: object) -> T:
    """`cls` from its section's values; a ConfigError names the flag or source of the field."""
    kwargs = {name: value for (sec, name), value in values.items() if sec == section}
    try:
        return cls(**kwargs, **extra)
    except ConfigError as exc:
        flags = {t: f"--{o.flag}" for o in options for t in o.targets}
        where = labels.get((section, exc.field)) or flags.get((section, exc.field), exc.field)
        raise ConfigError(where, exc.value, exc.reason) from None


