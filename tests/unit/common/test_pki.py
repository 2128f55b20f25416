"""Certificates of the internal plane: what `pki` issues, how a TLS folder is read, and when
settings may run the plane in plain text."""
import datetime
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from pdserve.common import pki
from pdserve.common.errors import ConfigError
from pdserve.common.tls import TlsConfig, resolve_tls


def test_an_issued_certificate_names_its_identity_role_and_hosts_and_is_signed_by_the_authority() -> None:
    authority = pki.Authority.create("test")
    issued = authority.issue("decode-0", pki.Role.DECODE, ("decode", "10.0.0.7"))
    cert = x509.load_pem_x509_certificate(issued.cert)
    assert (pki.identity_of(issued.cert), pki.role_of(issued.cert)) == ("decode-0", pki.Role.DECODE)
    assert cert.subject.rfc4514_string() == "OU=decode,CN=decode-0"
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["decode", "localhost", pki.WORKER_NAME,
                                                       pki.identity_name("decode-0", pki.WORKER_NAME)]
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["10.0.0.7", "127.0.0.1", "::1"]
    cert.verify_directly_issued_by(authority.cert)
    other = pki.Authority.create("other")
    with pytest.raises(Exception):
        cert.verify_directly_issued_by(other.cert)


def test_a_tls_folder_round_trips_and_its_key_is_owner_only(tmp_path: Path) -> None:
    issued = pki.Authority.create("test").issue("router", pki.Role.ROUTER)
    folder = issued.write(tmp_path / "router")
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE((folder / pki.KEY).stat().st_mode) == 0o600
    tls = TlsConfig.from_dir(str(folder))
    assert (tls.identity, tls.role, tls.cert, tls.key, tls.ca_cert) == (
        "router", pki.Role.ROUTER, issued.cert, issued.key, issued.ca_cert)
    assert "BEGIN" not in repr(tls)  # keys never reach a log line


def test_an_authority_saved_and_loaded_keeps_issuing_under_the_same_trust(tmp_path: Path) -> None:
    authority = pki.Authority.create("test")
    authority.save(tmp_path)
    assert stat.S_IMODE((tmp_path / pki.CA_KEY).stat().st_mode) == 0o600
    again = pki.Authority.load(tmp_path)
    issued = again.issue("prefill-1", pki.Role.PREFILL)
    x509.load_pem_x509_certificate(issued.cert).verify_directly_issued_by(authority.cert)


@pytest.mark.parametrize(("identity", "why"), [("", "1 to 64"), ("x" * 65, "1 to 64"),
                                               ("test", "the authority's own name"), ("p/pod-a", "holds no '/'")])
def test_an_identity_must_be_1_to_64_characters_without_a_slash_and_not_the_authority(identity: str,
                                                                                      why: str) -> None:
    with pytest.raises(ValueError, match=why):
        pki.Authority.create("test").issue(identity, pki.Role.DECODE)


def test_plain_text_only_when_asked_for_and_never_with_a_tls_folder(tmp_path: Path) -> None:
    assert resolve_tls(None, True, pki.Role.ROUTER) is None
    with pytest.raises(ConfigError, match="needs mutual TLS: give --tls-dir"):
        resolve_tls(None, False, pki.Role.ROUTER)
    with pytest.raises(ConfigError, match="cannot be combined with --insecure-internal"):
        resolve_tls(str(tmp_path), True, pki.Role.ROUTER)
    with pytest.raises(ConfigError, match="needs ca.crt, tls.crt and tls.key"):
        resolve_tls(str(tmp_path), False, pki.Role.ROUTER)


