"""`pdserve serve`'s flow (`launcher.run`) over stand-in children, as its own process so a test
can signal it: `python serve_driver.py DIR ROUTER_MODE WORKER_MODE...`. The workers (named
prefill-0, ..., then decode, as serve starts them) form the first stage, the router the second."""
import sys
from pathlib import Path

from pdserve.serve.launcher import run
from pdserve.serve.supervisor import ChildSpec, Supervisor

directory, router_mode, worker_modes = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
stand_in = str(Path(__file__).with_name("stand_in_child.py"))


def spec(name: str, mode: str) -> ChildSpec:
    ready = directory / f"{name}.ready"
    return ChildSpec(name, (sys.executable, stand_in, str(ready), mode), ready.exists)


def worker_name(index: int) -> str:
    return f"prefill-{index}" if index < len(worker_modes) - 1 else "decode-0"


workers = [spec(worker_name(i), mode) for i, mode in enumerate(worker_modes)]
supervisor = Supervisor(startup_timeout_s=30, shutdown_timeout_s=5, poll_interval_s=0.02)
supervisor.install_signal_handlers()
sys.exit(run([workers, [spec("router", router_mode)]], "READY", supervisor))
