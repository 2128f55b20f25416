"""The cache salt the router derives from a request's tenant and its client salt."""
import pytest

from pdserve.router.openai.access.tenants import Tenant, effective_cache_salt, is_tenant_name_ok

ACME, BOLT = Tenant("acme"), Tenant("bolt")


def test_without_tenants_the_client_salt_passes_as_given() -> None:
    assert effective_cache_salt(None, "s") == "s"
    assert effective_cache_salt(None, None) is None


def test_each_tenant_has_its_own_salt_even_without_a_client_salt() -> None:
    salt = effective_cache_salt(ACME, None)
    assert salt is not None and len(salt) == 64 and int(salt, 16) >= 0
    assert salt == effective_cache_salt(ACME, None)
    assert salt != effective_cache_salt(BOLT, None)


def test_a_client_salt_narrows_within_its_tenant() -> None:
    salts = {effective_cache_salt(ACME, s) for s in (None, "a", "b", "")}
    assert len(salts) == 4


@pytest.mark.parametrize("client_salt", ["bolt", "acme", "default", None, "", "\"bolt\"", "[\"bolt\", null]"])
def test_no_client_salt_reaches_another_tenants_salt(client_salt: str | None) -> None:
    bolts = {effective_cache_salt(BOLT, s) for s in (None, "x")}
    reached = effective_cache_salt(ACME, client_salt)
    assert reached not in bolts
    for derived in bolts:  # sending another tenant's derived salt is just one more salt of one's own
        assert effective_cache_salt(ACME, derived) not in bolts | {derived}


def test_tenant_and_salt_cannot_be_shifted_into_each_other() -> None:
    assert effective_cache_salt(Tenant("ab"), "c") != effective_cache_salt(Tenant("a"), "bc")


@pytest.mark.parametrize("name, ok", [("acme", True), ("a.b_c-1", True), ("9", True), ("", False),
                                      ("-x", False), ("a b", False), ("a" * 64, True), ("a" * 65, False)])
def test_tenant_names(name: str, ok: bool) -> None:
    assert is_tenant_name_ok(name) is ok
