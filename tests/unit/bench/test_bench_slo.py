import pytest

from pdserve.bench.slo import Slo, parse_slo, parse_vllm_goodput
from pdserve.common.errors import ConfigError


def test_parse_slo_units_and_bare_numbers():
    assert parse_slo("ttft=500ms,tpot=50ms") == Slo(ttft_ms=500.0, tpot_ms=50.0)
    assert parse_slo("e2el=2s, ttft=250") == Slo(ttft_ms=250.0, e2el_ms=2000.0)
    assert parse_slo("TPOT=1500us") == Slo(tpot_ms=1.5)


def test_parse_vllm_goodput_is_milliseconds():
    assert parse_vllm_goodput(["ttft:500", "tpot:50"]) == Slo(ttft_ms=500.0, tpot_ms=50.0)


@pytest.mark.parametrize("text, bad", [
    ("ttft=fast", "fast"), ("latency=5ms", "latency"), ("ttft", "ttft"),
    ("ttft=0ms", "0ms"), ("ttft=-5", "-5"), ("ttft=1ms,ttft=2ms", "ttft"), ("", ""), ("ttft=nan", "nan"),
])
def test_parse_slo_rejects_malformed_input_naming_the_flag(text, bad):
    with pytest.raises(ConfigError) as info:
        parse_slo(text)
    assert info.value.field == "--slo"
    assert info.value.value == bad


def test_goodput_rejects_the_wrong_separator():
    with pytest.raises(ConfigError) as info:
        parse_vllm_goodput(["ttft=500"])
    assert (info.value.field, info.value.value) == ("--goodput", "ttft=500")


def test_is_met_checks_only_constrained_metrics_inclusively():
    slo = Slo(ttft_ms=100.0, tpot_ms=10.0)
    assert slo.is_met(ttft_ms=100.0, tpot_ms=10.0, e2el_ms=1e9) is True
    assert slo.is_met(ttft_ms=100.1, tpot_ms=1.0, e2el_ms=0.0) is False
    assert slo.is_met(ttft_ms=1.0, tpot_ms=10.5, e2el_ms=0.0) is False
    assert slo.as_dict() == {"ttft": 100.0, "tpot": 10.0}
