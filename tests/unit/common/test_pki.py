"""Certificates of the internal plane: what `pki` issues, how a TLS folder is read, and when
settings may run the plane in plain text."""
import stat
from pathlib import Path

import pytest
from cryptography import x509

from pdserve.common import pki
from pdserve.common.errors import ConfigError
from pdserve.common.tls import TlsConfig, resolve_tls


def test_an_issued_certificate_names_its_identity_and_hosts_and_is_signed_by_the_authority() -> None:
    authority = pki.Authority.create("test")
    issued = authority.issue("decode-0", ("decode", "10.0.0.7"))
    cert = x509.load_pem_x509_certificate(issued.cert)
    assert pki.identity_of(issued.cert) == "decode-0"
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["decode", "localhost", pki.INTERNAL_NAME]
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["10.0.0.7", "127.0.0.1", "::1"]
    cert.verify_directly_issued_by(authority.cert)
    other = pki.Authority.create("other")
    with pytest.raises(Exception):
        cert.verify_directly_issued_by(other.cert)


def test_a_tls_folder_round_trips_and_its_key_is_owner_only(tmp_path: Path) -> None:
    issued = pki.Authority.create("test").issue("router")
    folder = issued.write(tmp_path / "router")
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE((folder / pki.KEY).stat().st_mode) == 0o600
    tls = TlsConfig.from_dir(str(folder))
    assert (tls.identity, tls.cert, tls.key, tls.ca_cert) == ("router", issued.cert, issued.key, issued.ca_cert)
    assert "BEGIN" not in repr(tls)  # keys never reach a log line


def test_an_authority_saved_and_loaded_keeps_issuing_under_the_same_trust(tmp_path: Path) -> None:
    authority = pki.Authority.create("test")
    authority.save(tmp_path)
    assert stat.S_IMODE((tmp_path / pki.CA_KEY).stat().st_mode) == 0o600
    again = pki.Authority.load(tmp_path)
    x509.load_pem_x509_certificate(again.issue("prefill-1").cert).verify_directly_issued_by(authority.cert)


@pytest.mark.parametrize(("identity", "why"), [("", "1 to 64"), ("x" * 65, "1 to 64"),
                                               ("test", "the authority's own name")])
def test_an_identity_must_be_1_to_64_characters_and_not_the_authority(identity: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        pki.Authority.create("test").issue(identity)


def test_plain_text_only_when_asked_for_and_never_with_a_tls_folder(tmp_path: Path) -> None:
    assert resolve_tls(None, insecure_internal=True) is None
    with pytest.raises(ConfigError, match="needs mutual TLS: give --tls-dir"):
        resolve_tls(None, insecure_internal=False)
    with pytest.raises(ConfigError, match="cannot be combined with --insecure-internal"):
        resolve_tls(str(tmp_path), insecure_internal=True)
    with pytest.raises(ConfigError, match="needs ca.crt, tls.crt and tls.key"):
        resolve_tls(str(tmp_path), insecure_internal=False)
