"""Certificates for the internal gRPC plane: a certificate authority and one certificate per process.

Each process's identity is its certificate's common name (a worker's id, or "router") and its
role the subject's organizational unit (`CN=decode-0, OU=decode`): what it may call on a
worker (`rpc/access.py`). A worker's certificate also names what it may be reached as, the DNS
names `worker.pdserve-internal` (every worker) and `prefill.pdserve-internal` (a prefill
worker): pdserve's clients check a server's certificate against the name of what they mean to
reach (`rpc/tls.py`), so no other role's certificate passes for a worker. Under each of those
it also names its identity, `<first 32 hex digits of sha256(identity)>.<name>` (a digest: an
identity need not be a DNS label), e.g. `<digest>.prefill.pdserve-internal`: a decode worker told
which prefill worker it dials checks that one name, role and identity at once. An identity holds
no "/": a worker id `<identity>/<instance>` names its certificate's identity before the first "/"
(`common/tls.speaks_for`). Its other subject alternative names, the host names and addresses it is dialled at, serve other TLS clients
(grpcurl). Keys are ECDSA P-256. A TLS folder holds what one process needs, named as a
Kubernetes TLS Secret names them: `ca.crt` (the authority it trusts), `tls.crt` and `tls.key`
(its own certificate and key).
"""
import datetime
import enum
import hashlib
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_CERT, CERT, KEY = "ca.crt", "tls.crt", "tls.key"
CA_KEY = "ca.key"
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
DEFAULT_VALID_DAYS = 365


class Role(enum.StrEnum):
    """What a certificate's holder is on the plane; a worker's is its `--role`."""

    ROUTER = "router"
    PROBE = "probe"  # health checks only
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"  # an aggregated worker


# The names a server's certificate is checked against, by what the client means to reach; no
# host may be one of them, or under INTERNAL_DOMAIN.
INTERNAL_DOMAIN = "pdserve-internal"
WORKER_NAME = f"worker.{INTERNAL_DOMAIN}"
PREFILL_WORKER_NAME = f"prefill.{INTERNAL_DOMAIN}"
REACHED_AS: dict[Role, tuple[str, ...]] = {
    Role.ROUTER: (), Role.PROBE: (),  # they serve no gRPC
    Role.PREFILL: (WORKER_NAME, PREFILL_WORKER_NAME), Role.DECODE: (WORKER_NAME,), Role.BOTH: (WORKER_NAME,),
}


def identity_name(identity: str, name: str) -> str:
    """The name under `name` (one of `REACHED_AS`) that only `identity`'s certificate carries."""
    return f"{hashlib.sha256(identity.encode()).hexdigest()[:32]}.{name}"


def reached_as(identity: str, role: Role) -> tuple[str, ...]:
    """Every internal name a certificate of `identity` in `role` carries: its role's names, and
    under each its identity's."""
    names = REACHED_AS[Role(role)]
    return (*names, *(identity_name(identity, name) for name in names))


@dataclass(frozen=True, slots=True)
class Issued:
    """One process's certificate and key, and the authority's certificate (all PEM)."""

    ca_cert: bytes
    cert: bytes
    key: bytes

    def write(self, folder: str | Path) -> Path:
        """Write `ca.crt`, `tls.crt` and `tls.key` (owner-only) into `folder` (made owner-only)."""
        path = Path(folder)
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        _write(path / CA_CERT, self.ca_cert, 0o644)
        _write(path / CERT, self.cert, 0o644)
        _write(path / KEY, self.key, 0o600)
        return path


class Authority:
    """A certificate authority that signs the certificates of one deployment."""

    def __init__(self, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
        self._key = key
        self.cert = cert

    @classmethod
    def create(cls, name: str, valid_days: int = DEFAULT_VALID_DAYS) -> "Authority":
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = _now()
        cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=valid_days))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                             content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False,
                                             encipher_only=False, decipher_only=False), critical=True)
                .sign(key, hashes.SHA256()))
        return cls(key, cert)

    @classmethod
    def load(cls, folder: str | Path) -> "Authority":
        path = Path(folder)
        key = serialization.load_pem_private_key((path / CA_KEY).read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{path / CA_KEY}: not an EC private key")
        return cls(key, x509.load_pem_x509_certificate((path / CA_CERT).read_bytes()))

    def save(self, folder: str | Path) -> None:
        """Write `ca.crt` and `ca.key` (owner-only): what issues more certificates later."""
        path = Path(folder)
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        _write(path / CA_CERT, self.cert_pem, 0o644)
        _write(path / CA_KEY, self._key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                      serialization.NoEncryption()), 0o600)

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, identity: str, role: Role, hosts: tuple[str, ...] = (),
              valid_days: int = DEFAULT_VALID_DAYS) -> Issued:
        """A certificate naming `identity` in `role`, for serving at `hosts` (plus this machine's
        loopback names and the names `reached_as` gives) and for calling others: both server and
        client authentication."""
        if not identity or len(identity) > 64:
            raise ValueError(f"identity {identity!r}: must be 1 to 64 characters")
        if "/" in identity:  # a worker id's "/" ends its identity, then names an instance
            raise ValueError(f"identity {identity!r}: holds no '/' (a worker id <identity>/<instance> names an "
                             "instance of one)")
        if identity == identity_of(self.cert_pem):  # would read as self-signed, and fail verification
            raise ValueError(f"identity {identity!r}: the authority's own name")
        role = Role(role)
        internal = [h for h in hosts if is_internal_name(h)]
        if internal:  # a decode worker's certificate naming prefill.pdserve-internal would pass for a prefill one
            raise ValueError(f"host {internal[0]!r}: the names under {INTERNAL_DOMAIN} are the roles' own")
        key = ec.generate_private_key(ec.SECP256R1())
        names = [_alt_name(host) for host in dict.fromkeys((*hosts, *LOCAL_HOSTS, *reached_as(identity, role))) if host]
        now = _now()
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, identity),
                             x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role.value)])
        cert = (x509.CertificateBuilder()
                .subject_name(subject)
                .issuer_name(self.cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(min(now + datetime.timedelta(days=valid_days), self.cert.not_valid_after_utc))
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.SubjectAlternativeName(names), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(self._key, hashes.SHA256()))
        key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
        return Issued(self.cert_pem, cert.public_bytes(serialization.Encoding.PEM), key_pem)


def is_internal_name(host: str) -> bool:
    """Whether `host` is one of the names under INTERNAL_DOMAIN, which only a role may give."""
    return host == INTERNAL_DOMAIN or host.endswith(f".{INTERNAL_DOMAIN}")


def identity_of(cert_pem: bytes) -> str:
    """The identity a certificate names (its common name)."""
    return _subject_value(cert_pem, NameOID.COMMON_NAME, "common name")


def dns_names_of(cert_pem: bytes) -> tuple[str, ...]:
    """The DNS names among a certificate's subject alternative names."""
    try:
        names = x509.load_pem_x509_certificate(cert_pem).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return ()
    return tuple(names.value.get_values_for_type(x509.DNSName))


def role_of(cert_pem: bytes) -> Role:
    """The role a certificate names (its organizational unit); ValueError when it names none,
    or no role of `Role` (a certificate issued before roles)."""
    value = _subject_value(cert_pem, NameOID.ORGANIZATIONAL_UNIT_NAME, "role (organizational unit)")
    try:
        return Role(value)
    except ValueError:
        raise ValueError(f"the certificate's role {value!r} is none of {', '.join(Role)}") from None


def _subject_value(cert_pem: bytes, oid: x509.ObjectIdentifier, what: str) -> str:
    values = x509.load_pem_x509_certificate(cert_pem).subject.get_attributes_for_oid(oid)
    if not values:
        raise ValueError(f"the certificate names no {what}")
    value = values[0].value
    return value if isinstance(value, str) else value.decode()


def _alt_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _write(path: Path, data: bytes, mode: int) -> None:
    """Write `data` to `path` created with `mode` (a key is never readable by others, not even briefly)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
