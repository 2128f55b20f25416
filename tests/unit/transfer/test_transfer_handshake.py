import json
import struct

import pytest

from pdserve.common.errors import IncompatiblePeerError
from pdserve.common.ids import WorkerId
from pdserve.transfer.handshake import PeerMetadata
from pdserve.transfer.layout import KvLayoutSpec

SPEC = KvLayoutSpec("m", "bfloat16", num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=4)
METADATA = PeerMetadata(WorkerId("decode-0"), SPEC, num_blocks=64, base_addr=0x7F00_0000_1000,
                        mem_type="DRAM", device_id=0, transport_blob=b"\x00agent\xffbytes")


def encode_header(header: dict[str, object], blob: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return b"PDKV" + struct.pack(">I", len(raw)) + raw + blob


def header(**overrides: object) -> dict[str, object]:
    fields = {"worker_id": "decode-0", "spec": SPEC.to_dict(), "num_blocks": 64, "base_addr": 4096,
              "mem_type": "DRAM", "device_id": 0}
    return {**fields, **overrides}


def test_round_trip_keeps_every_field_and_the_opaque_blob() -> None:
    raw = METADATA.encode()
    assert raw.startswith(b"PDKV")
    assert raw.endswith(b"\x00agent\xffbytes")
    assert PeerMetadata.decode(raw) == METADATA


@pytest.mark.parametrize(("raw", "message"), [
    (b"", "peer metadata does not start with b'PDKV'"),
    (b"XXXX\x00\x00\x00\x02{}", "peer metadata does not start with b'PDKV'"),
    (b"PDKV\x00\x00\x01\x00{}", "peer metadata is truncated: header of 256 bytes announced, 2 present"),
    (b"PDKV\x00\x00\x00\x02[]", "peer metadata header is not an object: []"),
])
def test_malformed_framing_is_refused(raw: bytes, message: str) -> None:
    with pytest.raises(IncompatiblePeerError) as raised:
        PeerMetadata.decode(raw)
    assert str(raised.value) == message


def test_non_json_header_is_refused() -> None:
    with pytest.raises(IncompatiblePeerError, match="^peer metadata header is not JSON: "):
        PeerMetadata.decode(b"PDKV\x00\x00\x00\x03{x}")


def test_missing_header_fields_are_named() -> None:
    fields = header()
    del fields["base_addr"], fields["device_id"]
    with pytest.raises(IncompatiblePeerError) as raised:
        PeerMetadata.decode(encode_header(fields))
    assert str(raised.value) == "peer metadata lacks fields: base_addr, device_id"


@pytest.mark.parametrize(("overrides", "message"), [
    ({"num_blocks": 0}, "peer metadata num_blocks=0: no blocks"),
    ({"num_blocks": "64"}, "peer metadata num_blocks='64': not a non-negative integer"),
    ({"base_addr": -1}, "peer metadata base_addr=-1: not a non-negative integer"),
    ({"spec": "bf16"}, "peer metadata spec is not an object: 'bf16'"),
    ({"spec": {**SPEC.to_dict(), "head_dim": 0}},
     "peer layout spec is invalid: head_dim=0: must be a positive integer"),
])
def test_bad_header_values_are_refused(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(IncompatiblePeerError) as raised:
        PeerMetadata.decode(encode_header(header(**overrides)))
    assert str(raised.value) == message


def test_unknown_memory_type_is_refused() -> None:
    with pytest.raises(IncompatiblePeerError) as raised:
        PeerMetadata.decode(encode_header(header(mem_type="HBM")))
    assert str(raised.value) == "peer metadata mem_type='HBM': not one of ('DRAM', 'VRAM')"
