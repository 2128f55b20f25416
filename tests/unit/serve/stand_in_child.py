"""A stand-in for a worker or router process: `python stand_in_child.py READY_FILE MODE`.

Modes: "serve" (ready at once, exits 0 on SIGINT/SIGTERM), "die-at-start" (exits 3 before
ready), "never-ready", "ignore-signals" (ready, ignores SIGINT/SIGTERM), "die-later" (ready,
then exits 4). Every mode exits on its own after 60 s, so no test can leave it behind.
On a stop signal it appends its name (the ready file's stem) to `stop-order` beside the file.
"""
import os
import signal
import sys
import time
from pathlib import Path

ready_file, mode = Path(sys.argv[1]), sys.argv[2]
if mode == "ignore-signals":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
else:
    def stop(*_: object) -> None:
        with open(ready_file.with_name("stop-order"), "a") as order:
            order.write(ready_file.stem + "\n")
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
if mode == "die-at-start":
    sys.exit(3)
if mode != "never-ready":  # written whole, then renamed: "ready" always holds the pid
    partial = ready_file.with_suffix(".partial")
    partial.write_text(str(os.getpid()))
    partial.rename(ready_file)
if mode == "die-later":
    time.sleep(0.3)
    sys.exit(4)
time.sleep(60)
