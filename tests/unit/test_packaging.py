"""The wheel carries every file pdserve reads at run time, not only its Python modules: an image
or a plain `pip install` without the native kernels' sources could not start a worker."""
import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_ROOT = ROOT / "services"


def package_data() -> dict[str, list[str]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return config["tool"]["setuptools"]["package-data"]


def is_shipped(path: Path, patterns: dict[str, list[str]]) -> bool:
    relative = path.relative_to(PACKAGE_ROOT)
    package = ".".join(relative.parent.parts)
    return any(fnmatch.fnmatch(relative.name, pattern) for pattern in patterns.get(package, []))


def test_every_file_of_the_package_that_is_not_python_is_package_data() -> None:
    patterns = package_data()
    others = [p for p in (PACKAGE_ROOT / "pdserve").rglob("*")
              if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts]
    assert others, "the package has data files (native kernel sources at least)"
    missing = [str(p.relative_to(ROOT)) for p in others if not is_shipped(p, patterns)]
    assert not missing, f"not in [tool.setuptools.package-data] of pyproject.toml: {missing}"
