"""Live metrics of one running peer, served in the Prometheus text format on ``/metrics``.

Why: a deployment (compose, Kubernetes) is watched while it runs, by Prometheus or by
``p2pfl watch``, without reading files inside containers. ``p2pfl node --metrics-port N`` starts it;
it is off unless asked for (tests and ``launch`` leave it off; ``p2pfl compose``/``k8s`` turn it on).

What is exported (one peer per process, so the peer is a label on every sample, not a series split):

* per round, from the node's own records (the ``record`` callback of `p2pfl.node.Node`):
  ``p2pfl_round`` (last completed round), ``p2pfl_rounds_total``, ``p2pfl_accuracy``, ``p2pfl_loss``,
  ``p2pfl_bytes_sent_total`` / ``p2pfl_bytes_received_total`` (counters since this process started),
  ``p2pfl_round_duration_seconds``, ``p2pfl_train_seconds``, ``p2pfl_missing_neighbours`` and
  ``p2pfl_neighbour_missing{neighbour}`` (1 when that neighbour's payload did not arrive last round);
* per link, from a background probe of each neighbour's Status RPC over the peer's own (mutual-TLS)
  channels: ``p2pfl_neighbour_up{neighbour}`` and ``p2pfl_neighbour_latency_seconds{neighbour}``
  (round trip of the last successful probe) and ``p2pfl_neighbour_round{neighbour}``;
* ``p2pfl_resumed_from_round`` (-1: started fresh; else the checkpointed round it resumed at) and
  ``p2pfl_finished`` (1 once the last round is done);
* ``p2pfl_certificate_days_left`` (days until the peer's own TLS certificate expires, computed at
  each scrape; NaN under ``--insecure``) and ``p2pfl_certificate_expiring`` (1 when fewer than
  ``p2pfl.security.certs.EXPIRY_WARNING_DAYS`` are left, when the peer also warns in its log): a long deployment must not fall apart silently on expiry day.

Written with the standard library (``http.server``): the exposition format is a few lines of text,
and the peer image stays free of extra dependencies. Label values are peer ids (validated by the
topology loader) and are escaped anyway.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["LinkProber", "MetricsServer", "NodeMetrics", "NodeTelemetry", "parse_exposition"]

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# name -> (type, help); the order is the exposition order.
_FAMILIES: dict[str, tuple[str, str]] = {
    "p2pfl_info": ("gauge", "Always 1; labels identify the peer."),
    "p2pfl_round": ("gauge", "Index of the last completed round (-1 before the first)."),
    "p2pfl_rounds_total": ("gauge", "Rounds this peer runs in all."),
    "p2pfl_finished": ("gauge", "1 once the peer has completed its last round."),
    "p2pfl_resumed_from_round": ("gauge", "Round the peer resumed at from its checkpoint; -1 if it started fresh."),
    "p2pfl_accuracy": ("gauge", "Personalized test accuracy at the last evaluated round."),
    "p2pfl_loss": ("gauge", "Test loss at the last evaluated round."),
    "p2pfl_bytes_sent_total": ("counter", "Wire bytes sent to neighbours since this process started."),
    "p2pfl_bytes_received_total": ("counter", "Wire bytes received from neighbours since this process started."),
    "p2pfl_round_duration_seconds": ("gauge", "Wall time of the last round (training, gossip, evaluation)."),
    "p2pfl_train_seconds": ("gauge", "Local training time of the last round."),
    "p2pfl_missing_neighbours": ("gauge", "Neighbours whose payload did not arrive in the last round."),
    "p2pfl_neighbour_missing": ("gauge", "1 if this neighbour's payload did not arrive in the last round."),
    "p2pfl_neighbour_up": ("gauge", "1 if the last Status probe of this neighbour answered."),
    "p2pfl_neighbour_latency_seconds": ("gauge", "Round trip of the last answered Status probe of this neighbour."),
    "p2pfl_neighbour_round": ("gauge", "The round this neighbour reported in its last Status answer."),
    "p2pfl_certificate_days_left": ("gauge", "Days until this peer's TLS certificate expires (NaN: no TLS)."),
    "p2pfl_certificate_expiring": ("gauge", "1 if this peer's TLS certificate expires within the warning period (30 days)."),
}


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class NodeMetrics:
    """The latest figures of one peer; thread-safe (the round loop writes, HTTP threads read)."""

    def __init__(self, peer_id: str, neighbours: Iterable[str], rounds: int) -> None:
        self.peer_id = peer_id
        self.neighbours = sorted(set(neighbours))
        self._lock = threading.Lock()
        self._values: dict[str, float] = {
            "p2pfl_info": 1, "p2pfl_round": -1, "p2pfl_rounds_total": rounds, "p2pfl_finished": 0,
            "p2pfl_resumed_from_round": -1, "p2pfl_accuracy": math.nan, "p2pfl_loss": math.nan,
            "p2pfl_bytes_sent_total": 0, "p2pfl_bytes_received_total": 0,
            "p2pfl_round_duration_seconds": math.nan, "p2pfl_train_seconds": math.nan,
            "p2pfl_missing_neighbours": 0,
            "p2pfl_certificate_days_left": math.nan, "p2pfl_certificate_expiring": 0,
        }
        self._cert_expiry: tuple[float, float] | None = None  # (POSIX time it expires, warning days)
        self._per_nbr: dict[str, dict[str, float]] = {
            "p2pfl_neighbour_missing": {n: 0 for n in self.neighbours},
            "p2pfl_neighbour_up": {n: 0 for n in self.neighbours},
            "p2pfl_neighbour_latency_seconds": {n: math.nan for n in self.neighbours},
            "p2pfl_neighbour_round": {n: math.nan for n in self.neighbours},
        }

    def observe(self, rec: Mapping[str, Any]) -> None:
        """Take one round record (the dict `Node` hands to its ``record`` callback)."""
        missing = {str(m) for m in rec.get("missing") or ()}
        with self._lock:
            v = self._values
            r = int(rec["round"])
            v["p2pfl_round"] = r
            if r + 1 >= v["p2pfl_rounds_total"]:
                v["p2pfl_finished"] = 1
            for key, name in (("acc", "p2pfl_accuracy"), ("loss", "p2pfl_loss"),
                              ("seconds", "p2pfl_round_duration_seconds"), ("train_seconds", "p2pfl_train_seconds")):
                if isinstance(rec.get(key), int | float):
                    v[name] = float(rec[key])
            v["p2pfl_bytes_sent_total"] += int(rec.get("bytes_sent") or 0)
            v["p2pfl_bytes_received_total"] += int(rec.get("bytes_recv") or 0)
            v["p2pfl_missing_neighbours"] = len(missing)
            flags = self._per_nbr["p2pfl_neighbour_missing"]
            for n in set(flags) | missing:
                flags[n] = 1 if n in missing else 0

    def resumed(self, round_: int) -> None:
        """The peer resumed from its checkpoint at ``round_`` (rounds before it are done)."""
        with self._lock:
            self._values["p2pfl_resumed_from_round"] = round_
            if self._values["p2pfl_round"] < round_ - 1:
                self._values["p2pfl_round"] = round_ - 1

    def certificate(self, not_after: float, warn_days: float) -> None:
        """The peer's own certificate expires at POSIX time ``not_after`` (days left: at each scrape);
        ``p2pfl_certificate_expiring`` is 1 with fewer than ``warn_days`` left."""
        with self._lock:
            self._cert_expiry = (float(not_after), float(warn_days))

    def link(self, neighbour: str, *, up: bool, latency_s: float | None = None, round_: int | None = None) -> None:
        """The result of one probe of ``neighbour``."""
        with self._lock:
            self._per_nbr["p2pfl_neighbour_up"][neighbour] = 1 if up else 0
            if up and latency_s is not None:
                self._per_nbr["p2pfl_neighbour_latency_seconds"][neighbour] = latency_s
            if up and round_ is not None:
                self._per_nbr["p2pfl_neighbour_round"][neighbour] = round_

    def render(self) -> str:
        """The Prometheus text exposition (format 0.0.4) of the current figures."""
        peer = f'peer="{_escape(self.peer_id)}"'
        lines: list[str] = []
        with self._lock:
            if self._cert_expiry is not None:
                not_after, warn_days = self._cert_expiry
                days = (not_after - time.time()) / 86400.0
                self._values["p2pfl_certificate_days_left"] = round(days, 3)
                self._values["p2pfl_certificate_expiring"] = 1 if days < warn_days else 0
            for name, (kind, help_) in _FAMILIES.items():
                lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
                if name in self._values:
                    lines.append(f"{name}{{{peer}}} {_fmt(self._values[name])}")
                else:
                    for nbr, val in sorted(self._per_nbr[name].items()):
                        lines.append(f'{name}{{{peer},neighbour="{_escape(nbr)}"}} {_fmt(val)}')
        return "\n".join(lines) + "\n"


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path.split("?", 1)[0] != "/metrics":
            self.send_error(404, "only /metrics is served here")
            return
        body = self.server.metrics.render().encode()
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        return None  # scrapes every few seconds would flood the peer's log


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    metrics: NodeMetrics


class MetricsServer:
    """``/metrics`` over HTTP for one `NodeMetrics`, on a daemon thread; `close` stops it."""

    def __init__(self, metrics: NodeMetrics, host: str = "127.0.0.1", port: int = 0) -> None:
        self.metrics = metrics
        try:
            self._httpd = _Server((host, port), _Handler)
        except OSError as exc:
            raise ValueError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from None
        self._httpd.metrics = metrics
        self.host, self.port = self._httpd.server_address[:2]
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.5},
                                        name=f"metrics-{metrics.peer_id}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


class LinkProber:
    """Probes every neighbour every ``interval_s`` with ``probe(neighbour) -> reported round`` (raises
    when the neighbour does not answer) and records up/down and the round trip in ``metrics``."""

    def __init__(self, metrics: NodeMetrics, probe: Callable[[str], int], interval_s: float = 5.0) -> None:
        self.metrics = metrics
        self.probe = probe
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"probe-{metrics.peer_id}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for nbr in self.metrics.neighbours:
                if self._stop.is_set():
                    return
                t0 = time.perf_counter()
                try:
                    round_ = self.probe(nbr)
                except Exception as exc:  # noqa: BLE001 - any failure means the link is down
                    log.debug("probe of %s failed: %s", nbr, type(exc).__name__)
                    self.metrics.link(nbr, up=False)
                else:
                    self.metrics.link(nbr, up=True, latency_s=time.perf_counter() - t0, round_=round_)
            self._stop.wait(self.interval_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def parse_exposition(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Parse the exposition `NodeMetrics.render` writes: name -> {sorted label pairs: value}.

    Enough of the format for what this module serves (no timestamps, no escapes inside labels other
    than the three standard ones); used by ``p2pfl watch`` and the tests.
    """
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        pairs: list[tuple[str, str]] = []
        labels = labels.rstrip("}")
        while labels:
            key, _, rest = labels.partition('="')
            i, buf = 0, []
            while i < len(rest) and rest[i] != '"':
                if rest[i] == "\\" and i + 1 < len(rest):
                    buf.append({"n": "\n"}.get(rest[i + 1], rest[i + 1]))
                    i += 2
                else:
                    buf.append(rest[i])
                    i += 1
            pairs.append((key.strip(","), "".join(buf)))
            labels = rest[i + 1:].lstrip(",")
        out.setdefault(name, {})[tuple(sorted(pairs))] = float(value)
    return out


class NodeTelemetry:
    """What ``p2pfl node --metrics-port`` runs: `NodeMetrics` + its `MetricsServer` + a `LinkProber`.

    ``probe(neighbour)`` returns the round the neighbour reports (raising when it does not answer).
    """

    def __init__(self, peer_id: str, neighbours: Iterable[str], rounds: int, *, host: str, port: int,
                 probe: Callable[[str], int] | None = None, probe_interval_s: float = 5.0) -> None:
        self.metrics = NodeMetrics(peer_id, neighbours, rounds)
        self.server = MetricsServer(self.metrics, host, port)
        self.prober = LinkProber(self.metrics, probe, probe_interval_s) if probe is not None else None
        log.info("%s: metrics on http://%s:%d/metrics", peer_id, self.server.host, self.server.port)

    def observe(self, rec: Mapping[str, Any]) -> None:
        self.metrics.observe(rec)

    def resumed(self, round_: int) -> None:
        self.metrics.resumed(round_)

    def certificate(self, not_after: float, warn_days: float) -> None:
        self.metrics.certificate(not_after, warn_days)

    def close(self) -> None:
        if self.prober is not None:
            self.prober.close()
        self.server.close()
