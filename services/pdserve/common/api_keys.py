"""API keys and the tenant each belongs to (the router's `/v1/` routes and, with
`--protect-metrics`, every process's `/metrics`).

A presented key is compared with every configured key in constant time (SHA-256 digests, so
also of equal length; every key is compared, matched or not). Keys never appear in a message.

Keys file (`--api-keys-file`): one `<key> <tenant>` pair per line, separated by whitespace,
optionally followed by the role `admin`; blank lines and lines starting with `#` are skipped.
Keys given with `--api-key` (or `PDSERVE_API_KEY`, comma-separated) belong to the tenant
`default` and are admin keys (the operator's). A key listed twice is an error. Only an admin
key may change what the server serves (load and unload LoRA adapters) or see adapters' folders.
"""
import hashlib
import hmac
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import NewType

from pdserve.common.config_options import is_api_key_ok
from pdserve.common.errors import ConfigError

Tenant = NewType("Tenant", str)
DEFAULT_TENANT = Tenant("default")  # whoever holds a key given with --api-key / PDSERVE_API_KEY
_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def is_tenant_name_ok(name: str) -> bool:
    """Letters, digits, '.', '_' and '-', starting with a letter or digit, at most 64."""
    return _TENANT_NAME.fullmatch(name) is not None


class ApiKeys:
    """Configured keys and their tenants. Holds only SHA-256 digests of the keys."""

    def __init__(self, tenants_by_key: Mapping[str, Tenant], admin_keys: Iterable[str] = ()) -> None:
        admins = frozenset(admin_keys)
        self._entries = [(_digest(key), tenant, key in admins) for key, tenant in tenants_by_key.items()]

    @property
    def num_keys(self) -> int:
        return len(self._entries)

    @property
    def tenants(self) -> frozenset[Tenant]:
        return frozenset(tenant for _, tenant, _ in self._entries)

    def tenant_of(self, presented: str) -> Tenant | None:
        caller = self.caller_of(presented)
        return caller[0] if caller is not None else None

    def caller_of(self, presented: str) -> tuple[Tenant, bool] | None:
        """(tenant, is an admin key) of the key `presented` is, or None. Takes the same time
        whichever key, if any, matches: every configured key is compared, each in constant time."""
        digest = _digest(presented)
        found = None
        for key_digest, tenant, is_admin in self._entries:
            if hmac.compare_digest(digest, key_digest):
                found = (tenant, is_admin)
        return found


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def load_api_keys(keys: Iterable[str], keys_file: str | None) -> ApiKeys:
    """`keys` (tenant `default`) and the keys file's pairs. Raises ConfigError for an unreadable
    or malformed file and for a key given twice, naming the line, never the key."""
    tenants_by_key: dict[str, Tenant] = {}
    admins = []
    for key in keys:
        _add(tenants_by_key, key, DEFAULT_TENANT, "--api-key")
        admins.append(key)
    if keys_file is not None:
        for where, key, tenant, is_admin in _read_keys_file(keys_file):
            _add(tenants_by_key, key, tenant, where)
            if is_admin:
                admins.append(key)
    return ApiKeys(tenants_by_key, admins)


def _add(tenants_by_key: dict[str, Tenant], key: str, tenant: Tenant, where: str) -> None:
    if key in tenants_by_key:
        raise ConfigError(where, "<redacted>", "this key is given twice")
    tenants_by_key[key] = tenant


def _read_keys_file(path: str) -> list[tuple[str, str, Tenant, bool]]:
    """(where, key, tenant, is admin) for each line in the file, where = "line N of <path>"."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("--api-keys-file", path, f"cannot read: {exc}") from None
    pairs = []
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        where = f"line {number} of {path}"
        if len(fields) not in (2, 3) or not is_api_key_ok(fields[0]):
            raise ConfigError(where, "<redacted>", "expected '<key> <tenant> [admin]', a key of printable ASCII "
                                                   "without commas")
        if not is_tenant_name_ok(fields[1]):
            raise ConfigError(where, fields[1], "a tenant is 1-64 letters, digits, '.', '_' or '-'")
        if len(fields) == 3 and fields[2] != "admin":
            raise ConfigError(where, fields[2], "the only role a key may have is 'admin'")
        pairs.append((where, fields[0], Tenant(fields[1]), len(fields) == 3))
    if not pairs:
        raise ConfigError("--api-keys-file", path, "holds no '<key> <tenant>' line")
    return pairs
