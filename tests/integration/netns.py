"""A small network of Linux network namespaces for multi-host tests: each "host" is a namespace
with one veth link into a bridge that lives in a hub namespace of its own (so the host's
firewall, e.g. Docker's FORWARD rules, never sees the traffic), and the test process reaches
every host through one more link from the root namespace.

    root (10.77.N.1) ──┐
    host a (10.77.N.10) ──┤ bridge in the hub namespace
    host b (10.77.N.11) ──┘

A process started with `ip netns exec <host>` sees `/etc/netns/<host>/hosts` as its `/etc/hosts`
(iproute2 bind-mounts it): `set_hosts` rewrites that file in place (same inode, so a running
process sees the change), which is how a test moves DNS names between addresses. Needs root and
iproute2; `unavailable_reason` says why not, for a skip."""
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

NETNS_ETC = Path("/etc/netns")


@dataclass(frozen=True)
class Host:
    name: str
    netns: str
    address: str
    link: str  # its veth end, inside its namespace


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"pdprobe{os.getpid() % 100000}"
    steps = [("netns", "add", probe), ("-n", probe, "link", "add", "pa", "type", "veth", "peer", "name", "pb"),
             ("netns", "exec", probe, "true")]  # a namespace, a veth pair in it, a process in it
    try:
        for step in steps:
            ip(*step)
    except subprocess.CalledProcessError as exc:
        return f"`ip {' '.join(exc.cmd[1:])}` failed: {exc.stderr.decode().strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


def _free_subnet() -> str:
    """A 10.77.N prefix no route of this machine uses (two test runs at once get two)."""
    routes = subprocess.run(["ip", "-4", "route"], check=True, capture_output=True, text=True, timeout=30).stdout
    for n in [os.getpid() % 200 + 20, *range(20, 250)]:
        if f"10.77.{n}." not in routes:
            return f"10.77.{n}"
    raise RuntimeError("no free 10.77.N.0/24 subnet")


@dataclass
class Network:
    tag: str = field(default_factory=lambda: f"pdmh{os.getpid() % 100000}")
    hosts: dict[str, Host] = field(default_factory=dict)
    _namespaces: list[str] = field(default_factory=list)
    _made_netns_etc: bool = False

    def __post_init__(self) -> None:
        try:
            self._build_hub()
        except BaseException:
            self.close()
            raise

    def _build_hub(self) -> None:
        self.subnet = _free_subnet()
        self.hub = self._add_namespace(f"{self.tag}-hub")
        self._in(self.hub, "link", "add", "br0", "type", "bridge")
        self._in(self.hub, "link", "set", "br0", "up")
        outer, inner = f"{self.tag}r0", f"{self.tag}r1"
        ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        self._plug(inner)
        ip("addr", "add", f"{self.subnet}.1/24", "dev", outer)
        ip("link", "set", outer, "up")

    def add_host(self, name: str) -> Host:
        """A namespace with an address on the bridge and a hosts file of its own (localhost only)."""
        i = len(self.hosts)
        netns = self._add_namespace(f"{self.tag}-{name}")  # close() removes it even if the rest fails
        link, plug = f"{self.tag}h{i}", f"{self.tag}b{i}"
        ip("link", "add", link, "type", "veth", "peer", "name", plug)
        ip("link", "set", link, "netns", netns)
        self._plug(plug)
        host = Host(name, netns, f"{self.subnet}.{10 + i}", link)
        self._in(netns, "addr", "add", f"{host.address}/24", "dev", link)
        self._in(netns, "link", "set", link, "up")
        self.hosts[name] = host
        self.set_hosts(host, {})
        return host

    def exec_argv(self, host: Host, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", host.netns, *argv]

    def set_hosts(self, host: Host, names: dict[str, list[str]]) -> None:
        """`host`'s /etc/hosts: each name -> its addresses (one line each), written in place."""
        self._made_netns_etc = self._made_netns_etc or not NETNS_ETC.exists()
        path = NETNS_ETC / host.netns / "hosts"
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = ["127.0.0.1 localhost"] + [f"{a} {name}" for name, addresses in names.items() for a in addresses]
        with open(path, "w") as hosts:  # truncate and write: the bind mount keeps following this inode
            hosts.write("\n".join(lines) + "\n")

    def cut(self, host: Host) -> None:
        """Take `host`'s link down: its packets go nowhere, its connections stall."""
        self._in(host.netns, "link", "set", host.link, "down")

    def close(self) -> None:
        """Remove every namespace (their links go with them) and every hosts file made."""
        for netns in reversed(self._namespaces):
            subprocess.run(["ip", "netns", "del", netns], capture_output=True, timeout=30)
            shutil.rmtree(NETNS_ETC / netns, ignore_errors=True)
        subprocess.run(["ip", "link", "del", f"{self.tag}r0"], capture_output=True, timeout=30)  # gone already
        if self._made_netns_etc:
            try:
                NETNS_ETC.rmdir()
            except OSError:
                pass  # someone else's namespaces have files there now

    def _add_namespace(self, netns: str) -> str:
        ip("netns", "add", netns)
        self._namespaces.append(netns)
        self._in(netns, "link", "set", "lo", "up")
        return netns

    def _plug(self, link: str) -> None:
        ip("link", "set", link, "netns", self.hub)
        self._in(self.hub, "link", "set", link, "master", "br0")
        self._in(self.hub, "link", "set", link, "up")

    def _in(self, netns: str, *args: str) -> None:
        ip("-n", netns, *args)
