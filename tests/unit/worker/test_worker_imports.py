"""A worker loads NIXL only when something moves KV through it (a prefill or decode role's
transport, a disk tier): an aggregated worker without a disk tier never imports it (~17 MB)."""
import json
import subprocess
import sys


def test_worker_entry_and_disk_store_modules_do_not_import_nixl() -> None:
    code = (
        "import json, sys\n"
        "import pdserve.worker.__main__, pdserve.worker.bootstrap, pdserve.transfer.disk_store\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0].startswith('nixl'))))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []
