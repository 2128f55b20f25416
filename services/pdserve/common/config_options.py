"""The machinery behind the `settings` package: options read off the settings dataclasses, their
command-line parser, value parsers and the config-file reader. It reads no environment.

A value parser takes what a source holds (a string from a flag or an environment variable;
a string, number, bool or list from a config file) and returns the typed value, or raises
ValueError with a short reason. `setting_sources.py` names the field and the source.
"""
import argparse
import dataclasses
import difflib
import enum
import json
import math
import re
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from pdserve.common.errors import ConfigError

Parser = Callable[[object], object]
Target = tuple[str, str]  # (section, field name)

ENV_PREFIX = "PDSERVE_"

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?", re.IGNORECASE)


def parse_str(raw: object) -> str:
    if not isinstance(raw, str) or not raw:
        raise ValueError("must be a non-empty string")
    return raw


def parse_int(raw: object) -> int:
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and re.fullmatch(r"\s*[+-]?\d+\s*", raw):
        return int(raw)
    raise ValueError("must be an integer")


def parse_float(raw: object) -> float:
    try:
        value = float(raw) if isinstance(raw, (int, float, str)) and not isinstance(raw, bool) else None
    except ValueError:
        value = None
    if value is None or not math.isfinite(value):
        raise ValueError("must be a finite number")
    return value


def parse_bool(raw: object) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.strip().lower() in _TRUE | _FALSE:
        return raw.strip().lower() in _TRUE
    raise ValueError(f"must be a boolean ({'/'.join(sorted(_TRUE))} or {'/'.join(sorted(_FALSE))})")


def parse_bytes(raw: object) -> int:
    """An integer number of bytes, or a size such as "512MiB", "2GiB" or "1.5G" (powers of 1024)."""
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    match = _SIZE.fullmatch(raw.strip()) if isinstance(raw, str) else None
    if match is None:
        raise ValueError("must be a number of bytes, e.g. 1073741824, 512MiB or 2GiB")
    number, unit, _ = match.groups()
    return int(float(number) * 1024 ** "_kmgt".index(unit.lower() or "_"))


def parse_addresses(raw: object) -> tuple[str, ...]:
    """"host:port" entries: one comma-separated string, or a list of them (a repeated flag)."""
    items = [raw] if isinstance(raw, str) else raw
    if not isinstance(items, list | tuple) or not items:
        raise ValueError("must be one or more host:port addresses")
    addresses = tuple(part.strip() for item in items for part in str(item).split(","))
    for address in addresses:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{address!r} is not host:port")
    return addresses


def parse_api_keys(raw: object) -> tuple[str, ...]:
    """API keys: one comma-separated string, or a list of them (a repeated flag). A key is
    printable ASCII without spaces or commas. No error message quotes a key."""
    items = [raw] if isinstance(raw, str) else raw
    if not isinstance(items, list | tuple):
        raise ValueError("must be one or more comma-separated keys")
    keys = tuple(part.strip() for item in items for part in str(item).split(","))
    for number, key in enumerate(keys, 1):
        if not is_api_key_ok(key):
            raise ValueError(f"key {number} of {len(keys)} is not printable ASCII without spaces or commas")
    return keys


def parse_names(raw: object) -> tuple[str, ...]:
    """Names: one comma-separated string, or a list of them (`--served-model-name a b`, vLLM's
    spelling, or a repeated flag)."""
    items = [raw] if isinstance(raw, str) else raw
    if not isinstance(items, list | tuple):
        raise ValueError("must be one or more names")
    names = tuple(part.strip() for item in items for part in str(item).split(","))
    if not names or not all(names):
        raise ValueError("must be one or more non-empty names")
    return names


def parse_lora_modules(raw: object) -> tuple[str, ...]:
    """LoRA adapters as vLLM's `--lora-modules` takes them: `name=path` items, or JSON objects
    `{"name": ..., "path": ...}` (a config file may list either); normalized to `name=path`."""
    items = [raw] if isinstance(raw, str | dict) else raw
    if not isinstance(items, list | tuple):
        raise ValueError("must be name=path items")
    modules = tuple(_lora_module(item) for item in items)
    names = [m.partition("=")[0] for m in modules]
    if len(set(names)) != len(names):
        raise ValueError(f"adapter names must differ: {', '.join(names)}")
    return modules


def _lora_module(item: object) -> str:
    if isinstance(item, str) and item.lstrip().startswith("{"):
        try:
            item = json.loads(item)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{item!r} is not JSON: {exc}") from None
    if isinstance(item, dict):
        name, path = item.get("name"), item.get("path")
    elif isinstance(item, str):
        name, _, path = item.partition("=")
    else:
        name = path = None
    if not isinstance(name, str) or not isinstance(path, str) or not name.strip() or not path.strip():
        raise ValueError(f"{item!r} is not name=path (or {{\"name\": ..., \"path\": ...}})")
    return f"{name.strip()}={path.strip()}"


def is_api_key_ok(key: str) -> bool:
    return bool(key) and key.isascii() and key.isprintable() and not any(c in key for c in " ,")


def choice(*values: str, aliases: Mapping[str, str] | None = None) -> Parser:
    """A parser that accepts one of `values` (or an alias of one), case-insensitively."""
    aliases = aliases or {}

    def parse(raw: object) -> str:
        name = raw.strip().lower() if isinstance(raw, str) else None
        name = aliases.get(name, name) if name is not None else None
        if name not in values:
            raise ValueError(f"must be one of {', '.join(values + tuple(aliases))}")
        return name

    return parse


def member_of(kind: type[enum.StrEnum]) -> Parser:
    """A parser that accepts a member's value of the string enum `kind`."""
    parse_name = choice(*(member.value for member in kind))
    return lambda raw: kind(parse_name(raw))


def optional(parse: Parser) -> Parser:
    """`parse`, where a config file's null (or an empty string) means unset."""

    def parse_optional(raw: object) -> object:
        return None if raw is None or raw == "" else parse(raw)

    return parse_optional


def read_config_file(path: str) -> dict[str, object]:
    """The mapping in a YAML (.yaml/.yml), TOML or JSON file; ConfigError("config", path, ...)
    if it cannot be read, does not parse, or does not hold a mapping."""
    file = Path(path)
    readers: dict[str, Callable[[str], object]] = {
        ".yaml": yaml.safe_load, ".yml": yaml.safe_load, ".toml": tomllib.loads, ".json": json.loads,
    }
    reader = readers.get(file.suffix.lower())
    if reader is None:
        raise ConfigError("config", path, "must end in .yaml, .yml, .toml or .json")
    try:
        data = reader(file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError("config", path, f"cannot read: {exc.strerror}") from exc
    except (yaml.YAMLError, tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError("config", path, f"does not parse: {exc}") from exc
    if data is None:  # an empty YAML file
        return {}
    if not isinstance(data, dict):
        raise ConfigError("config", path, "must hold a mapping of keys to values")
    return data


@dataclass(frozen=True, slots=True)
class Option:
    """One setting as the user spells it: `--flag`, PDSERVE_FLAG and the file key `flag`."""

    flag: str  # without the leading dashes
    targets: tuple[Target, ...]  # serve's --model sets the router's and the worker's
    parse: Parser
    help: str
    is_secret: bool = False  # never on a command line or in an error message

    @property
    def env_var(self) -> str:
        return ENV_PREFIX + self.flag.upper().replace("-", "_")

    @property
    def is_bool(self) -> bool:
        return self.parse is parse_bool

    @property
    def is_list(self) -> bool:
        """A list flag may be repeated (`--worker a:1 --worker b:2`) or take a comma list."""
        return self.parse in (parse_addresses, parse_api_keys, parse_names, parse_lora_modules)

    @property
    def takes_several(self) -> bool:
        """A flag followed by several values, as vLLM's `--lora-modules a=/x b=/y`."""
        return self.parse is parse_lora_modules


def options_of(cls: type, section: str, rename: Mapping[str, str] | None = None,
               skip: Sequence[str] = ()) -> list[Option]:
    """An option for each field of `cls` declared with `settings.opt`, except `skip`;
    `rename` gives a field a flag other than its own (serve's `--worker-port`)."""
    options = []
    for f in dataclasses.fields(cls):
        if f.name in skip or "parse" not in f.metadata:
            continue
        flag = (rename or {}).get(f.name) or f.metadata["flag"] or f.name.replace("_", "-")
        shown = f.default not in (dataclasses.MISSING, None, ())
        help_ = f.metadata["help"] + (f" (default: {f.default})" if shown else "")
        options.append(Option(flag, ((section, f.name),), f.metadata["parse"], help_,
                              f.metadata.get("secret", False)))
    return options


def merged(options: list[Option]) -> list[Option]:
    """One option per flag; a flag two sections share sets both."""
    by_flag: dict[str, Option] = {}
    for o in options:
        seen = by_flag.get(o.flag)
        by_flag[o.flag] = o if seen is None else dataclasses.replace(seen, targets=seen.targets + o.targets)
    return list(by_flag.values())


def build_parser(prog: str, options: list[Option]) -> argparse.ArgumentParser:
    epilog = f"Every flag also reads {ENV_PREFIX}<FLAG> and a --config file key; flags win."
    parser = argparse.ArgumentParser(prog=prog, argument_default=argparse.SUPPRESS, epilog=epilog,
                                     allow_abbrev=False)  # `--worker` must never pass for `--workers`
    parser.add_argument("--config", help="YAML, TOML or JSON file of flag: value pairs")
    if any(o.flag == "model" for o in options):  # `pdserve serve /models/x`, as `vllm serve` takes it
        parser.add_argument("model_tag", nargs="?", metavar="MODEL", help="the same as --model")
    for o in options:
        if o.parse is parse_names:  # vLLM's `--served-model-name a b`
            parser.add_argument(f"--{o.flag}", action="extend", nargs="+", help=o.help)
            continue
        action = argparse.BooleanOptionalAction if o.is_bool else "append" if o.is_list else "store"
        if o.takes_several:
            parser.add_argument(f"--{o.flag}", action="extend", nargs="+", help=o.help)
        else:
            parser.add_argument(f"--{o.flag}", action=action, help=o.help)
    return parser


def file_values(path: str, options: list[Option]) -> dict[str, object]:
    """The config file's values by flag; `max_model_len` and `max-model-len` are one key.
    An unknown key is a ConfigError (with the closest known key as a hint)."""
    known = [o.flag for o in options]
    values = {}
    for key, value in read_config_file(path).items():
        flag = str(key).replace("_", "-")
        if flag not in known:
            close = difflib.get_close_matches(flag, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{key} (in {path})", value, f"unknown key{hint}")
        values[flag] = value
    return values
