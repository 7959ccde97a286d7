"""The Prometheus text format and the HTTP endpoint of [metrics]: the only module that imports
prometheus_client (the `metrics` extra). Everything here runs outside the event loop's thread.

The endpoint is the standard library's threading HTTP server rather than prometheus_client's own: the same
code across the client's versions (Debian's is older), a cap on concurrent connections (MAX_CLIENTS threads)
and a one-line error when the address cannot be bound. A client has REQUEST_SECONDS in all to send its
request (not per read: one that trickles a byte at a time is cut off all the same) and as long again to take
the answer. When every slot is taken, a new client takes the slot of the one that has waited longest for
its own request to end: clients that send slowly, or nothing, never keep a scrape out (a scraper sends its
request at once, and is answered in a few milliseconds).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import selectors
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Dict, Iterator, Optional, Tuple

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from gpu_mon.outputs.families import Family, MetricsError

# What generate_latest writes. (prometheus_client's CONTENT_TYPE_LATEST says 1.0.0 in newer versions; every
# name here is a classic one, so 0.0.4 is exact and older Prometheus servers, Debian 12's 2.42, take it.)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
log = logging.getLogger("gpu_mon")
REQUEST_SECONDS = 5.0  # to send the whole request (from the connect); and again to take the answer
MAX_CLIENTS = 16
MAX_REQUEST = 8192  # bytes of a request's line and headers (more is answered as the parser answers it)
EVICT_WAIT = 1.0  # seconds a new client waits for the slot of the one it cut off
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

    def setup(self) -> None:
        """The whole request first, within REQUEST_SECONDS of the connect; then the parser reads it from
        memory, and the answer has REQUEST_SECONDS to go out (sendall's timeout is its whole duration)."""
        sock: socket.socket = self.request
        head = _read_request(sock, self.server.connected(sock) + REQUEST_SECONDS)
        self.server.read(sock)  # (no longer one to cut off for a new client)
        sock.settimeout(REQUEST_SECONDS)
        super().setup()
        self.rfile.close()  # (the socket's file: an open one would keep the socket from closing)
        self.rfile = io.BytesIO(head)  # type: ignore[assignment]

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


def _read_request(sock: socket.socket, deadline: float) -> bytes:
    """A request's line and headers (up to MAX_REQUEST bytes), or TimeoutError/ConnectionError: quiet."""
    data = b""
    while b"\r\n\r\n" not in data and b"\n\n" not in data and len(data) <= MAX_REQUEST:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no whole request in time")
        sock.settimeout(left)
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectionResetError("closed before its request ended")
        data += chunk
    return data


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    said_error = False
    thread: Optional[threading.Thread] = None  # serve()'s

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
        self.reading: Dict[socket.socket, float] = {}  # connections still sending their request: since
        self.reading_lock = threading.Lock()
        super().__init__(address, _Handler)
        self._stop_r, self._stop_w = os.pipe()

    def serve(self) -> None:
        """Accept until stop(): a wait on the socket and a pipe, so that a stop is at once
        (serve_forever looks for its shutdown every 0.5 s: that much longer before gpu-mon exits)."""
        with selectors.DefaultSelector() as sel:
            sel.register(self.socket, selectors.EVENT_READ)
            sel.register(self._stop_r, selectors.EVENT_READ)
            while True:
                ready = [key.fileobj for key, _events in sel.select()]
                if self._stop_r in ready:
                    return
                self._handle_request_noblock()

    def stop(self) -> None:
        """End serve() now; release the port and the pipe."""
        os.write(self._stop_w, b"x")
        if self.thread is not None:
            self.thread.join(timeout=5)
        self.server_close()
        for fd in (self._stop_r, self._stop_w):
            os.close(fd)

    def connected(self, request: socket.socket) -> float:
        """When (monotonic) this connection was accepted."""
        with self.reading_lock:
            return self.reading.get(request, time.monotonic())

    def read(self, request: socket.socket) -> None:
        """This connection has sent its request."""
        with self.reading_lock:
            self.reading.pop(request, None)

    def _cut_off_slowest(self) -> bool:
        """End the connection that has waited longest for its request to end (its thread then frees its
        slot); False when every connection has sent its request (being answered: none is cut off)."""
        with self.reading_lock:
            if not self.reading:
                return False
            oldest = min(self.reading, key=self.reading.__getitem__)
            del self.reading[oldest]
        with contextlib.suppress(OSError):
            oldest.shutdown(socket.SHUT_RDWR)
        return True

    def process_request(self, request: socket.socket, client_address: object) -> None:
        if not self.slots.acquire(blocking=False) and not (
            self._cut_off_slowest() and self.slots.acquire(timeout=EVICT_WAIT)
        ):
            self.shutdown_request(request)  # every slot is answering a request: drop this one
            return
        with self.reading_lock:
            self.reading[request] = time.monotonic()
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.read(request)
            self.slots.release()
            raise

    def process_request_thread(self, request: socket.socket, client_address: object) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.read(request)
            self.slots.release()


def serve(host: str, port: int, text: Text) -> _Server:
    """Bind and serve /metrics in a thread; MetricsError (one line) when the address cannot be bound."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        server = _Server((host, port), text)
    except OSError as err:
        raise MetricsError(f"[metrics] listen {where}: {err.strerror or err}") from None
    server.thread = threading.Thread(target=server.serve, name="metrics-http", daemon=True)
    server.thread.start()
    return server


def close(server: _Server) -> None:
    """Stop serving and release the port."""
    with contextlib.suppress(OSError):
        server.stop()
