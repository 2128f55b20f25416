"""Process supervision with stand-in children: readiness, failures, ordered and forced stops."""
import signal
import sys
from pathlib import Path

import pytest

from pdserve.serve.supervisor import ChildFailedError, ChildSpec, Supervisor

STAND_IN = str(Path(__file__).with_name("stand_in_child.py"))


def stand_in(tmp_path: Path, name: str, mode: str) -> ChildSpec:
    ready = tmp_path / f"{name}.ready"
    return ChildSpec(name, (sys.executable, STAND_IN, str(ready), mode), ready.exists)


def make_supervisor(startup_timeout_s: float = 30.0, shutdown_timeout_s: float = 10.0) -> Supervisor:
    return Supervisor(startup_timeout_s, shutdown_timeout_s, poll_interval_s=0.02)


def test_children_start_in_order_and_stop_in_reverse(tmp_path: Path) -> None:
    supervisor = make_supervisor()
    try:
        worker_pid = supervisor.start(stand_in(tmp_path, "worker", "serve"))
        router_pid = supervisor.start(stand_in(tmp_path, "router", "serve"))
    finally:
        codes = supervisor.stop_all()
    assert (tmp_path / "worker.ready").read_text() == str(worker_pid)
    assert (tmp_path / "router.ready").read_text() == str(router_pid)
    assert list(codes.items()) == [("router", 0), ("worker", 0)]


def test_child_dying_at_start_is_one_line(tmp_path: Path) -> None:
    supervisor = make_supervisor()
    with pytest.raises(ChildFailedError) as caught:
        supervisor.start(stand_in(tmp_path, "worker", "die-at-start"))
    assert str(caught.value) == "worker exited with code 3 while starting"
    assert supervisor.stop_all() == {"worker": 3}


def test_child_not_ready_in_time_is_stopped(tmp_path: Path) -> None:
    supervisor = make_supervisor(startup_timeout_s=0.3)
    with pytest.raises(ChildFailedError) as caught:
        supervisor.start(stand_in(tmp_path, "worker", "never-ready"))
    assert str(caught.value) == "worker was not ready within 0.3 s"
    assert supervisor.stop_all() == {"worker": 0}


def test_child_ignoring_the_stop_signal_is_killed(tmp_path: Path) -> None:
    supervisor = make_supervisor(shutdown_timeout_s=0.3)
    supervisor.start(stand_in(tmp_path, "router", "ignore-signals"))
    assert supervisor.stop_all() == {"router": -signal.SIGKILL}


def test_watch_reports_a_child_that_dies(tmp_path: Path) -> None:
    supervisor = make_supervisor()
    try:
        supervisor.start(stand_in(tmp_path, "worker", "serve"))
        supervisor.start(stand_in(tmp_path, "router", "die-later"))
        with pytest.raises(ChildFailedError) as caught:
            supervisor.watch()
    finally:
        codes = supervisor.stop_all()
    assert str(caught.value) == "router exited unexpectedly with code 4"
    assert codes == {"router": 4, "worker": 0}


def test_a_group_starts_together_and_a_child_dying_in_it_is_named(tmp_path: Path) -> None:
    supervisor = make_supervisor()
    group = [stand_in(tmp_path, "prefill", "serve"), stand_in(tmp_path, "decode", "die-at-start")]
    with pytest.raises(ChildFailedError) as caught:
        supervisor.start_group(group)
    assert str(caught.value) == "decode exited with code 3 while starting"
    codes = supervisor.stop_all()
    assert list(codes) == ["decode", "prefill"] and codes["decode"] == 3
    assert codes["prefill"] in (0, -signal.SIGTERM)  # stopped before or after its handler was set


def test_a_group_shares_one_startup_deadline(tmp_path: Path) -> None:
    supervisor = make_supervisor(startup_timeout_s=3.0)
    group = [stand_in(tmp_path, "prefill", "serve"), stand_in(tmp_path, "decode", "never-ready")]
    with pytest.raises(ChildFailedError) as caught:
        supervisor.start_group(group)
    assert str(caught.value) == "decode was not ready within 3 s"
    assert (tmp_path / "prefill.ready").exists()
    assert supervisor.stop_all() == {"decode": 0, "prefill": 0}


def test_a_ready_group_returns_every_pid_in_order(tmp_path: Path) -> None:
    supervisor = make_supervisor()
    try:
        pids = supervisor.start_group([stand_in(tmp_path, f"w{i}", "serve") for i in range(3)])
    finally:
        supervisor.stop_all()
    assert pids == [int((tmp_path / f"w{i}.ready").read_text()) for i in range(3)]
