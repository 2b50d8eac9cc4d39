"""Mutual TLS for the peer service: the deployment CA, per-peer certificates, caller identity."""

from p2pfl.security.certs import CA_CERT, CA_KEY, TLSConfig, caller_peer_id, make_certs

__all__ = ["CA_CERT", "CA_KEY", "TLSConfig", "caller_peer_id", "make_certs"]
