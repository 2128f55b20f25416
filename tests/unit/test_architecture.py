"""The package's import rules, read from the source (every `import` and `from ... import`,
at any depth): who may import whom, where torch may appear, and no import cycles.

    router        never torch, engine, worker or transfer (it must start light)
    router.openai never router.routing: it reaches workers only through router.backend
    router.routing never router.openai
    common        nothing of ours outside common; models: only common, never torch
    kvcache       only common; transfer never engine, router or worker; engine never
                  transfer, router or worker
    rpc           only common and kvcache (block keys) of ours, never torch: the wire, not a process
    rpc.gen       (generated stubs) only from rpc/: the one place that builds or unpacks
                  protobuf messages
Relative imports count as the absolute ones they name. A folder is one concern: no folder of a
single module (a module belongs with its neighbours), and its size is capped by how much of it
others use (its surface), not its file count: helpers only its own modules import are part of
the module they serve.
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
    ("pdserve.rpc", ("torch", "pdserve.engine", "pdserve.worker", "pdserve.router", "pdserve.transfer",
                     "pdserve.serve", "pdserve.bench", "pdserve.models")),
]
MAX_SURFACE = 16  # a folder's modules that code outside it imports
MAX_MODULES = 24  # a folder's modules in all


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, importer: str | None = None) -> set[str]:
    """Every module `path` (module `importer`) imports; `from a import b` counts as a.b when that
    is a module, and a relative import as the absolute one it names."""
    importer = importer or module_name(path)
    package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([module] if module else []))
            if module:
                found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names if f"{module}.{alias.name}" in MODULES)
    return found


SOURCES = {module_name(p): p for p in PACKAGE.rglob("*.py") if "gen" not in p.relative_to(PACKAGE).parts[:2]}
MODULES = set(SOURCES)
GRAPH = {name: imports_of(path, name) for name, path in SOURCES.items()}


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


def _folders() -> dict[str, set[str]]:
    """Each package folder's modules (its __init__ aside), by the folder's path in the package."""
    folders: dict[str, set[str]] = {}
    for name, path in SOURCES.items():
        if path.name != "__init__.py":
            folders.setdefault(str(path.parent.relative_to(PACKAGE)), set()).add(name)
    return folders


def surface(modules: set[str]) -> set[str]:
    """The modules of a folder that code outside it imports."""
    return {m for m in modules if any(m in GRAPH[other] for other in GRAPH if other not in modules
                                      and not is_under(other, m))}


def test_relative_imports_count_as_what_they_name(tmp_path):
    folder = tmp_path / "pdserve" / "router"
    folder.mkdir(parents=True)
    (folder / "x.py").write_text("from ..engine import llm\nfrom . import backend\nfrom .routing.planner import P\n")
    found = imports_of(folder / "x.py", "pdserve.router.x")
    assert {"pdserve.engine", "pdserve.router", "pdserve.router.routing.planner"} <= found
    assert "pdserve.router.backend" in found  # a module of ours, named in `from . import`


def test_no_folder_is_a_single_module():
    assert {folder: sorted(m) for folder, m in _folders().items() if len(m) == 1 and folder != "."} == {}


def test_a_folders_size_is_capped_by_its_surface():
    folders = _folders()
    assert {folder: len(m) for folder, m in folders.items() if len(m) > MAX_MODULES} == {}
    assert {folder: sorted(surface(m)) for folder, m in folders.items() if len(surface(m)) > MAX_SURFACE} == {}
