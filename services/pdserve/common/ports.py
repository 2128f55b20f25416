"""Listening ports: picking free ones for a local launch, telling a busy one before a slow start."""
import random
import socket
from pathlib import Path

from pdserve.common.errors import ConfigError


def _probe_socket(host: str) -> socket.socket:
    family = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    # As the servers bind (gRPC and uvicorn set it): a port left in TIME_WAIT is free, one that
    # another process listens on is not.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return sock


def is_port_free(host: str, port: int) -> bool:
    """Whether a server could listen on `host:port` now."""
    with _probe_socket(host) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def check_port_free(flag: str, host: str, port: int) -> None:
    """Raise ConfigError naming `flag` (where the port came from) if `host:port` is taken."""
    if not is_port_free(host, port):
        raise ConfigError(flag, port, f"{host}:{port} is in use")


# The kernel hands out ports of this range to every bind to port 0 and every outgoing connection.
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_PICK = 10000  # clear of the well-known and the commonly registered ports
_PICKS_PER_PORT = 64


def quiet_port_range() -> range:
    """Ports below the kernel's ephemeral range, which nothing takes unasked: a port picked from
    it stays free while other processes start (a worker's transfer listener, an outgoing gRPC
    connection). Empty where that range is unknown or starts too low to leave room."""
    try:
        low = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return range(0)
    return range(_LOWEST_PICK, low) if low - _LOWEST_PICK >= 1024 else range(0)


def free_ports(host: str, count: int) -> tuple[int, ...]:
    """`count` distinct ports free on `host` now, from `quiet_port_range()` where it has room
    (else ones the kernel picks). They are held together while picked, then released; a server
    that still cannot bind one fails with its own error."""
    held: list[socket.socket] = []
    quiet = quiet_port_range()
    try:
        for port in random.sample(quiet, min(len(quiet), count * _PICKS_PER_PORT)):
            if len(held) == count:
                break
            sock = _probe_socket(host)
            try:
                sock.bind((host, port))
            except OSError:
                sock.close()
                continue
            held.append(sock)
        while len(held) < count:
            sock = _probe_socket(host)
            held.append(sock)
            sock.bind((host, 0))
        return tuple(int(sock.getsockname()[1]) for sock in held)
    finally:
        for sock in held:
            sock.close()
