"""`pdserve certs` for deployments, and the throwaway certificates of a `pdserve serve` launch."""
from pathlib import Path

import pytest
from cryptography import x509

from pdserve.common import pki
from pdserve.common.tls import TlsConfig
from pdserve.serve.certs import main, with_serve_certs
from pdserve.serve.settings import resolve_serve_settings


def test_serve_issues_each_process_a_certificate_of_its_worker_id_under_one_fresh_authority(tmp_path: Path) -> None:
    settings = resolve_serve_settings(["--model", "/m/tiny.gguf", "--worker-port", "50051"], {})
    with_certs = with_serve_certs(settings, tmp_path)
    router = TlsConfig.from_dir(with_certs.router.tls_dir)
    workers = [TlsConfig.from_dir(w.tls_dir) for w in with_certs.workers]
    assert router.identity == "router"
    assert [w.identity for w in workers] == ["prefill@127.0.0.1:50051", "decode@127.0.0.1:50052"]
    assert [w.worker_id for w in with_certs.workers] == [w.identity for w in workers]
    assert {w.ca_cert for w in workers} == {router.ca_cert}
    assert not list(tmp_path.rglob(pki.CA_KEY))  # nothing can join this launch later
    assert with_serve_certs(settings, tmp_path / "again").router.tls_dir != with_certs.router.tls_dir


def test_pdserve_certs_makes_an_authority_and_rotates_identities_under_it(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--out", str(tmp_path), "--identity", "router", "--identity", "decode-0=decode,10.0.0.7"]) == 0
    first = TlsConfig.from_dir(str(tmp_path / "decode-0"))
    assert first.identity == "decode-0"
    assert main(["--out", str(tmp_path), "--identity", "decode-0=decode"]) == 0  # rotation: same authority
    second = TlsConfig.from_dir(str(tmp_path / "decode-0"))
    assert second.cert != first.cert and second.ca_cert == first.ca_cert
    x509.load_pem_x509_certificate(second.cert).verify_directly_issued_by(
        x509.load_pem_x509_certificate((tmp_path / pki.CA_CERT).read_bytes()))
    assert "using the authority in" in capsys.readouterr().out


def test_pdserve_certs_refuses_an_identity_that_is_no_folder_name(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--identity", "../escape"])
    assert not (tmp_path / pki.CA_CERT).exists()
