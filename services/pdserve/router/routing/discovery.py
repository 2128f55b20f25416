"""Workers found by DNS name (`--worker-dns NAME:PORT`): a Kubernetes headless Service or a
compose service name resolves to one address per replica, so scaling a Deployment needs no
change to the router's flags.

Every `interval_s` each name is resolved (the system resolver, bounded by `timeout_s`). An
address new behind a name is `add`ed to the pool (it joins on its first answer, through the
checks a `--worker` passes); one gone from every name is drained (`WorkerPool.drain`: out of
rotation and out of the index at once, forgotten once its streams end). A name that fails to
resolve (no answer in time, a server failure, even "no such name") keeps the addresses it had:
a resolver hiccup must not empty the cluster, and a worker truly gone is taken out of rotation
by its failed health polls anyway. A `--worker` address is never drained.
"""
import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Collection
from typing import Protocol

log = logging.getLogger(__name__)

Resolve = Callable[[str, int], Awaitable[Collection[str]]]  # (name, port) -> the IP addresses behind it


class Members(Protocol):
    """What discovery changes (`WorkerPool`)."""

    def add(self, address: str) -> None: ...

    def drain(self, address: str, reason: str) -> None: ...


def split_name(name_port: str) -> tuple[str, int]:
    """"prefill.pdserve.svc:50051" -> ("prefill.pdserve.svc", 50051) (validated by the settings)."""
    name, _, port = name_port.rpartition(":")
    return name, int(port)


def worker_address(ip: str, port: int) -> str:
    """The gRPC target of one resolved address: "10.0.0.7:50051", "[fd00::7]:50051"."""
    return f"[{ip}]:{port}" if ipaddress.ip_address(ip).version == 6 else f"{ip}:{port}"


def system_resolver(timeout_s: float) -> Resolve:
    """The system's resolver (`getaddrinfo`: /etc/hosts, then DNS, per nsswitch), bounded."""
    async def resolve(name: str, port: int) -> Collection[str]:
        async with asyncio.timeout(timeout_s):
            found = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
        return {str(sockaddr[0]).split("%", 1)[0] for *_, sockaddr in found}
    return resolve


class DnsDiscovery:
    def __init__(self, names: Collection[str], members: Members, resolve: Resolve, interval_s: float,
                 static: Collection[str] = ()) -> None:
        self._names = [split_name(n) for n in names]
        self._members = members
        self._resolve = resolve
        self._interval_s = interval_s
        self._static = frozenset(static)
        self._found: dict[str, frozenset[str]] = {}  # "name:port" -> the worker addresses behind it
        self._errors: dict[str, str] = {}  # "name:port" -> its last resolution error, while failing

    @property
    def addresses(self) -> frozenset[str]:
        """Every worker address behind a name at the last resolution."""
        return frozenset().union(*self._found.values())

    async def refresh(self) -> None:
        """Resolve every name once; admit the new addresses, drain those gone."""
        before = self.addresses
        results = await asyncio.gather(*(self._resolve_one(name, port) for name, port in self._names))
        for (name, port), found in zip(self._names, results, strict=True):
            if found is not None:
                self._found[f"{name}:{port}"] = found
        after = self.addresses
        for address in sorted(after - before):
            log.info("worker %s found behind %s", address, self._names_of(address))
            self._members.add(address)
        for address in sorted(before - after - self._static):
            self._members.drain(address, "its address left the DNS name")

    async def run(self) -> None:
        """Refresh every `interval_s` until cancelled; a refresh that fails unexpectedly is
        logged and the next one runs (discovery must outlive one bad answer)."""
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.refresh()
            except Exception:
                log.exception("worker discovery: refresh failed; trying again in %g s", self._interval_s)

    async def _resolve_one(self, name: str, port: int) -> frozenset[str] | None:
        """The worker addresses behind `name`; None if it could not be resolved (kept as it was;
        logged once per distinct error)."""
        key = f"{name}:{port}"
        try:
            ips = await self._resolve(name, port)
        except (OSError, TimeoutError) as exc:
            error = str(exc) or type(exc).__name__
            if self._errors.get(key) != error:
                self._errors[key] = error
                log.warning("resolving %s failed (%s); keeping its %d worker(s)", name, error,
                            len(self._found.get(key, ())))
            return None
        self._errors.pop(key, None)
        return frozenset(worker_address(ip, port) for ip in ips)

    def _names_of(self, address: str) -> str:
        return ", ".join(name for name, found in self._found.items() if address in found)
