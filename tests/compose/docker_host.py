"""A Docker engine for the compose test: the daemon already running, or, as root with `dockerd`
installed, one of the test's own in a private directory, stopped (children and all) afterwards.

The test's own daemon keeps its data root (images, build cache) under the cache directory so
that a second run reuses the images; its sockets and state live in a fresh temporary directory.
It is started with the kernel's parent-death signal, so it never outlives the test process.
"""
import ctypes
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PR_SET_PDEATHSIG = 1
DAEMON_START_TIMEOUT_S = 60.0
DAEMON_STOP_TIMEOUT_S = 30.0
COMMAND_TIMEOUT_S = 600.0
# overlay2 first (fast builds); vfs where the kernel or the file system refuses overlay mounts.
STORAGE_DRIVERS = ("overlay2", "vfs")


class DockerUnavailable(Exception):
    """Why Docker cannot run here: the compose test is skipped with this reason."""


@dataclass
class DockerHost:
    env: dict[str, str]
    compose_command: list[str]
    daemon: subprocess.Popen | None = None
    exec_root: Path | None = None
    log_path: Path | None = None
    started: list[str] = field(default_factory=list)

    def docker(self, *args: str, timeout: float = COMMAND_TIMEOUT_S, check: bool = True,
               stdin: bytes | None = None) -> subprocess.CompletedProcess:
        return run(["docker", *args], self.env, timeout, check, stdin)

    def compose(self, *args: str, timeout: float = COMMAND_TIMEOUT_S, env: dict[str, str] | None = None,
                check: bool = True) -> subprocess.CompletedProcess:
        return run([*self.compose_command, *args], {**self.env, **(env or {})}, timeout, check, None)

    def has_image(self, tag: str) -> bool:
        return self.docker("image", "inspect", tag, check=False, timeout=60).returncode == 0

    def stop(self) -> list[str]:
        """Stop the test's own daemon; the command lines of its processes still alive after it."""
        if self.daemon is None:
            return []
        process, self.daemon = self.daemon, None
        family = descendants(process.pid) | {process.pid}
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=DAEMON_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=DAEMON_STOP_TIMEOUT_S)
        deadline = time.monotonic() + DAEMON_STOP_TIMEOUT_S
        while (left := survivors(family, str(self.exec_root))) and time.monotonic() < deadline:
            time.sleep(0.2)
        if self.exec_root is not None:
            shutil.rmtree(self.exec_root, ignore_errors=True)
        return left


def run(argv: list[str], env: dict[str, str], timeout: float, check: bool,
        stdin: bytes | None) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, env=env, input=stdin, capture_output=True, timeout=timeout)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} ... exited with {result.returncode}:\n"
                           f"{result.stderr.decode(errors='replace')[-3000:]}")
    return result


def open_docker_host(data_root: Path) -> DockerHost:
    """The running daemon if the client reaches one, else a daemon of our own."""
    if shutil.which("docker") is None:
        raise DockerUnavailable("no docker client on PATH (apt-get install docker.io)")
    env = dict(os.environ)
    compose = compose_command(env)
    if run(["docker", "info"], env, 60, False, None).returncode == 0:
        return DockerHost(env=env, compose_command=compose)
    if os.geteuid() != 0:
        raise DockerUnavailable("no Docker daemon is running and starting one needs root")
    if shutil.which("dockerd") is None:
        raise DockerUnavailable("no Docker daemon is running and dockerd is not installed (apt-get install docker.io)")
    errors = []
    for driver in STORAGE_DRIVERS:
        try:
            return start_daemon(data_root / driver, driver, compose)
        except DockerUnavailable as exc:
            errors.append(f"{driver}: {exc}")
    raise DockerUnavailable("dockerd did not start: " + "; ".join(errors))


def compose_command(env: dict[str, str]) -> list[str]:
    """`docker compose` (the v2 plugin) where installed, else the standalone docker-compose."""
    if run(["docker", "compose", "version"], env, 60, False, None).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise DockerUnavailable("neither `docker compose` nor docker-compose is installed (apt-get install docker-compose)")


def start_daemon(data_root: Path, driver: str, compose: list[str]) -> DockerHost:
    data_root.mkdir(parents=True, exist_ok=True)
    exec_root = Path(tempfile.mkdtemp(prefix="pdsd-"))  # short: unix socket paths are limited
    socket = exec_root / "docker.sock"
    log_path = data_root.parent / f"dockerd-{driver}.log"
    argv = ["dockerd", "--storage-driver", driver, "--iptables=false", "--ip6tables=false",
            "--data-root", str(data_root), "--exec-root", str(exec_root / "exec"),
            "--pidfile", str(exec_root / "docker.pid"), "-H", f"unix://{socket}"]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
    host = DockerHost(env={**os.environ, "DOCKER_HOST": f"unix://{socket}"}, compose_command=compose,
                      daemon=process, exec_root=exec_root, log_path=log_path)
    deadline = time.monotonic() + DAEMON_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            host.stop()
            raise DockerUnavailable(f"exited with {process.returncode} ({last_line(log_path)})")
        if socket.exists() and host.docker("info", check=False, timeout=30).returncode == 0:
            return host
        time.sleep(0.3)
    host.stop()
    raise DockerUnavailable(f"not ready within {DAEMON_START_TIMEOUT_S:.0f} s ({last_line(log_path)})")


def die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def last_line(path: Path) -> str:
    lines = path.read_text(errors="replace").strip().splitlines()
    return lines[-1][-300:] if lines else "no output"


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def survivors(family: set[int], marker: str) -> list[str]:
    """Command lines of processes still alive from `family`, or naming `marker` (containerd's
    shims leave the daemon's process tree but name its state directory)."""
    alive = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if text and (int(cmdline.parent.name) in family or marker in text):
            alive.append(text)
    return alive
