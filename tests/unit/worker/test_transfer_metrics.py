"""A worker's KV-transfer series: a role's labelled series exist at zero before their first event."""
import re
from pathlib import Path

from prometheus_client import generate_latest

from pdserve.engine.core import remote_prefill
from pdserve.worker import disagg
from pdserve.worker.metrics import LOCAL_PREFILL_REASONS, TransferMetrics


def test_a_decode_workers_series_start_at_zero_for_every_fallback_reason() -> None:
    metrics = TransferMetrics()
    metrics.start_at_zero("received", LOCAL_PREFILL_REASONS)
    lines = set(generate_latest(metrics.registry).decode().splitlines())
    assert 'pdserve_kv_transfer_failures_total{direction="received"} 0.0' in lines
    assert 'pdserve_kv_transfer_bytes_total{direction="received"} 0.0' in lines
    assert 'pdserve_kv_window_skipped_blocks_total{direction="received"} 0.0' in lines
    assert 'pdserve_kv_window_skipped_bytes_total{direction="received"} 0.0' in lines
    assert {f'pdserve_local_prefills_total{{reason="{r}"}} 0.0' for r in LOCAL_PREFILL_REASONS} <= lines
    assert not [line for line in lines if 'direction="sent"' in line]


def test_the_listed_fallback_reasons_are_the_ones_the_decode_worker_gives() -> None:
    given = set()
    for module in (disagg, remote_prefill):
        source = Path(module.__file__).read_text()
        given |= set(re.findall(r'(?:reason = |return (?:None, )?)"(\w+)"', source))
    assert given == set(LOCAL_PREFILL_REASONS)
