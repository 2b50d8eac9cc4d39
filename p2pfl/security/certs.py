"""Certificates for mutual TLS between peers: a deployment CA and one certificate per peer id.

Why per-peer certificates: a peer must know *who* is pulling from or pushing to it, not just that
the caller holds some valid certificate. The peer id is the certificate's CN and a DNS SAN, so the
server reads the caller's id from the TLS handshake (`caller_peer_id`) and the client verifies the
server by peer id (``grpc.ssl_target_name_override``) whatever address it dials.

Keys are ECDSA P-256: fast to generate and to handshake, and supported by gRPC's TLS stack.
Key files are written with mode 0600 and never logged.
"""

from __future__ import annotations

import datetime as dt
import functools
import ipaddress
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from p2pfl.badinput import BadInput, shorten

if TYPE_CHECKING:  # grpc is imported lazily: `p2pfl certs` does not need it
    import grpc

__all__ = ["CA_CERT", "CA_KEY", "EXPIRY_WARNING_DAYS", "CertificateProblem", "OwnCertificate", "TLSConfig",
           "caller_peer_id", "check_own_certificate", "make_certs"]

CA_CERT = "ca.crt"
CA_KEY = "ca.key"
_CA_NAME = "p2pfl deployment CA"
# Same rule as topology peer ids: the id becomes a file name and a DNS SAN.
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_SKEW = dt.timedelta(hours=1)  # certificates start an hour early so small clock skew does not bite


def _check_id(peer_id: str) -> None:
    if not isinstance(peer_id, str) or not _ID_RE.match(peer_id) or peer_id.lower() == "ca":
        raise ValueError(
            f"invalid peer id {peer_id!r}: use letters, digits, '.', '_' or '-' (at most 63 chars), not 'ca'"
        )


