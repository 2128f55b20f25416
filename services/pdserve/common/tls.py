"""A process's credentials on the internal gRPC plane (mutual TLS), read from a TLS folder.

Every gRPC server requires a client certificate signed by the same authority, and every
client presents its own: a caller without one gets no answer at all. The identity in a
certificate is the process's name on the plane (a worker's id, or "router"), its role what the
process may call (`pki.Role`, `rpc/access.py`).
"""
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.common import pki
from pdserve.common.errors import ConfigError


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """PEM bytes of the authority to trust and of this process's certificate and key."""

    ca_cert: bytes = field(repr=False)
    cert: bytes = field(repr=False)
    key: bytes = field(repr=False)
    identity: str
    role: pki.Role

    @classmethod
    def from_dir(cls, folder: str, setting: str = "--tls-dir") -> "TlsConfig":
        """Read `ca.crt`, `tls.crt` and `tls.key` from `folder`; ConfigError naming `setting`
        when one is missing or unreadable or the certificate names no identity or no role."""
        path = Path(folder)
        try:
            ca_cert, cert, key = ((path / name).read_bytes() for name in (pki.CA_CERT, pki.CERT, pki.KEY))
        except OSError as exc:
            raise ConfigError(setting, folder, f"needs {pki.CA_CERT}, {pki.CERT} and {pki.KEY}: {exc}") from None
        try:
            identity, role = pki.identity_of(cert), pki.role_of(cert)
        except ValueError as exc:
            raise ConfigError(setting, folder, f"{pki.CERT}: {exc}; issue it again with `pdserve certs --<role> "
                                               "NAME` (roles: router, probe, prefill, decode, both)") from None
        return cls(ca_cert, cert, key, identity, role)

    @classmethod
    def from_issued(cls, issued: pki.Issued) -> "TlsConfig":
        return cls(issued.ca_cert, issued.cert, issued.key, pki.identity_of(issued.cert), pki.role_of(issued.cert))


def resolve_tls(tls_dir: str | None, insecure_internal: bool, role: pki.Role,
                setting: str = "--tls-dir") -> TlsConfig | None:
    """The TLS credentials settings ask for, for a process in `role`; None for plain text, which
    must be asked for explicitly. ConfigError when neither or both are given, or when the
    certificate is of another role."""
    if insecure_internal:
        if tls_dir:
            raise ConfigError(setting, tls_dir, "cannot be combined with --insecure-internal")
        return None
    if not tls_dir:
        raise ConfigError(setting, tls_dir, "the internal gRPC plane needs mutual TLS: give --tls-dir (a folder "
                                            "with ca.crt, tls.crt and tls.key; `pdserve certs` makes them) or "
                                            "--insecure-internal for plain text")
    tls = TlsConfig.from_dir(tls_dir, setting)
    if tls.role != role:
        raise ConfigError(setting, tls_dir, f"{pki.CERT} is a certificate of role {tls.role.value!r} "
                                            f"({tls.identity!r}); this process needs one of role {role.value!r}")
    missing = set(pki.reached_as(tls.identity, role)) - set(pki.dns_names_of(tls.cert))
    if missing:  # issued before certificates named their identity: no decode worker could reach it
        raise ConfigError(setting, tls_dir, f"{pki.CERT} ({tls.identity!r}) does not name {min(missing)!r}, a "
                                            f"name every {role.value} certificate carries; issue it again with "
                                            f"`pdserve certs --{role.value} {tls.identity}`")
    return tls


INSECURE_WARNING = ("INSECURE: the internal gRPC plane runs in plain text (--insecure-internal): anyone who can "
                    "reach this process's gRPC port can read and write its KV cache")


def speaks_for(identity: str, worker_id: str) -> bool:
    """Whether a certificate naming `identity` may act as `worker_id`: its own name, or one of
    its instances, `<identity>/<instance>` (the pods of one Deployment share a certificate,
    each instance named after its pod, so NIXL agent names stay distinct)."""
    return worker_id == identity or worker_id.startswith(identity + "/")


def identity_of_worker(worker_id: str) -> str:
    """The identity whose certificate a worker of `worker_id` holds: the id before its first "/"
    (an identity holds none, `pki.Authority.issue`)."""
    return worker_id.partition("/")[0]

