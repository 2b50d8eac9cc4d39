"""Certificates for mutual TLS: what make_certs writes, idempotency, loading, caller identity."""

from __future__ import annotations

import ipaddress
import stat
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from p2pfl.security import TLSConfig, caller_peer_id, make_certs


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_make_certs_writes_ca_and_peer_certs(tmp_path: Path) -> None:
    make_certs(["p0", "p1"], tmp_path, hosts={"p0": ["127.0.0.1", "peer-0", "::1"]}, days=30)
    for name in ("ca.crt", "ca.key", "p0.crt", "p0.key", "p1.crt", "p1.key"):
        assert (tmp_path / name).is_file(), name
    for key in ("ca.key", "p0.key", "p1.key"):
        assert stat.S_IMODE((tmp_path / key).stat().st_mode) == 0o600, key

    ca = _cert(tmp_path / "ca.crt")
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    p0 = _cert(tmp_path / "p0.crt")
    p0.verify_directly_issued_by(ca)
    assert p0.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "p0"
    san = p0.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["p0", "peer-0"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")]
    eku = p0.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in eku and ExtendedKeyUsageOID.CLIENT_AUTH in eku
    assert not p0.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    p1 = _cert(tmp_path / "p1.crt")
    assert p1.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName
    ) == ["p1"]


def test_make_certs_is_idempotent(tmp_path: Path) -> None:
    make_certs(["p0", "p1"], tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    make_certs(["p0", "p1"], tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before

    # A new peer and new names for p1: the CA and p0 are kept, p1 is reissued with the names.
    make_certs(["p0", "p1", "p2"], tmp_path, hosts={"p1": ["10.0.0.2"]})
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    for name in ("ca.crt", "ca.key", "p0.crt", "p0.key"):
        assert after[name] == before[name], name
    assert after["p1.crt"] != before["p1.crt"] and "p2.crt" in after
    _cert(tmp_path / "p2.crt").verify_directly_issued_by(_cert(tmp_path / "ca.crt"))

    make_certs(["p0"], tmp_path, overwrite=True)
    assert (tmp_path / "ca.crt").read_bytes() != before["ca.crt"]
    _cert(tmp_path / "p0.crt").verify_directly_issued_by(_cert(tmp_path / "ca.crt"))


def test_make_certs_refuses_bad_input(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="invalid peer id '../x'"):
        make_certs(["../x"], tmp_path)
    with pytest.raises(ValueError, match="unknown peers"):
        make_certs(["p0"], tmp_path, hosts={"p9": ["h"]})
    make_certs(["p0"], tmp_path)
    (tmp_path / "ca.key").unlink()
    with pytest.raises(FileNotFoundError, match="ca.key is missing"):
        make_certs(["p0"], tmp_path)


def test_tls_config_load_names_the_missing_file(tmp_path: Path) -> None:
    make_certs(["p0"], tmp_path)
    cfg = TLSConfig.load(tmp_path, "p0")
    assert (cfg.ca, cfg.cert, cfg.key) == (tmp_path / "ca.crt", tmp_path / "p0.crt", tmp_path / "p0.key")
    assert "PRIVATE KEY" not in repr(cfg)
    with pytest.raises(FileNotFoundError, match=r"p1\.crt"):
        TLSConfig.load(tmp_path, "p1")
    for name in ("p0.key", "ca.crt"):
        (tmp_path / name).rename(tmp_path / f"{name}.bak")
        with pytest.raises(FileNotFoundError, match=name.replace(".", r"\.")):
            TLSConfig.load(tmp_path, "p0")
        (tmp_path / f"{name}.bak").rename(tmp_path / name)


class _Ctx:
    def __init__(self, auth: dict[str, list[bytes]]) -> None:
        self.auth = auth

    def auth_context(self) -> dict[str, Any]:
        return self.auth


def test_caller_peer_id_reads_the_certificate_names() -> None:
    ssl = {"transport_security_type": [b"ssl"]}
    assert caller_peer_id(_Ctx({**ssl, "x509_common_name": [b"p3"], "x509_subject_alternative_name": [b"p3"]})) == "p3"
    assert caller_peer_id(_Ctx({**ssl, "x509_common_name": [b"p3"], "x509_subject_alternative_name": [b"p4"]})) is None
    assert caller_peer_id(_Ctx({**ssl, "x509_subject_alternative_name": [b"p3"]})) is None
    assert caller_peer_id(_Ctx({"transport_security_type": [b"insecure"]})) is None
    assert caller_peer_id(_Ctx({})) is None
