"""What serve tells an operator about a restarted worker: its lines and its restart counter."""
import io

from pdserve.serve.restarts import WorkerRestarts

NAME = "decode worker at 127.0.0.1:50052"
LABELS = {"worker": "127.0.0.1:50052", "role": "decode"}


def test_each_restart_is_a_line_and_counts_for_its_worker_from_zero() -> None:
    out = io.StringIO()
    restarts = WorkerRestarts({NAME: LABELS}, out)
    assert restarts.registry.get_sample_value("pdserve_worker_restarts_total", LABELS) == 0.0
    restarts.child_died(NAME, -9, 2.0, 2)
    restarts.child_restarted(NAME, 1234)
    restarts.child_ready(NAME)
    assert out.getvalue().splitlines() == [
        f"pdserve serve: {NAME} exited with code -9; restarting it in 2 s (death 2 in a row)",
        f"pdserve serve: {NAME} restarted (pid 1234)",
        f"pdserve serve: {NAME} is ready again",
    ]
    assert restarts.registry.get_sample_value("pdserve_worker_restarts_total", LABELS) == 1.0
