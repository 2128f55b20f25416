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
    assert (router.identity, router.role) == ("router", pki.Role.ROUTER)
    assert [w.identity for w in workers] == ["prefill@127.0.0.1:50051", "decode@127.0.0.1:50052"]
    assert [w.role for w in workers] == [pki.Role.PREFILL, pki.Role.DECODE]
    assert [w.worker_id for w in with_certs.workers] == [w.identity for w in workers]
    assert {w.ca_cert for w in workers} == {router.ca_cert}
    assert not list(tmp_path.rglob(pki.CA_KEY))  # nothing can join this launch later
    assert with_serve_certs(settings, tmp_path / "again").router.tls_dir != with_certs.router.tls_dir


def test_pdserve_certs_makes_an_authority_and_rotates_identities_under_it(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--out", str(tmp_path), "--router", "router", "--decode", "decode-0=decode,10.0.0.7"]) == 0
    first = TlsConfig.from_dir(str(tmp_path / "decode-0"))
    assert (first.identity, first.role) == ("decode-0", pki.Role.DECODE)
    assert TlsConfig.from_dir(str(tmp_path / "router")).role == pki.Role.ROUTER
    assert main(["--out", str(tmp_path), "--decode", "decode-0=decode"]) == 0  # rotation: same authority
    second = TlsConfig.from_dir(str(tmp_path / "decode-0"))
    assert second.cert != first.cert and second.ca_cert == first.ca_cert
    x509.load_pem_x509_certificate(second.cert).verify_directly_issued_by(
        x509.load_pem_x509_certificate((tmp_path / pki.CA_CERT).read_bytes()))
    assert "using the authority in" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--decode", "../escape"], [], ["--prefill", "w-0", "--decode", "w-0"],
                                  ["--decode", "decode-0=prefill.pdserve-internal"], ["--identity", "decode-0"]])
def test_pdserve_certs_refuses_what_would_be_no_folder_or_no_single_role(tmp_path: Path, argv: list[str]) -> None:
    """An identity that is no folder name, none at all, one identity in two roles, a host only a
    role names, an identity without a role."""
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), *argv])
    assert not (tmp_path / pki.CA_CERT).exists()


@pytest.mark.parametrize("role", list(pki.Role))
def test_pdserve_certs_issues_each_role_by_its_flag(tmp_path: Path, role: pki.Role) -> None:
    assert main(["--out", str(tmp_path), f"--{role}", "p-0"]) == 0
    assert TlsConfig.from_dir(str(tmp_path / "p-0")).role == role
