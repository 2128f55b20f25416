"""`pdserve router`'s exit statuses for settings it refuses and a worker it cannot reach."""
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.router.__main__ import main


def test_bad_setting_exits_2_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--port", "0"]) == 2
    assert capsys.readouterr().err == "pdserve router: --port=0: must be in 1..65535\n"


def test_a_worker_named_twice_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--worker", "127.0.0.1:1,127.0.0.1:2", "--worker", "127.0.0.1:1"]) == 2
    assert capsys.readouterr().err == (
        "pdserve router: --worker='127.0.0.1:1,127.0.0.1:2,127.0.0.1:1': names a worker twice\n")


def test_internal_plane_needs_tls_or_an_explicit_plain_text_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert capsys.readouterr().err.startswith(
        "pdserve router: --tls-dir=None: the internal gRPC plane needs mutual TLS: give --tls-dir")
    assert main(["--tls-dir", "/nonexistent", "--insecure-internal"]) == 2
    assert "cannot be combined with --insecure-internal" in capsys.readouterr().err


def test_a_tls_folder_without_its_files_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--tls-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith(f"pdserve router: --tls-dir={str(tmp_path)!r}: needs ca.crt, tls.crt "
                                              "and tls.key")


def test_unreachable_worker_exits_1_after_the_wait(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "router", "--worker", "127.0.0.1:1", "--worker-wait-timeout", "0.5",
         "--cache-dir", str(tmp_path), "--insecure-internal"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    warning, error = result.stderr.splitlines()
    assert "WARNING pdserve.router: INSECURE: the internal gRPC plane runs in plain text" in warning
    assert error.startswith("pdserve router: worker 127.0.0.1:1 unavailable: ")
    assert sorted(p.name.split(".", 1)[1] for p in tmp_path.iterdir()) == ["spec.json", "tokenizer.json"]
