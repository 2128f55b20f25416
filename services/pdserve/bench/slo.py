"""Service-level objectives for goodput: parsing and the per-request test.

Two spellings are accepted, both giving milliseconds:
- ours: `--slo ttft=500ms,tpot=50ms,e2el=2s` (units ms, s or us; a bare number is ms);
- `vllm bench serve`'s: `--goodput ttft:500 tpot:50` (values in ms).
"""
from dataclasses import dataclass

from pdserve.common.errors import ConfigError

SLO_METRICS = ("ttft", "tpot", "e2el")
_UNIT_TO_MS = {"ms": 1.0, "s": 1000.0, "us": 0.001}


@dataclass(frozen=True, slots=True)
class Slo:
    """Upper bounds in milliseconds; None means the metric is not constrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def as_dict(self) -> dict[str, float]:
        """The constrained metrics only, e.g. {"ttft": 500.0}."""
        bounds = {"ttft": self.ttft_ms, "tpot": self.tpot_ms, "e2el": self.e2el_ms}
        return {name: value for name, value in bounds.items() if value is not None}

    def is_met(self, ttft_ms: float, tpot_ms: float, e2el_ms: float) -> bool:
        """True when every constrained metric is at or under its bound (DistServe, vLLM)."""
        measured = {"ttft": ttft_ms, "tpot": tpot_ms, "e2el": e2el_ms}
        return all(measured[name] <= bound for name, bound in self.as_dict().items())


def _parse_duration_ms(field: str, text: str) -> float:
    stripped = text.strip().lower()
    for unit in ("ms", "us", "s"):
        if stripped.endswith(unit):
            number, scale = stripped[: -len(unit)], _UNIT_TO_MS[unit]
            break
    else:
        number, scale = stripped, 1.0
    try:
        value = float(number) * scale
    except ValueError:
        raise ConfigError(field, text, "expected a duration such as 500ms, 0.5s or 500") from None
    if not value > 0 or value == float("inf"):
        raise ConfigError(field, text, "a bound must be a positive, finite duration")
    return value


def _build(field: str, pairs: list[tuple[str, str]]) -> Slo:
    bounds: dict[str, float] = {}
    for name, value in pairs:
        key = name.strip().lower()
        if key not in SLO_METRICS:
            raise ConfigError(field, name, f"unknown SLO metric; choose from {', '.join(SLO_METRICS)}")
        if key in bounds:
            raise ConfigError(field, name, "metric given twice")
        bounds[key] = _parse_duration_ms(field, value)
    if not bounds:
        raise ConfigError(field, "", "give at least one bound, e.g. ttft=500ms")
    return Slo(bounds.get("ttft"), bounds.get("tpot"), bounds.get("e2el"))


def _split_pairs(field: str, items: list[str], separator: str) -> list[tuple[str, str]]:
    pairs = []
    for item in items:
        name, sep, value = item.partition(separator)
        if not sep or not name.strip() or not value.strip():
            raise ConfigError(field, item, f"expected METRIC{separator}VALUE")
        pairs.append((name, value))
    return pairs


def parse_slo(text: str) -> Slo:
    """Parse `ttft=500ms,tpot=50ms`; raises ConfigError naming `--slo` on bad input."""
    items = [item for item in text.split(",") if item.strip()]
    return _build("--slo", _split_pairs("--slo", items, "="))


def parse_vllm_goodput(items: list[str]) -> Slo:
    """Parse vLLM's `--goodput ttft:500 tpot:50` (milliseconds)."""
    return _build("--goodput", _split_pairs("--goodput", items, ":"))
