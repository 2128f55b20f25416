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
    """A package's patterns name files in its folder or below (`avx2/*.h`)."""
    for package, globs in patterns.items():
        folder = PACKAGE_ROOT.joinpath(*package.split("."))
        if path.is_relative_to(folder):
            inside = path.relative_to(folder).as_posix()
            if any(fnmatch.fnmatch(inside, pattern) and inside.count("/") == pattern.count("/") for pattern in globs):
                return True
    return False


def test_every_file_of_the_package_that_is_not_python_is_package_data() -> None:
    patterns = package_data()
    # compiled kernels (.so) are the build's own output (setup.py's extensions), not package data
    others = [p for p in (PACKAGE_ROOT / "pdserve").rglob("*")
              if p.is_file() and p.suffix not in (".py", ".pyc", ".so") and "__pycache__" not in p.parts]
    assert others, "the package has data files (native kernel sources at least)"
    missing = [str(p.relative_to(ROOT)) for p in others if not is_shipped(p, patterns)]
    assert not missing, f"not in [tool.setuptools.package-data] of pyproject.toml: {missing}"
