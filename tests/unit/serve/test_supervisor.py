"""Process supervision with stand-in children: readiness, failures, ordered and forced stops,
restarts with backoff."""
import os
import signal
import sys
from pathlib import Path

import pytest

from pdserve.serve.supervisor import ChildFailedError, ChildSpec, RestartPolicy, StopRequested, Supervisor

STAND_IN = str(Path(__file__).with_name("stand_in_child.py"))


def stand_in(tmp_path: Path, name: str, mode: str) -> ChildSpec:
    ready = tmp_path / f"{name}.ready"
    return ChildSpec(name, (sys.executable, STAND_IN, str(ready), mode), ready.exists)


def make_supervisor(startup_timeout_s: float = 30.0, shutdown_timeout_s: float = 10.0) -> Supervisor:
    return Supervisor(startup_timeout_s, shutdown_timeout_s, poll_interval_s=0.02)


def test_groups_start_in_order_and_stop_in_the_same_order(tmp_path: Path) -> None:
    supervisor = make_supervisor()
    try:
        worker_pid = supervisor.start(stand_in(tmp_path, "worker", "serve"))
        router_pid = supervisor.start(stand_in(tmp_path, "router", "serve"))
    finally:
        codes = supervisor.stop_all()
    assert (tmp_path / "worker.ready").read_text() == str(worker_pid)
    assert (tmp_path / "router.ready").read_text() == str(router_pid)
    assert list(codes.items()) == [("worker", 0), ("router", 0)]  # workers drain while the router relays
    assert (tmp_path / "stop-order").read_text().split() == ["worker", "router"]


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
    assert list(codes) == ["prefill", "decode"] and codes["decode"] == 3
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


class Recorder:
    """A RestartListener that keeps every event and stops the supervisor at the `num_stop_at`th `stop_at`."""

    def __init__(self, stop_at: str, num_stop_at: int) -> None:
        self.events: list[tuple[object, ...]] = []
        self.supervisor: Supervisor | None = None  # set once built with this listener
        self._stop_at = stop_at
        self._num_stop_at = num_stop_at

    def _record(self, *event: object) -> None:
        self.events.append(event)
        if self.supervisor and sum(e[0] == self._stop_at for e in self.events) == self._num_stop_at:
            self.supervisor.request_stop(signal.SIGTERM)

    def child_died(self, name: str, exit_code: int, backoff_s: float, num_deaths_in_a_row: int) -> None:
        self._record("died", name, exit_code, backoff_s, num_deaths_in_a_row)

    def child_restarted(self, name: str, pid: int) -> None:
        self._record("restarted", name)

    def child_ready(self, name: str) -> None:
        self._record("ready", name)


def supervise(tmp_path: Path, mode: str, policy: RestartPolicy, stop_at: str, num_stop_at: int,
              kill: bool = False) -> tuple[Recorder, dict[str, int]]:
    """Watch one restartable stand-in (killed at once with `kill`) until the `num_stop_at`th `stop_at`."""
    recorder = Recorder(stop_at, num_stop_at)
    supervisor = Supervisor(30.0, 10.0, poll_interval_s=0.02, listener=recorder)
    recorder.supervisor = supervisor
    spec = stand_in(tmp_path, "decode", mode)
    try:
        pid = supervisor.start(ChildSpec(spec.name, spec.argv, spec.is_ready, restart=policy))
        if kill:
            os.kill(pid, signal.SIGKILL)
            (tmp_path / "decode.ready").unlink()  # ready again only once the new process says so
        with pytest.raises(StopRequested):
            supervisor.watch()
    finally:
        codes = supervisor.stop_all()
    return recorder, codes


def test_a_child_dying_again_and_again_is_restarted_with_a_doubling_backoff_up_to_the_cap(tmp_path: Path) -> None:
    recorder, codes = supervise(tmp_path, "die-later", RestartPolicy(0.01, 0.04, reset_after_s=60), "restarted", 4)
    deaths = [event for event in recorder.events if event[0] == "died"]
    assert deaths == [("died", "decode", 4, 0.01, 1), ("died", "decode", 4, 0.02, 2),
                      ("died", "decode", 4, 0.04, 3), ("died", "decode", 4, 0.04, 4)]
    assert [event[0] for event in recorder.events].count("restarted") == 4
    assert list(codes) == ["decode"]


def test_a_child_that_keeps_dying_is_given_up_after_its_bound_and_watch_says_why(tmp_path: Path) -> None:
    recorder = Recorder("never", 1)
    supervisor = Supervisor(30.0, 10.0, poll_interval_s=0.02, listener=recorder)
    spec = stand_in(tmp_path, "decode", "die-later")
    policy = RestartPolicy(0.01, 0.04, reset_after_s=60, max_deaths_in_a_row=3)
    try:
        supervisor.start(ChildSpec(spec.name, spec.argv, spec.is_ready, restart=policy))
        with pytest.raises(ChildFailedError, match="decode exited 3 times in a row .last with code 4."):
            supervisor.watch()
    finally:
        codes = supervisor.stop_all()
    assert [event for event in recorder.events if event[0] != "ready"] == [
        ("died", "decode", 4, 0.01, 1), ("restarted", "decode"), ("died", "decode", 4, 0.02, 2), ("restarted", "decode")]
    assert list(codes) == ["decode"]


def test_a_child_that_stayed_up_long_enough_starts_a_new_backoff_series(tmp_path: Path) -> None:
    recorder, _ = supervise(tmp_path, "die-later", RestartPolicy(0.01, 0.04, reset_after_s=0.2), "restarted", 3)
    deaths = [event for event in recorder.events if event[0] == "died"]
    assert deaths == [("died", "decode", 4, 0.01, 1)] * 3  # each lived 0.3 s: past reset_after_s


def test_a_child_killed_9_is_restarted_with_its_command_line_and_is_ready_again(tmp_path: Path) -> None:
    recorder, codes = supervise(tmp_path, "serve", RestartPolicy(0.01, 0.04), "ready", 1, kill=True)
    assert recorder.events == [("died", "decode", -signal.SIGKILL, 0.01, 1), ("restarted", "decode"),
                               ("ready", "decode")]
    assert codes == {"decode": 0}  # the restarted child, stopped with the others
