"""The package's import rules, read from the source (every `import` and `from ... import`,
at any depth): who may import whom, where torch may appear, and no import cycles.

    router        never torch, engine, worker or transfer (it must start light)
    router.openai never router.routing: it reaches workers only through router.backend
    router.routing never router.openai
    common        nothing of ours outside common; models: only common, never torch
    kvcache       only common; transfer never engine, router or worker; engine never
                  transfer, router or worker
    rpc.gen       (generated stubs) only from rpc/: the one place that builds or unpacks
                  protobuf messages
"""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[2] / "services" / "pdserve"
RULES = [  # (importer prefix, forbidden prefixes)
    ("pdserve.router", ("torch", "pdserve.engine", "pdserve.worker", "pdserve.transfer")),
    ("pdserve.router.openai", ("pdserve.router.routing",)),
    ("pdserve.router.routing", ("pdserve.router.openai",)),
    ("pdserve.common", ("pdserve.engine", "pdserve.kvcache", "pdserve.models", "pdserve.router", "pdserve.rpc",
                        "pdserve.transfer", "pdserve.worker", "pdserve.serve", "pdserve.bench", "torch")),
    ("pdserve.models", ("torch", "pdserve.engine", "pdserve.kvcache", "pdserve.router", "pdserve.rpc",
                        "pdserve.transfer", "pdserve.worker", "pdserve.serve")),
    ("pdserve.kvcache", ("torch", "pdserve.engine", "pdserve.models", "pdserve.router", "pdserve.rpc",
                         "pdserve.transfer", "pdserve.worker")),
    ("pdserve.transfer", ("pdserve.engine", "pdserve.router", "pdserve.worker")),
    ("pdserve.engine", ("pdserve.transfer", "pdserve.router", "pdserve.worker", "pdserve.rpc")),
    ("pdserve.bench", ("torch", "pdserve.engine", "pdserve.worker", "pdserve.router", "pdserve.transfer")),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports; `from a import b` counts as a.b when that is a module."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names
                         if f"{node.module}.{alias.name}" in MODULES)
    return found


SOURCES = {module_name(p): p for p in PACKAGE.rglob("*.py") if "gen" not in p.relative_to(PACKAGE).parts[:2]}
MODULES = set(SOURCES)
GRAPH = {name: imports_of(path) for name, path in SOURCES.items()}


def is_under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@pytest.mark.parametrize("importer, forbidden", RULES, ids=[r[0] for r in RULES])
def test_import_rules(importer, forbidden):
    violations = sorted(f"{name} imports {target}" for name, targets in GRAPH.items() if is_under(name, importer)
                        for target in targets if any(is_under(target, f) for f in forbidden))
    assert violations == []


def test_only_rpc_touches_generated_stubs_or_protobuf():
    users = sorted(name for name, targets in GRAPH.items() if not is_under(name, "pdserve.rpc")
                   and any(is_under(t, "pdserve.rpc.gen") or is_under(t, "google.protobuf") for t in targets))
    assert users == []


def test_no_import_cycles():
    internal = {name: {t for t in targets if t in MODULES and t != name} for name, targets in GRAPH.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(internal[name]):
            if state.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[name] = 2

    for name in sorted(internal):
        if name not in state:
            visit(name, [name])
    assert cycles == []


def test_no_package_folder_holds_more_than_sixteen_modules():
    counts: dict[str, int] = {}
    for path in SOURCES.values():
        if path.name != "__init__.py":
            counts[str(path.parent.relative_to(PACKAGE))] = counts.get(str(path.parent.relative_to(PACKAGE)), 0) + 1
    assert {folder: n for folder, n in counts.items() if n > 16} == {}
