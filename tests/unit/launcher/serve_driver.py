"""`pdserve serve`'s flow (`launcher.run`) over two stand-in children, as its own process so
a test can signal it: `python serve_driver.py DIR ROUTER_MODE`."""
import sys
from pathlib import Path

from pdserve.launcher import run
from pdserve.supervisor import ChildSpec, Supervisor

directory, router_mode = Path(sys.argv[1]), sys.argv[2]
stand_in = str(Path(__file__).with_name("stand_in_child.py"))


def spec(name: str, mode: str) -> ChildSpec:
    ready = directory / f"{name}.ready"
    return ChildSpec(name, (sys.executable, stand_in, str(ready), mode), ready.exists)


supervisor = Supervisor(startup_timeout_s=30, shutdown_timeout_s=5, poll_interval_s=0.02)
supervisor.install_signal_handlers()
sys.exit(run([spec("worker", "serve"), spec("router", router_mode)], "READY", supervisor))