@pytest.mark.parametrize("role", list(pki.Role))
def test_each_role_is_reached_only_under_the_names_of_what_it_serves(role: pki.Role) -> None:
    cert = x509.load_pem_x509_certificate(pki.Authority.create("test").issue("p", role).cert)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    internal = [n for n in names.get_values_for_type(x509.DNSName) if pki.is_internal_name(n)]
    roles = {pki.Role.PREFILL: [pki.WORKER_NAME, pki.PREFILL_WORKER_NAME], pki.Role.DECODE: [pki.WORKER_NAME],
             pki.Role.BOTH: [pki.WORKER_NAME], pki.Role.ROUTER: [], pki.Role.PROBE: []}[role]
    assert internal == [*roles, *(pki.identity_name("p", name) for name in roles)]


def test_an_identity_is_named_under_its_roles_name_by_a_digest() -> None:
    """Identities need not be DNS labels ("prefill@10.0.0.7:50051"); their names differ by identity."""
    assert pki.identity_name("prefill@10.0.0.7:50051", pki.PREFILL_WORKER_NAME) == (
        "3073ad869816fa0fb16879a74517d083.prefill.pdserve-internal")
    assert pki.identity_name("p", pki.PREFILL_WORKER_NAME) != pki.identity_name("q", pki.PREFILL_WORKER_NAME)
    assert pki.identity_name("p", pki.PREFILL_WORKER_NAME) != pki.identity_name("p", pki.WORKER_NAME)


@pytest.mark.parametrize("host", ["prefill.pdserve-internal", "pdserve-internal", "x.worker.pdserve-internal"])
def test_no_host_may_be_a_name_only_a_role_gives(host: str) -> None:
    with pytest.raises(ValueError, match="the roles' own"):
        pki.Authority.create("test").issue("decode-0", pki.Role.DECODE, (host,))


def test_a_process_refuses_a_certificate_of_another_role_at_start(tmp_path: Path) -> None:
    folder = pki.Authority.create("test").issue("decode-0", pki.Role.DECODE).write(tmp_path)
    assert resolve_tls(str(folder), False, pki.Role.DECODE).role == pki.Role.DECODE
    with pytest.raises(ConfigError, match="of role 'decode' .'decode-0'.; this process needs one of role 'prefill'"):
        resolve_tls(str(folder), False, pki.Role.PREFILL)


def test_a_worker_refuses_a_certificate_issued_before_certificates_named_their_identity(tmp_path: Path) -> None:
    issued = certificate_with_subject(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "prefill-0"),
                                                 x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, "prefill")]),
                                      (pki.WORKER_NAME, pki.PREFILL_WORKER_NAME))
    folder = issued.write(tmp_path / "old")
    with pytest.raises(ConfigError, match=r"\('prefill-0'\) does not name '[0-9a-f]{32}\.(prefill|worker)\."
                                          r"pdserve-internal'.*pdserve certs --prefill prefill-0"):
        resolve_tls(str(folder), False, pki.Role.PREFILL)


def certificate_with_subject(subject: x509.Name, dns_names: tuple[str, ...] = ()) -> pki.Issued:
    """A TLS folder's files whose certificate names `subject` (self-signed: only read, never verified)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
               .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1)))
    if dns_names:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in dns_names]), False)
    cert = builder.sign(key, hashes.SHA256())
    pem = cert.public_bytes(serialization.Encoding.PEM)
    return pki.Issued(pem, pem, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption()))


@pytest.mark.parametrize(("subject", "why"), [
    ([x509.NameAttribute(NameOID.COMMON_NAME, "decode-0")], "names no role"),
    ([x509.NameAttribute(NameOID.COMMON_NAME, "decode-0"),
      x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, "admin")],
     "role 'admin' is none of router, probe, prefill, decode, both")])
def test_a_certificate_without_a_role_is_refused_naming_its_folder(tmp_path: Path, subject: list, why: str) -> None:
    folder = certificate_with_subject(x509.Name(subject)).write(tmp_path / "old")
    with pytest.raises(ConfigError, match=why) as refused:
        TlsConfig.from_dir(str(folder))
    assert str(folder) in str(refused.value) and "pdserve certs --<role> NAME" in str(refused.value)
