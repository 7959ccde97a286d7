"""The Prometheus text format and the HTTP endpoint of [metrics]: the only module that imports
prometheus_client (the `metrics` extra). Everything here runs outside the event loop's thread.

The endpoint is the standard library's threading HTTP server rather than prometheus_client's own: the same
code across the client's versions (Debian's is older), a read timeout and a cap on concurrent connections (a
slow or hostile client holds one thread for at most READ_TIMEOUT, and never more than MAX_CLIENTS of them),
and a one-line error when the address cannot be bound.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Iterator, Tuple

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from gpu_mon.outputs.metrics import Family, MetricsError

# What generate_latest writes. (prometheus_client's CONTENT_TYPE_LATEST says 1.0.0 in newer versions; every
# name here is a classic one, so 0.0.4 is exact and older Prometheus servers, Debian 12's 2.42, take it.)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
log = logging.getLogger("gpu_mon")
READ_TIMEOUT = 10.0
MAX_CLIENTS = 16
Text = Callable[[], bytes]  # the current exposition, rendered


class _Collector:
    """prometheus_client's view of one snapshot of families."""

    def __init__(self, families: Tuple[Family, ...]):
        self.families = families

    def collect(self) -> Iterator[Metric]:
        for f in self.families:
            yield _metric(f)


def _metric(f: Family) -> Metric:
    if f.kind == "histogram":
        h = HistogramMetricFamily(f.name, f.help, labels=f.labels)
        for values, (counts, total) in f.samples:  # type: ignore[misc]
            bounds = [*(_le(b) for b in f.buckets), "+Inf"]
            h.add_metric(list(values), buckets=list(zip(bounds, counts)), sum_value=total)
        return h
    m = (CounterMetricFamily if f.kind == "counter" else GaugeMetricFamily)(f.name, f.help, labels=f.labels)
    for values, value in f.samples:
        m.add_metric(list(values), float(value))  # type: ignore[arg-type]
    return m


def _le(bound: float) -> str:
    return repr(float(bound))


def render(families: Tuple[Family, ...]) -> bytes:
    """The Prometheus text format (version 0.0.4) of these families."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(families))  # type: ignore[arg-type]
    return generate_latest(registry)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "gpu-mon"
    timeout = READ_TIMEOUT  # for reading the request; a client that sends nothing is dropped

    def do_GET(self) -> None:
        self._answer(send_body=True)

    def do_HEAD(self) -> None:
        self._answer(send_body=False)

    def _answer(self, send_body: bool) -> None:
        path = self.path.split("?", 1)[0]
        if path in ("/metrics", "/metrics/"):
            code, ctype, body = 200, CONTENT_TYPE, self.server.text()
        elif path == "/":
            code, ctype, body = 200, "text/plain; charset=utf-8", b"gpu-mon: metrics at /metrics\n"
        else:
            code, ctype, body = 404, "text/plain; charset=utf-8", b"not found: metrics at /metrics\n"
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: a scrape every 15 s is not news."""


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    said_error = False

    def handle_error(self, request: object, client_address: object) -> None:
        """A client that hung up is nobody's business; anything else is logged once, in one line (the
        standard library would print a traceback to stderr, the journal, for every request)."""
        err = sys.exc_info()[1]
        if isinstance(err, OSError) or self.said_error:
            return
        self.said_error = True
        log.warning("metrics: cannot answer a scrape: %s: %s (said once)", type(err).__name__, err)

    def __init__(self, address: Tuple[str, int], text: Text):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.text = text
        self.slots = threading.BoundedSemaphore(MAX_CLIENTS)
        super().__init__(address, _Handler)

    def process_request(self, request: socket.socket, client_address: object) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)  # too many at once: drop this one
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: socket.socket, client_address: object) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def serve(host: str, port: int, text: Text) -> _Server:
    """Bind and serve /metrics in a thread; MetricsError (one line) when the address cannot be bound."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        server = _Server((host, port), text)
    except OSError as err:
        raise MetricsError(f"[metrics] listen {where}: {err.strerror or err}") from None
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server


def close(server: _Server) -> None:
    """Stop serving and release the port."""
    with contextlib.suppress(OSError):
        server.shutdown()
        server.server_close()
