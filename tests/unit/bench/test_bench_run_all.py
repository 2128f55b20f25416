"""benchmarks/run_all.py: missing scripts are reported, results and ratios are rendered."""
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import report_markdown  # noqa: E402
import run_all  # noqa: E402

MACHINE = {"cpu": "Test CPU", "cores": 2, "ram_gib": 24.0}
RESULT = {"benchmark": "x", "config": {"n": 3},
          "results": [{"mode": "agg", "tok_per_s": 100.0, "n": 3}, {"mode": "disagg", "tok_per_s": 150.0, "n": 3}]}


def test_missing_script_is_reported_as_missing_not_faked(monkeypatch, tmp_path):
    monkeypatch.setattr(run_all, "HERE", tmp_path)
    run = run_all.run_script("absent.py", [], tmp_path, timeout_s=5)
    assert run == {"name": "absent.py", "status": "missing", "seconds": 0.0}
    text = report_markdown.render_report("2026-01-01", MACHINE, [run])
    assert "| absent.py | missing | 0 |" in text
    assert "Not in this checkout: no figures." in text


def test_script_json_is_collected_and_failures_keep_their_output(monkeypatch, tmp_path):
    monkeypatch.setattr(run_all, "HERE", tmp_path)
    (tmp_path / "good.py").write_text(
        "import json, sys\njson.dump(%r, open(sys.argv[sys.argv.index('--json') + 1], 'w'))\n" % RESULT)
    (tmp_path / "bad.py").write_text("print('boom'); raise SystemExit(3)\n")
    assert run_all.run_script("good.py", [], tmp_path, 30)["result"] == RESULT
    bad = run_all.run_script("bad.py", [], tmp_path, 30)
    assert (bad["status"], bad["output_tail"]) == ("failed (exit 3)", "boom\n")


def test_report_states_machine_date_and_ratios_beside_figures():
    runs = [{"name": "agg.py", "status": "ok", "seconds": 1.0, "result": RESULT},
            {"name": "own.py", "status": "ok", "seconds": 1.0,
             "result": {**RESULT, "ratios": {"speedup": 1.5}}}]
    text = report_markdown.render_report("2026-01-01 00:00:00 UTC", MACHINE, runs)
    assert "Date: 2026-01-01 00:00:00 UTC" in text
    assert "Machine: cpu Test CPU, cores 2, ram_gib 24" in text
    assert "| agg | 100 | 3 |" in text and "| disagg | 150 | 3 |" in text
    assert "| tok_per_s: disagg / agg | 1.5 |" in text
    assert "| speedup | 1.5 |" in text
    assert "reported by the script" in text and "derived here" in text


@pytest.mark.parametrize("rows, expected", [
    ([{"a": "x", "v": 2.0}, {"a": "y", "v": 3.0}], {"v: y / x": 1.5}),
    ([{"v": 2.0}], {}),
    ([{"a": "x", "v": 0}, {"a": "y", "v": 3.0}], {}),
])
def test_derived_ratios(rows, expected):
    assert report_markdown.derived_ratios(rows) == expected


def test_other_json_scripts_in_the_directory_are_discovered(monkeypatch, tmp_path):
    monkeypatch.setattr(run_all, "HERE", tmp_path)
    (tmp_path / "extra.py").write_text("if __name__ == '__main__':\n    print('--json')\n")
    (tmp_path / "helper.py").write_text("X = 1\n")
    scripts = run_all.benchmark_scripts()
    assert "extra.py" in scripts and "helper.py" not in scripts
    assert list(scripts)[:len(run_all.EXPECTED_SCRIPTS)] == list(run_all.EXPECTED_SCRIPTS)
    assert scripts["extra.py"] == []
