"""Pages of checkpoint tensors read through a file map are given back once copied: the
process's memory drops, no value changes, and memory that is not a clean file map is never
touched (its contents would be lost)."""
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pdserve.engine.loading.mapped_pages import release_copied_pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
SIZE = 4 << 20  # bytes per tensor


def resident_kib(tensor: torch.Tensor) -> int:
    """Resident KiB of the map holding `tensor` (from /proc/self/smaps)."""
    address, rss, inside = tensor.data_ptr(), None, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and not head[0].endswith(":"):
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            inside = lo <= address < hi
        elif inside and head[0] == "Rss:":
            rss = int(head[1])
    assert rss is not None, "no map holds the tensor"
    return rss


@pytest.fixture
def mapped(tmp_path):
    g = torch.Generator().manual_seed(0)
    save_file({"a": torch.randn(SIZE // 2, generator=g).bfloat16(), "b": torch.randn(SIZE // 2, generator=g).bfloat16()},
              tmp_path / "w.safetensors")
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        yield f.get_tensor("a"), f.get_tensor("b")


def test_pages_of_a_copied_file_mapped_tensor_are_released_and_read_back_unchanged(mapped):
    a, b = mapped
    expected = a.clone(), b.clone()  # reads every page: all resident
    before = resident_kib(a)
    released = release_copied_pages([a])
    assert released >= SIZE - 2 * 4096  # all whole pages inside `a`
    assert resident_kib(a) <= before - released // 1024 + 8
    assert torch.equal(a, expected[0]) and torch.equal(b, expected[1])  # read back from the file


def test_memory_that_is_not_a_file_map_is_left_alone():
    anonymous = torch.randn(SIZE // 4)
    expected = anonymous.clone()
    assert release_copied_pages([anonymous, None]) == 0
    assert torch.equal(anonymous, expected)


def test_a_file_map_with_a_written_page_is_left_alone(tmp_path):
    (tmp_path / "raw").write_bytes(bytes(SIZE))
    private = torch.from_file(str(tmp_path / "raw"), shared=False, size=SIZE // 4, dtype=torch.float32)
    assert private.sum().item() == 0 and release_copied_pages([private]) > 0  # clean: released
    private[7] = 3.5  # its private copy of that page exists only in this process
    assert release_copied_pages([private]) == 0
    assert private[7].item() == 3.5 and private.sum().item() == 3.5
