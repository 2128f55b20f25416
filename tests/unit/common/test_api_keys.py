"""`ApiKeys`: keys and their tenants, from flags and the keys file."""
from pathlib import Path

import pytest

from pdserve.common.errors import ConfigError
from pdserve.common.api_keys import ApiKeys, load_api_keys
from pdserve.router.openai.access.tenants import DEFAULT_TENANT, Tenant

KEYS = ApiKeys({"key-a": Tenant("acme"), "key-b": Tenant("bolt")})


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "keys.txt"
    path.write_text(text)
    return str(path)


def test_a_key_names_its_tenant_and_anything_else_none() -> None:
    assert [KEYS.tenant_of(k) for k in ("key-a", "key-b", "key-c", "", "key-a ", "KEY-A")] == [
        "acme", "bolt", None, None, None, None]
    assert (KEYS.num_keys, KEYS.tenants) == (2, {"acme", "bolt"})


def test_keys_are_held_as_digests_only() -> None:
    assert [len(digest) for digest, *_ in KEYS._entries] == [32, 32]
    assert "key-a" not in repr(KEYS._entries)


def test_keys_file_and_flag_keys(tmp_path: Path) -> None:
    path = write(tmp_path, "# key tenant\n\nk1 acme\n  k2\tbolt  \nk3 acme\n")
    keys = load_api_keys(["flag-key"], path)
    assert [keys.tenant_of(k) for k in ("k1", "k2", "k3", "flag-key")] == ["acme", "bolt", "acme", DEFAULT_TENANT]


def test_admin_keys_are_the_flag_keys_and_those_the_file_marks(tmp_path: Path) -> None:
    keys = load_api_keys(["flag-key"], write(tmp_path, "k1 acme\nk2 ops admin\n"))
    assert [keys.caller_of(k) for k in ("k1", "k2", "flag-key", "nope")] == [
        ("acme", False), ("ops", True), (DEFAULT_TENANT, True), None]


@pytest.mark.parametrize("text, where", [
    ("k1 acme extra\n", "line 1 of"),
    ("k1\n", "line 1 of"),
    ("ok acme\nk,2 acme\n", "line 2 of"),
    ("k1 -bad\n", "line 1 of"),
    ("k1 acme\nk1 bolt\n", "line 2 of"),
    ("# nothing\n", "--api-keys-file"),
])
def test_a_bad_keys_file_names_the_line_never_the_key(tmp_path: Path, text: str, where: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_api_keys([], write(tmp_path, text))
    assert caught.value.field.startswith(where)
    assert "k1" not in str(caught.value) and "k,2" not in str(caught.value)


def test_a_key_given_by_flag_and_in_the_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="given twice"):
        load_api_keys(["k1"], write(tmp_path, "k1 acme\n"))


def test_a_missing_keys_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_api_keys([], str(tmp_path / "absent"))
