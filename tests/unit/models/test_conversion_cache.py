"""cache_key follows the source file's identity; write_file_atomically never leaves half a file."""
import logging
import os

import pytest

from pdserve.models.conversion_cache import cache_key, one_at_a_time, write_file_atomically


def test_key_changes_with_the_files_size_mtime_path_and_parts(tmp_path):
    source = tmp_path / "m.gguf"
    source.write_bytes(b"1234")
    key = cache_key(str(source), "weights", 1)
    assert len(key) == 24 and key == cache_key(str(source), "weights", 1)
    assert key != cache_key(str(source), "weights", 2)
    (tmp_path / "copy.gguf").write_bytes(b"1234")
    os.utime(tmp_path / "copy.gguf", ns=(source.stat().st_atime_ns, source.stat().st_mtime_ns))
    assert key != cache_key(str(tmp_path / "copy.gguf"), "weights", 1)
    stat = source.stat()
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    touched = cache_key(str(source), "weights", 1)
    assert touched != key
    source.write_bytes(b"12345")
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert cache_key(str(source), "weights", 1) != touched


def test_a_write_lands_whole_under_the_target_name(tmp_path):
    target = tmp_path / "deep" / "entry.bin"
    write_file_atomically(target, lambda scratch: scratch.write_bytes(b"new"))
    assert target.read_bytes() == b"new"
    assert [p.name for p in target.parent.iterdir()] == ["entry.bin"]


def test_a_failed_write_leaves_the_old_entry_and_no_scratch_file(tmp_path):
    target = tmp_path / "entry.bin"
    target.write_bytes(b"old")

    def fail_halfway(scratch):
        scratch.write_bytes(b"ha")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_file_atomically(target, fail_halfway)
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["entry.bin"]


def test_one_at_a_time_waits_for_the_holder_up_to_its_bound_then_goes_on(tmp_path, caplog):
    target = tmp_path / "cache" / "entry.bin"
    with one_at_a_time(target):
        with caplog.at_level(logging.WARNING), one_at_a_time(target, wait_s=0.1):
            pass  # reached only once the bound ran out
        assert "held its lock for 0.1 s" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING), one_at_a_time(target, wait_s=0.1):
        pass  # the first holder's lock went with its block
    assert caplog.text == ""


def test_one_at_a_time_where_no_lock_can_be_made_does_not_wait(tmp_path):
    (tmp_path / "not-a-folder").write_bytes(b"")
    with one_at_a_time(tmp_path / "not-a-folder" / "entry.bin", wait_s=1000):
        pass
