"""The router must start light: importing it never pulls in torch or the worker side."""
import json
import subprocess
import sys

FORBIDDEN = ("torch", "pdserve.engine", "pdserve.worker", "pdserve.transfer")


def test_router_imports_no_torch_engine_worker_or_transfer() -> None:
    code = (
        "import json, sys\n"
        "import pdserve.router.openai.app, pdserve.router.__main__\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' "
        f"or m.startswith({FORBIDDEN[1:]!r}))))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []
