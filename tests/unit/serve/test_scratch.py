"""Serve's scratch folder: removed on the way out, and a folder a killed serve left (its private
keys inside) removed by the next start, never one of a serve still running or another user's."""
import os
import subprocess
import sys
from pathlib import Path

from pdserve.serve.scratch import OWNER_FILE, PREFIX, process_start, remove_stale, scratch_folder


def left_by(root: Path, name: str, pid: int, start: str | None) -> Path:
    folder = root / f"{PREFIX}{name}"
    folder.mkdir(mode=0o700)
    (folder / "tls.key").write_text("private")
    (folder / OWNER_FILE).write_text(f"{pid} {start}\n")
    return folder


def test_a_folder_of_a_killed_serve_is_removed_at_the_next_start_and_a_live_ones_kept(tmp_path: Path) -> None:
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    start = process_start(killed.pid)
    killed.kill()
    killed.wait()
    stale = left_by(tmp_path, "killed", killed.pid, start)
    reused = left_by(tmp_path, "reused", os.getpid(), "1")  # the pid lives on in another process
    live = left_by(tmp_path, "live", os.getpid(), process_start(os.getpid()))
    other = tmp_path / "unrelated"
    other.mkdir()
    with scratch_folder(tmp_path) as folder:
        assert not stale.exists() and not reused.exists()
        assert live.exists() and other.exists() and folder.exists()
        assert (folder / OWNER_FILE).read_text().split()[0] == str(os.getpid())
        assert oct(folder.stat().st_mode & 0o777) == oct(0o700)
    assert not folder.exists() and live.exists()
    assert remove_stale(tmp_path) == []
