"""load_gguf with a cache_dir: one entry per GGUF file and dtype, reused, rebuilt when damaged."""
import logging
import os
import threading
import time

import gguf
import pytest
import torch

from pdserve.common.model_source import default_model_path
from pdserve.engine.loading import gguf_cache, gguf_loader
from pdserve.engine.loading.gguf_loader import load_gguf
from pdserve.engine.model.runner import ModelRunner

from gguf_builders import make_hf_weights, write_gguf

Q4_1 = gguf.GGMLQuantizationType.Q4_1


@pytest.fixture()
def model(tmp_path) -> str:
    weights = make_hf_weights(untied=True)
    write_gguf(tmp_path / "m.gguf", weights, quantize={"model.layers.0.self_attn.q_proj.weight": Q4_1})
    return str(tmp_path / "m.gguf")


def refuse_conversion(monkeypatch) -> None:
    def refuse(path, dtype):
        raise AssertionError("converted although a valid cache entry exists")

    monkeypatch.setattr(gguf_loader, "convert_gguf", refuse)


def assert_same(left, right) -> None:
    assert left[0] == right[0]
    assert sorted(left[1]) == sorted(right[1])
    for name, tensor in left[1].items():
        assert tensor.dtype == right[1][name].dtype and torch.equal(tensor, right[1][name]), name


def test_first_load_writes_one_entry_that_the_next_load_reads(model, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    converted = load_gguf(model, torch.bfloat16, str(cache))
    entries = [p.name for p in cache.iterdir() if not p.name.startswith(".")]  # less the converters' lock file
    assert entries == [gguf_cache.entry_path(model, torch.bfloat16, str(cache)).name]
    assert_same(converted, gguf_loader.convert_gguf(model, torch.bfloat16))
    refuse_conversion(monkeypatch)
    assert_same(load_gguf(model, torch.bfloat16, str(cache)), converted)


def test_each_dtype_and_each_version_of_the_file_has_its_own_entry(model, tmp_path):
    cache = str(tmp_path / "cache")
    load_gguf(model, torch.bfloat16, cache)
    load_gguf(model, torch.float32, cache)
    stat = os.stat(model)
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    load_gguf(model, torch.float32, cache)
    names = sorted(p.name.split(".", 1)[1] for p in (tmp_path / "cache").iterdir() if not p.name.startswith("."))
    assert names == ["bfloat16.safetensors", "float32.safetensors", "float32.safetensors"]


@pytest.mark.parametrize("damage", ["truncate", "garbage", "wrong_dtype"])
def test_a_damaged_entry_is_converted_again_and_replaced(model, tmp_path, monkeypatch, caplog, damage):
    cache = str(tmp_path / "cache")
    good = load_gguf(model, torch.bfloat16, cache)
    entry = gguf_cache.entry_path(model, torch.bfloat16, cache)
    if damage == "truncate":
        entry.write_bytes(entry.read_bytes()[:-100])
    elif damage == "garbage":
        entry.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    else:  # a float32 entry under the bfloat16 entry's name
        load_gguf(model, torch.float32, cache)
        entry.write_bytes(gguf_cache.entry_path(model, torch.float32, cache).read_bytes())
    with caplog.at_level(logging.WARNING, logger=gguf_cache.__name__):
        assert_same(load_gguf(model, torch.bfloat16, cache), good)
    assert "ignoring damaged cache entry" in caplog.text
    refuse_conversion(monkeypatch)
    assert_same(load_gguf(model, torch.bfloat16, cache), good)  # the rewritten entry is valid


def test_an_unwritable_cache_still_loads_the_model(model, tmp_path, caplog):
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the cache directory should be")
    with caplog.at_level(logging.WARNING, logger=gguf_cache.__name__):
        config, tensors = load_gguf(model, torch.bfloat16, str(blocked))
    assert config["tie_word_embeddings"] is False and "lm_head.weight" in tensors
    assert "could not cache the converted model" in caplog.text


def test_bundled_model_cached_in_bfloat16_equals_its_conversion(tmp_path, monkeypatch):
    path = default_model_path()
    converted = load_gguf(path, torch.bfloat16, str(tmp_path))
    refuse_conversion(monkeypatch)
    cached = load_gguf(path, torch.bfloat16, str(tmp_path))
    assert_same(cached, converted)
    assert len(cached[1]) == 272 and cached[0]["num_hidden_layers"] == 30


def test_model_runner_load_passes_the_cache_dir_down(model, tmp_path):
    cache = str(tmp_path / "cache")
    runner = ModelRunner.load(model, "bfloat16", "cpu", num_blocks=4, cache_dir=cache)
    assert runner.dtype == torch.bfloat16
    assert gguf_cache.entry_path(model, torch.bfloat16, cache).is_file()


def test_processes_starting_together_convert_once_and_the_others_read_that_entry(model, tmp_path, monkeypatch):
    """`pdserve serve`'s workers start at once on an empty cache: one converts, the rest wait
    for its entry (each open of the lock file counts as a process of its own)."""
    conversions = []
    convert = gguf_loader.convert_gguf

    def slow_convert(path, dtype):
        conversions.append(path)
        time.sleep(0.3)  # long enough that every other loader finds the lock held
        return convert(path, dtype)

    monkeypatch.setattr(gguf_loader, "convert_gguf", slow_convert)
    cache, loaded = str(tmp_path / "cache"), []
    loaders = [threading.Thread(target=lambda: loaded.append(load_gguf(model, torch.bfloat16, cache)))
               for _ in range(3)]
    for loader in loaders:
        loader.start()
    for loader in loaders:
        loader.join(timeout=60)
    assert (len(conversions), len(loaded)) == (1, 3)
    for other in loaded[1:]:
        assert_same(other, loaded[0])
