"""Markdown for `run_all.py`: machine and date, a summary, then one section per script.

Absolute figures and same-run ratios are shown side by side: the script's own `ratios`
when it reports them, otherwise every numeric column of its result rows divided by the
first row's (the first row is the baseline of that run).
"""
import json
import math

MAX_CONFIG_CHARS = 400


def _fmt(value: object) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:,.0f}"
    if isinstance(value, (dict, list)):
        return json.dumps(value)[:80]
    return str(value)


def _table(header: list[str], rows: list[list[object]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(cell).replace("|", "\\|") for cell in row) + " |" for row in rows]
    return lines


def _row_label(row: dict, columns: list[str]) -> str:
    text_columns = [c for c in columns if isinstance(row.get(c), str)]
    return " / ".join(row[c] for c in text_columns) or "row"


def derived_ratios(rows: list[dict]) -> dict[str, float]:
    """Each numeric column of rows[1:] over rows[0], where the two differ and rows[0] != 0."""
    if len(rows) < 2 or not all(isinstance(r, dict) for r in rows):
        return {}
    columns = [c for c in rows[0] if isinstance(rows[0][c], (int, float)) and not isinstance(rows[0][c], bool)]
    base_label = _row_label(rows[0], list(rows[0]))
    ratios = {}
    for row in rows[1:]:
        for column in columns:
            value, base = row.get(column), rows[0][column]
            if isinstance(value, (int, float)) and base and value != base:
                ratios[f"{column}: {_row_label(row, list(row))} / {base_label}"] = value / base
    return ratios


def _results_section(result: dict) -> list[str]:
    rows = result.get("results")
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
        scalars = {k: v for k, v in result.items() if k not in ("machine", "config", "ratios")}
        return ["Figures:", ""] + _table(["key", "value"], [[k, v] for k, v in scalars.items()])
    columns = list(dict.fromkeys(c for row in rows for c in row))
    return ["Absolute figures:", ""] + _table(columns, [[row.get(c, "") for c in columns] for row in rows])


def _ratios_section(result: dict) -> list[str]:
    ratios = result.get("ratios")
    source = "reported by the script"
    if not isinstance(ratios, dict) or not ratios:
        ratios = derived_ratios(result.get("results") or [])
        source = "derived here: each row over the first row of the same run"
    if not ratios:
        return ["Ratios measured in the same run: none (the script reports a single configuration)."]
    return [f"Ratios measured in the same run ({source}):", ""] + _table(
        ["ratio", "value"], [[name, value] for name, value in ratios.items()])


def _script_section(run: dict) -> list[str]:
    lines = [f"## {run['name']}", "", f"Status: {run['status']} ({run['seconds']:.1f} s)", ""]
    if run["status"] == "missing":
        return lines[:3] + ["", "Not in this checkout: no figures.", ""]
    if "result" not in run:
        return lines + ["```", run.get("output_tail", "").rstrip(), "```", ""]
    result = run["result"]
    if isinstance(result.get("config"), dict):
        lines += [f"Configuration: `{json.dumps(result['config'])[:MAX_CONFIG_CHARS]}`", ""]
    return lines + _results_section(result) + [""] + _ratios_section(result) + [""]


def render_report(date: str, machine: dict, runs: list[dict]) -> str:
    """The whole Markdown report for `runs` (dicts made by `run_all.run_script`)."""
    lines = ["# pdserve benchmark report", "", f"Date: {date}", "",
             "Machine: " + ", ".join(f"{k} {_fmt(v)}" for k, v in machine.items()), "",
             "Figures on a shared or small machine are noisy; compare the ratios, which were "
             "measured side by side in the same run, before the absolute figures.", "",
             "## Summary", ""]
    lines += _table(["script", "status", "seconds"], [[r["name"], r["status"], r["seconds"]] for r in runs])
    lines.append("")
    for run in runs:
        lines += _script_section(run)
    return "\n".join(lines).rstrip() + "\n"
