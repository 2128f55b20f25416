"""Only transfer/nixl*.py may import nixl; transfer/ never imports the engine, worker or router."""
import ast
from pathlib import Path

import pdserve

PACKAGE = Path(pdserve.__file__).parent


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_only_nixl_modules_import_nixl() -> None:
    importers = sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
                       if any(name.split(".")[0] == "nixl" for name in imported_modules(path)))
    assert importers == ["transfer/nixl_files.py", "transfer/nixl_transport.py"]


def test_transfer_imports_only_common_kvcache_and_itself() -> None:
    ours = {name for path in (PACKAGE / "transfer").glob("*.py") for name in imported_modules(path)
            if name.split(".")[0] == "pdserve"}
    assert {name.split(".")[1] for name in ours} <= {"common", "kvcache", "transfer"}
