"""`pdserve router` refuses an unusable keys file with exit status 2, before loading anything,
naming the line and never the key."""
from pathlib import Path

import pytest

from pdserve.router.__main__ import main


def test_a_missing_keys_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--api-keys-file", str(tmp_path / "absent")]) == 2
    assert capsys.readouterr().err.startswith(f"pdserve router: --api-keys-file='{tmp_path / 'absent'}': cannot read")


def test_a_malformed_keys_file_exits_2_naming_the_line_not_the_key(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-good acme\nsk-secret-one\n")
    assert main(["--api-keys-file", str(keys)]) == 2
    err = capsys.readouterr().err
    assert err == (f"pdserve router: line 2 of {keys}='<redacted>': expected '<key> <tenant> [admin]', a key of printable "
                   "ASCII without commas\n")


def test_protect_metrics_without_keys_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--protect-metrics"]) == 2
    assert capsys.readouterr().err == "pdserve router: --protect-metrics=True: needs --api-key or --api-keys-file\n"