def _write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` readable by the owner only (created 0600, then moved into place)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def _write_public(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _make_ca(days: int) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [x509.NameAttribute(NameOID.COMMON_NAME, _CA_NAME), x509.NameAttribute(NameOID.ORGANIZATION_NAME, "p2pfl")]
    )
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _SKEW)
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _san_entries(peer_id: str, hosts: Iterable[str]) -> list[x509.GeneralName]:
    """The peer id as a DNS name, then each host as an IP address or DNS name (deduplicated)."""
    out: list[x509.GeneralName] = [x509.DNSName(peer_id)]
    seen = {("dns", peer_id)}
    for h in hosts:
        h = str(h).strip().strip("[]")
        if not h:
            continue
        try:
            ip = ipaddress.ip_address(h)
        except ValueError:
            key: tuple[str, Any] = ("dns", h)
            entry: x509.GeneralName = x509.DNSName(h)
        else:
            key, entry = ("ip", ip), x509.IPAddress(ip)
        if key not in seen:
            seen.add(key)
            out.append(entry)
    return out


def _make_peer_cert(
    peer_id: str,
    hosts: Sequence[str],
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    days: int,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    not_after = min(now + dt.timedelta(days=days), ca_cert.not_valid_after_utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, peer_id)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _SKEW)
        .not_valid_after(not_after)
        .add_extension(x509.SubjectAlternativeName(_san_entries(peer_id, hosts)), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=True, key_cert_sign=False, crl_sign=False,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        # Every peer is both a server (it is pulled from) and a client (it pulls / pushes).
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()),  # type: ignore[arg-type]
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def _existing_ok(cert_path: Path, key_path: Path, peer_id: str, hosts: Sequence[str], ca: x509.Certificate) -> bool:
    """Whether an existing peer certificate can be kept: issued by ``ca``, unexpired, right names."""
    if not (cert_path.is_file() and key_path.is_file()):
        return False
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    if cert.public_key() != key.public_key():
        return False
    if cert.not_valid_after_utc <= _now():
        return False
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if len(cns) != 1 or cns[0].value != peer_id:
        return False
    try:
        have = set(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)
    except x509.ExtensionNotFound:
        return False
    return set(_san_entries(peer_id, hosts)) <= have


def make_certs(
    peer_ids: Sequence[str],
    out_dir: str | os.PathLike[str],
    *,
    hosts: Mapping[str, Sequence[str]] | None = None,
    days: int = 365,
    overwrite: bool = False,
    ca_key_dir: str | os.PathLike[str] | None = None,
) -> None:
    """Create (or complete) a deployment's certificates in ``out_dir``.

    Writes ``ca.key``/``ca.crt`` (self-signed CA) and, per peer, ``PEER.key``/``PEER.crt`` signed by
    the CA with the peer id as CN and DNS SAN, plus ``hosts[PEER]`` (IP addresses or DNS names) as
    further SANs. Keys get mode 0600.

    ``ca_key_dir`` keeps the CA's private key out of ``out_dir``: whoever can read ``ca.key`` can
    mint a certificate for any peer id, so it belongs in a folder no peer reads (created 0700).
    A stale ``out_dir/ca.key`` is then removed. Default: ``out_dir`` (the ``p2pfl certs`` layout,
    where the operator hands each peer only ``ca.crt`` and its own pair).

    Idempotent: an existing CA is kept (so certificates already handed out stay valid), and an
    existing peer certificate is kept when it is signed by that CA, unexpired and covers the asked
    names; anything else is (re)issued. ``overwrite=True`` makes a new CA and reissues everything.
    """
    hosts = dict(hosts or {})
    if days < 1:
        raise ValueError(f"days must be >= 1, got {days}")
    for pid in peer_ids:
        _check_id(pid)
    if len(set(peer_ids)) != len(peer_ids):
        raise ValueError("duplicate peer ids")
    unknown = set(hosts) - set(peer_ids)
    if unknown:
        raise ValueError(f"hosts given for unknown peers: {sorted(unknown)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ca_cert_path = out / CA_CERT
    if ca_key_dir is None:
        ca_key_path = out / CA_KEY
    else:
        key_dir = Path(ca_key_dir)
        key_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(key_dir, 0o700)
        ca_key_path = key_dir / CA_KEY
        if ca_key_path.resolve() != (out / CA_KEY).resolve():
            (out / CA_KEY).unlink(missing_ok=True)

    new_ca = overwrite or not (ca_key_path.exists() or ca_cert_path.exists())
    if new_ca:
        ca_key, ca_cert = _make_ca(days)
        _write_private(ca_key_path, _key_pem(ca_key))
        _write_public(ca_cert_path, ca_cert.public_bytes(serialization.Encoding.PEM))
    else:
        for p in (ca_key_path, ca_cert_path):
            if not p.is_file():
                raise FileNotFoundError(
                    f"{p} is missing but the rest of the CA exists; restore it or pass overwrite=True"
                )
        loaded = serialization.load_pem_private_key(ca_key_path.read_bytes(), password=None)
        if not isinstance(loaded, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{ca_key_path} is not an EC private key")
        ca_key = loaded
        ca_cert = x509.load_pem_x509_certificate(ca_cert_path.read_bytes())
        if ca_cert.public_key() != ca_key.public_key():
            raise ValueError(f"{ca_key_path} does not match {ca_cert_path}")

    for pid in peer_ids:
        cert_path, key_path = out / f"{pid}.crt", out / f"{pid}.key"
        wanted = list(hosts.get(pid, ()))
        if not new_ca and _existing_ok(cert_path, key_path, pid, wanted, ca_cert):
            continue
        key, cert = _make_peer_cert(pid, wanted, ca_key, ca_cert, days)
        _write_private(key_path, _key_pem(key))
        _write_public(cert_path, cert.public_bytes(serialization.Encoding.PEM))


@dataclass(frozen=True)
class TLSConfig:
    """Where one peer's TLS material lives: the CA certificate, its own certificate and key.

    Holds paths only (its repr never shows key material); files are read when credentials are
    built. `load` refuses a missing file instead of falling back to plaintext.
    """

    peer_id: str
    ca: Path
    cert: Path
    key: Path

    @classmethod
    def load(cls, certs_dir: str | os.PathLike[str], peer_id: str) -> TLSConfig:
        """The files `make_certs` wrote for ``peer_id`` in ``certs_dir``; `FileNotFoundError` names a missing one."""
        _check_id(peer_id)
        d = Path(certs_dir)
        cfg = cls(peer_id=peer_id, ca=d / CA_CERT, cert=d / f"{peer_id}.crt", key=d / f"{peer_id}.key")
        for what, p in (("CA certificate", cfg.ca), ("certificate", cfg.cert), ("private key", cfg.key)):
            if not p.is_file():
                raise FileNotFoundError(
                    f"TLS {what} for peer {peer_id!r} not found: {p} "
                    "(create it with `p2pfl certs`, or run with --insecure to use plaintext)"
                )
        return cfg

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(ca, cert, key) PEM bytes."""
        return self.ca.read_bytes(), self.cert.read_bytes(), self.key.read_bytes()

    def server_credentials(self) -> grpc.ServerCredentials:
        """Server side of mutual TLS: present our certificate, require one signed by the CA from callers."""
        import grpc

        ca, cert, key = self.read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Client side of mutual TLS: trust only the deployment CA, present our certificate."""
        import grpc

        ca, cert, key = self.read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)



#: A peer warns (its log, ``p2pfl_certificate_expiring`` on ``/metrics``) with fewer days left than this.
EXPIRY_WARNING_DAYS = 30


class CertificateProblem(BadInput):
    """A peer's own TLS material is unusable: ``FILE: problem`` (one line, exit 2, before anything starts)."""


@dataclass(frozen=True)
class OwnCertificate:
    """A peer's certificate that `check_own_certificate` found fit: when it expires."""

    path: Path
    not_after: dt.datetime

    def days_left(self, now: dt.datetime | None = None) -> float:
        return (self.not_after - (now or _now())).total_seconds() / 86400.0


def _when(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%d %H:%M UTC")


def certificate_expiry(path: str | os.PathLike[str]) -> dt.datetime:
    """When the PEM certificate at ``path`` expires (UTC)."""
    return x509.load_pem_x509_certificate(Path(path).read_bytes()).not_valid_after_utc


def check_own_certificate(tls: TLSConfig, now: dt.datetime | None = None) -> OwnCertificate:
    """Refuse, before a peer starts, TLS material its neighbours would refuse (`CertificateProblem`).

    Why: a peer with a certificate of another CA, an expired one, or one made for another id is
    refused by every neighbour in the TLS handshake; without this check it ran its rounds alone
    and exited 0. Checked: each file parses; the CA certificate is valid now; the certificate is
    signed by that CA, valid now (neither before its start nor after its end), names this peer
    (CN and DNS SAN, as `make_certs` writes it and `caller_peer_id` reads it); the key is its key.
    """
    now = now or _now()

    def refuse(path: Path, problem: str, hint: str | None = None) -> CertificateProblem:
        return CertificateProblem(problem, source=shorten(str(path), 200), hint=hint)

    def load_cert(path: Path) -> x509.Certificate:
        try:
            return x509.load_pem_x509_certificate(path.read_bytes())
        except (OSError, ValueError) as exc:
            raise refuse(path, f"not a PEM certificate ({shorten(str(exc), 80)})") from None

    ca, cert = load_cert(tls.ca), load_cert(tls.cert)
    remake = "make new ones with `p2pfl certs` (the same CA: keep ca.key)"
    for path, c in ((tls.ca, ca), (tls.cert, cert)):
        if c.not_valid_before_utc > now:
            raise refuse(path, f"not valid before {_when(c.not_valid_before_utc)} (clock skew?)")
        if c.not_valid_after_utc <= now:
            raise refuse(path, f"expired on {_when(c.not_valid_after_utc)}", hint=remake)
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        raise refuse(tls.cert, f"not signed by the CA in {shorten(str(tls.ca), 120)} (a certificate of another "
                     "deployment?)", hint="the neighbours trust only that CA") from None
    cns = [str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    try:
        sans = set(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
                   .get_values_for_type(x509.DNSName))
    except x509.ExtensionNotFound:
        sans = set()
    if cns != [tls.peer_id] or tls.peer_id not in sans:
        whose = shorten(repr(cns[0]), 70) if len(cns) == 1 else f"{len(cns)} common names"
        raise refuse(tls.cert, f"is for peer {whose}, not {tls.peer_id!r}", hint=remake)
    try:
        key = serialization.load_pem_private_key(tls.key.read_bytes(), password=None)
    except (OSError, ValueError, TypeError):
        raise refuse(tls.key, "not a PEM private key without a password") from None
    if key.public_key() != cert.public_key():
        raise refuse(tls.key, f"does not match {shorten(str(tls.cert), 120)} (the key of another certificate)")
    return OwnCertificate(tls.cert, cert.not_valid_after_utc)


def caller_peer_id(context: Any) -> str | None:
    """The peer id of an RPC's caller, from its verified client certificate; None without TLS.

    gRPC has already verified the chain against the CA (``require_client_auth=True``); the id is the
    certificate's CN, accepted only when the certificate also lists it as a SAN (as `make_certs`
    writes it), so a certificate whose names disagree is not trusted, nor one whose subject has
    several CNs (gRPC reports just one of them, which would let such a certificate pass as that one).
    """
    auth = context.auth_context()
    if auth.get("transport_security_type") != [b"ssl"]:
        return None
    cns = auth.get("x509_common_name") or []
    if len(cns) != 1:
        return None
    pems = auth.get("x509_pem_cert") or []
    if pems and _cn_count(pems[0]) != 1:
        # gRPC reports only one CN of a subject that has several: count them in the certificate itself.
        return None
    cn = cns[0].decode("utf-8", "replace")
    sans = {s.decode("utf-8", "replace") for s in auth.get("x509_subject_alternative_name") or []}
    if cn not in sans:
        return None
    return cn


@functools.lru_cache(maxsize=256)
def _cn_count(pem: bytes) -> int:
    """How many CNs the subject of a PEM certificate has (0 for one that does not parse)."""
    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError:
        return 0
    return len(cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME))
