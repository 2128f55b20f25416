"""read_gguf against gguf.GGUFReader: every metadata value and every tensor, on the bundled
SmolLM2 file and on small files written here with every value type; malformed files."""
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GgmlType
from gguf import GGUFValueType as VT

from pdserve.common.errors import ConfigError
from pdserve.models.gguf_file import GgufFile, read_gguf

SCALARS = [  # key, value, type
    ("t.u8", 200, VT.UINT8), ("t.i8", -100, VT.INT8), ("t.u16", 60000, VT.UINT16), ("t.i16", -30000, VT.INT16),
    ("t.u32", 4_000_000_000, VT.UINT32), ("t.i32", -2_000_000_000, VT.INT32), ("t.f32", 0.1, VT.FLOAT32),
    ("t.bool", True, VT.BOOL), ("t.str", "héllo 世界", VT.STRING), ("t.u64", 2**63 + 5, VT.UINT64),
    ("t.i64", -(2**62), VT.INT64), ("t.f64", 1e-300, VT.FLOAT64),
]
ARRAYS = [  # key, items, item type
    ("a.u8", [0, 255, 7], VT.UINT8), ("a.i32", [-1, 2, -3], VT.INT32), ("a.f32", [0.5, -2.25], VT.FLOAT32),
    ("a.bool", [True, False, True], VT.BOOL), ("a.u64", [2**64 - 1, 0], VT.UINT64),
    ("a.f64", [3.5, -0.0], VT.FLOAT64), ("a.str", ["a", "", "Ġthe", "🎉"], VT.STRING),
]
TENSORS = {  # name -> (numpy shape, type)
    "f32.weight": ((3, 64), GgmlType.F32), "f16.weight": ((2, 32), GgmlType.F16),
    "q8.weight": ((4, 64), GgmlType.Q8_0), "q41.weight": ((2, 96), GgmlType.Q4_1), "bias": ((5,), GgmlType.F32),
}


def write_every_type(path: Path, alignment: int | None = None) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, value, kind in SCALARS:
        writer.add_key_value(key, value, kind)
    for key, items, kind in ARRAYS:
        writer.add_key_value(key, items, VT.ARRAY, sub_type=kind)
    writer.add_key_value("a.nested", [[1, 2], [3]], VT.ARRAY, sub_type=VT.ARRAY)
    rng = np.random.default_rng(0)
    for name, (shape, kind) in TENSORS.items():
        values = rng.standard_normal(shape).astype(np.float32)
        if kind == GgmlType.F16:
            writer.add_tensor(name, values.astype(np.float16))
        elif kind == GgmlType.F32:
            writer.add_tensor(name, values)
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def assert_same_as_gguf_reader(ours: GgufFile, reader: gguf.GGUFReader, skip: tuple[str, ...] = ()) -> None:
    """Every key (in order), value, value type, tensor name/dims/type/offset and tensor byte."""
    reader_fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.") and k not in skip}
    assert [k for k in ours.metadata if k not in skip] == list(reader_fields)
    for key, field in reader_fields.items():
        assert ours.metadata[key] == field.contents(), key
        assert type(ours.metadata[key]) is type(field.contents()), key
        assert ours.value_types[key] == field.types[0], key
    assert (ours.alignment, ours.data_offset) == (reader.alignment, reader.data_offset)
    assert len(ours.tensors) == len(reader.tensors)
    for info, tensor in zip(ours.tensors, reader.tensors, strict=True):
        assert (info.name, info.dims, info.ggml_type, info.offset) == (
            tensor.name, tuple(int(d) for d in tensor.shape), tensor.tensor_type, tensor.data_offset)
        data = np.frombuffer(ours.data(info, tensor.n_bytes), dtype=np.uint8)
        assert np.array_equal(data, tensor.data.reshape(-1).view(np.uint8)), info.name


def test_bundled_smollm2_file_reads_exactly_as_gguf_reader_reads_it(smollm_gguf_path):
    ours = read_gguf(smollm_gguf_path)
    assert_same_as_gguf_reader(ours, gguf.GGUFReader(smollm_gguf_path))
    assert ours.version == 3
    assert len(ours.metadata["tokenizer.ggml.tokens"]) == 49152
    assert ours.metadata["tokenizer.ggml.merges"][0] == "Ġ t"


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_type_and_tensor_type_reads_as_written(tmp_path, alignment):
    write_every_type(tmp_path / "m.gguf", alignment)
    ours = read_gguf(str(tmp_path / "m.gguf"))
    assert_same_as_gguf_reader(ours, gguf.GGUFReader(str(tmp_path / "m.gguf")), skip=("a.nested",))
    assert ours.metadata["a.nested"] == [[1, 2], [3]]
    assert ours.alignment == (alignment or 32)
    assert all(t.offset % ours.alignment == 0 for t in ours.tensors)
    expected = {key: value for key, value, _ in SCALARS if key not in ("t.f32",)}
    assert {k: ours.metadata[k] for k in expected} == expected
    assert ours.metadata["t.f32"] == struct.unpack("<f", struct.pack("<f", 0.1))[0]
    assert {key: ours.metadata[key] for key, _, _ in ARRAYS if key != "a.f32"} == {
        key: items for key, items, _ in ARRAYS if key != "a.f32"}


def test_data_past_the_end_of_the_file_is_a_config_error(tmp_path):
    write_every_type(tmp_path / "m.gguf")
    ours = read_gguf(str(tmp_path / "m.gguf"))
    last = ours.tensors[-1]
    with pytest.raises(ConfigError) as err:
        ours.data(last, len(ours.buffer))
    assert err.value.field == "model"
    assert last.name in err.value.reason


def reason_for(path: Path) -> str:
    with pytest.raises(ConfigError) as err:
        read_gguf(str(path))
    assert (err.value.field, err.value.value) == ("model", str(path))
    return err.value.reason


def test_malformed_files_are_config_errors_naming_the_file(tmp_path):
    write_every_type(tmp_path / "good.gguf")
    good = (tmp_path / "good.gguf").read_bytes()
    header_end = good.index(b"a.nested")
    cases = {
        "empty": b"",
        "magic": b"GGML" + good[4:],
        "version": good[:4] + struct.pack("<I", 1) + good[8:],
        "cut": good[:header_end],
        "duplicate": good.replace(b"t.i8", b"t.u8"),
        "value_type": good.replace(b"t.u8" + struct.pack("<I", VT.UINT8), b"t.u8" + struct.pack("<I", 99)),
    }
    reasons = {}
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        reasons[name] = reason_for(tmp_path / name)
    assert reasons["empty"] == "empty file, not a GGUF file"
    assert reasons["magic"] == "not a GGUF file (bad magic bytes)"
    assert reasons["version"] == "GGUF version 1 is not supported (little-endian versions 2 and 3 are)"
    assert reasons["cut"].startswith("malformed GGUF file: ")
    assert reasons["duplicate"] == "metadata key 't.u8' appears twice"
    assert reasons["value_type"] == "malformed GGUF file: 99 is not a valid GgufValueType"


def test_big_endian_files_are_refused(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "be.gguf"), "llama", endianess=gguf.GGUFEndian.BIG)
    writer.add_uint32("x", 1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    assert reason_for(tmp_path / "be.gguf") == (
        "a big-endian GGUF file is not supported (little-endian versions 2 and 3 are)")


def test_alignment_must_be_a_uint32_power_of_two(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "a.gguf"), "llama")
    writer.add_key_value("general.alignment", 48, VT.UINT32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ConfigError) as err:
        read_gguf(str(tmp_path / "a.gguf"))
    assert (err.value.field, err.value.value) == ("general.alignment", 48)
