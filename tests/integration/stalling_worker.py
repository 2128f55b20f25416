"""`pdserve worker` whose engine steps wait while a file exists: a wedged engine, on demand.

    python -m tests.integration.stalling_worker STALL_FILE <pdserve worker flags>

A test-only hook (the product has no fault switch): the engine thread blocks at the start of
each step while STALL_FILE exists, with work queued behind it, and runs on once it is removed.
"""
import sys
import time
from pathlib import Path

POLL_S = 0.02


def stall_steps_while(path: Path) -> None:
    from pdserve.engine.core.llm_engine import LLMEngine

    step = LLMEngine.step

    def stalling_step(self: LLMEngine) -> list:
        while path.exists():
            time.sleep(POLL_S)
        return step(self)

    LLMEngine.step = stalling_step  # type: ignore[method-assign]


def main(argv: list[str]) -> int:
    from pdserve.common.settings import apply_worker_runtime_defaults

    apply_worker_runtime_defaults()  # before torch loads, as `pdserve worker` does
    stall_steps_while(Path(argv[0]))
    from pdserve.worker.__main__ import main as worker_main

    return worker_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
