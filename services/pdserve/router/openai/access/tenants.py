"""Tenants and the cache salt the router derives for each of them.

A tenant is who an API key belongs to (`common/api_keys.py`). Its requests get a cache salt derived from
its name, so two tenants never share a KV block (the salt is part of the first block's key,
and every later key chains from it). A client's own `cache_salt` only narrows isolation within
its tenant: the effective salt is SHA-256 over (tenant, client salt) in an unambiguous
encoding, so no client salt, not even another tenant's name or effective salt, yields another
tenant's salt without a SHA-256 collision.
"""
import hashlib
import json

from pdserve.common.api_keys import DEFAULT_TENANT, Tenant, is_tenant_name_ok

__all__ = ["DEFAULT_TENANT", "Tenant", "effective_cache_salt", "is_tenant_name_ok"]
_SALT_DOMAIN = b"pdserve cache salt v1\0"


def effective_cache_salt(tenant: Tenant | None, client_salt: str | None) -> str | None:
    """The salt a request's block keys are computed with. Without API keys (no tenant) the
    client's salt as given, as before tenants existed; with one, 64 hex digits."""
    if tenant is None:
        return client_salt
    encoded = json.dumps([tenant, client_salt], ensure_ascii=True).encode()  # injective: (t, s) <-> bytes
    return hashlib.sha256(_SALT_DOMAIN + encoded).hexdigest()
