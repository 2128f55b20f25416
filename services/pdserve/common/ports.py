"""Listening ports: picking free ones for a local launch, telling a busy one before a slow start."""
import socket

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


def free_ports(host: str, count: int) -> tuple[int, ...]:
    """`count` distinct ports free on `host` now. They are held together while picked, then
    released, so another process may still take one before it is bound: a server that then
    cannot bind fails with its own error."""
    held = [_probe_socket(host) for _ in range(count)]
    try:
        for sock in held:
            sock.bind((host, 0))
        return tuple(int(sock.getsockname()[1]) for sock in held)
    finally:
        for sock in held:
            sock.close()
