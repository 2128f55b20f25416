"""Ports: a listened-on port is busy (named by its flag), free ports are distinct and bindable."""
import socket

import pytest

from pdserve.common.errors import ConfigError
from pdserve.common import ports
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


def test_free_ports_come_from_below_the_ephemeral_range_where_it_leaves_room(monkeypatch, tmp_path) -> None:
    ranges = tmp_path / "ip_local_port_range"
    monkeypatch.setattr(ports, "_EPHEMERAL_RANGE", ranges)
    ranges.write_text("32768\t60999\n")
    assert ports.quiet_port_range() == range(10000, 32768)
    assert all(10000 <= port < 32768 for port in free_ports("127.0.0.1", 8))
    ranges.write_text("10500\t60999\n")  # too little room below: the kernel picks
    assert ports.quiet_port_range() == range(0)
    assert len(set(free_ports("127.0.0.1", 3))) == 3
    ranges.unlink()
    assert ports.quiet_port_range() == range(0)
