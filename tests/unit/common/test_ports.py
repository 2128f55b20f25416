"""Ports: a listened-on port is busy (named by its flag), free ports are distinct and bindable."""
import socket

import pytest

from pdserve.common.errors import ConfigError
from pdserve.common.ports import check_port_free, free_ports, is_port_free


def test_a_port_someone_listens_on_is_busy_and_free_again_once_closed() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert is_port_free("127.0.0.1", port) is False
        with pytest.raises(ConfigError) as caught:
            check_port_free("--worker-port", "127.0.0.1", port)
    assert str(caught.value) == f"--worker-port={port}: 127.0.0.1:{port} is in use"
    assert is_port_free("127.0.0.1", port) is True


def test_free_ports_are_distinct_and_free() -> None:
    ports = free_ports("127.0.0.1", 4)
    assert len(set(ports)) == 4
    assert all(is_port_free("127.0.0.1", port) for port in ports)
