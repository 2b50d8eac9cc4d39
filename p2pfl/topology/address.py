"""Peer addresses: parse ``host:port``, refuse bogus hosts, and compare equivalent forms as equal.

Two spellings of one socket (``localhost:5000`` / ``127.0.0.1:5000`` / ``LOCALHOST:5000``,
``[::1]:5000`` / ``[0:0:0:0:0:0:0:1]:5000``, ``[::ffff:127.0.0.1]:5000``) must count as a
duplicate, or two peers of one topology would try to listen on the same socket. Names are not
resolved through DNS (a container's service name only resolves inside its network); only
``localhost`` is, by definition (RFC 6761), the loopback address.
"""

from __future__ import annotations

import ipaddress
import re
from functools import lru_cache

__all__ = ["AddressError", "canonical_address", "is_loopback_host", "listen_address", "split_address"]

_LABEL = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?$")  # docker service names allow '_'


class AddressError(ValueError):
    """A malformed ``host:port``; the message says what is wrong."""


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` -> (host without brackets, port); AddressError for anything malformed."""
    if not isinstance(address, str) or ":" not in address:
        raise AddressError("expected 'host:port'")
    host, _, port_s = address.rpartition(":")
    if not port_s.isdigit() or len(port_s) > 5 or not 1 <= int(port_s) <= 65535:
        raise AddressError("port must be 1-65535")
    return _check_host(host), int(port_s)


@lru_cache(maxsize=4096)  # a large topology repeats a few hosts on many ports
def _check_host(host: str) -> str:
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise AddressError(f"{host} is not an IPv6 address") from None
        return host[1:-1]
    if ":" in host:
        raise AddressError("an IPv6 host must be in brackets: '[::1]:port'")
    if re.fullmatch(r"[0-9.]+", host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise AddressError(f"{host} is not an IPv4 address") from None
        return host
    name = host[:-1] if host.endswith(".") else host
    if not name or len(name) > 253 or not all(_LABEL.match(label) for label in name.split(".")):
        raise AddressError(f"{host!r} is not a valid host name")
    return host


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def canonical_address(address: str) -> str:
    """One spelling per socket: lower-case names, ``localhost`` -> 127.0.0.1, compressed IPv6, no v4-mapping."""
    host, port = split_address(address)
    return f"{_canonical_host(host)}:{port}"


@lru_cache(maxsize=4096)
def _canonical_host(host: str) -> str:
    ip = _ip(host)
    if ip is None:
        name = host.lower().rstrip(".")
        return "127.0.0.1" if name == "localhost" else name
    if ip.is_unspecified:
        raise AddressError(f"{host} means 'every interface' and cannot be dialed; give the peer's own address")
    return f"[{ip.compressed}]" if ip.version == 6 else ip.compressed


def is_loopback_host(host: str) -> bool:
    """``localhost`` (any case), 127.0.0.0/8, ``::1`` or an IPv4-mapped loopback."""
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if host.lower().rstrip(".") == "localhost":
        return True
    ip = _ip(host)
    return ip is not None and ip.is_loopback


def listen_address(address: str) -> str:
    """Where a peer listens for its topology address: exactly the host given when it is an IP or
    ``localhost`` (so a loopback address never listens on all interfaces); every interface only
    for a DNS name (a container's service name, which names this host as the others see it)."""
    host, port = split_address(address)
    if host.lower().rstrip(".") == "localhost":
        return f"localhost:{port}"
    ip = _ip(host)
    if ip is None:
        return f"[::]:{port}"
    return f"[{ip.compressed}]:{port}" if ip.version == 6 else f"{ip.compressed}:{port}"
