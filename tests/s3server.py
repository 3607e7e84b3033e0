"""A real S3 server on loopback (moto's server mode) and a fault-injecting HTTP proxy in front of it.

Outages: ``FaultProxy.down()`` closes the proxy's port and every open connection (clients get
"connection refused"), ``up()`` opens it again on the same port; ``faults.drop_next`` drops
connections without an answer; ``faults.delay`` makes the store hang.
"""

from __future__ import annotations

import http.client
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Faults:
    """What the proxy does to the next requests; the test thread sets these."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.fail_next = 0  # answer this many requests with ``fail_status``
        self.fail_status = 503
        self.fail_code = "ServiceUnavailable"  # the S3 error code of those answers
        self.drop_next = 0  # close this many connections without an answer
        self.delay = 0.0  # seconds before forwarding each request
        self.forbid = False  # answer every request 403 InvalidAccessKeyId (bad credentials)
        self.fail_parts_from = (
            None  # fail every multipart-upload part numbered at least this (an outage mid-upload)
        )
        self.fail_if = None  # callable(method, path) -> bool: answer those requests with ``fail_status``
        self.requests = 0
        self.injected = 0

    def take(self, path: str = "", method: str = "GET") -> str | None:
        with self.lock:
            self.requests += 1
            if self.forbid:
                return "forbid"
            if self.fail_if is not None and self.fail_if(method, path):
                self.injected += 1
                return "fail"
            part = re.search(r"[?&]partNumber=(\d+)", path)
            if self.fail_parts_from is not None and part and int(part.group(1)) >= self.fail_parts_from:
                self.injected += 1
                return "fail"
            if self.drop_next > 0:
                self.drop_next -= 1
                self.injected += 1
                return "drop"
            if self.fail_next > 0:
                self.fail_next -= 1
                self.injected += 1
                return "fail"
            return None


class FaultProxy:
    """Forwards HTTP to ``upstream`` port, injecting the faults of ``self.faults``."""

    def __init__(self, upstream_port: int) -> None:
        self.faults = Faults()
        faults, up = self.faults, upstream_port

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # keep test output clean
                pass

            def _body(self) -> bytes:
                """The request's body as sent: by Content-Length, or chunk by chunk with its framing and
                trailers (pyarrow's AWS client uploads with ``Transfer-Encoding: chunked``)."""
                if "chunked" not in (self.headers.get("Transfer-Encoding") or "").lower():
                    return self.rfile.read(int(self.headers.get("Content-Length") or 0))
                raw = bytearray()
                while True:
                    line = self.rfile.readline()
                    raw += line
                    size = int(line.split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        break
                    raw += self.rfile.read(size + 2)
                while True:  # trailers, then the empty line
                    line = self.rfile.readline()
                    raw += line
                    if line in (b"\r\n", b"\n", b""):
                        return bytes(raw)

            def _any(self) -> None:
                body = self._body()
                action = faults.take(self.path, self.command)
                if faults.delay:
                    time.sleep(faults.delay)
                if action == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if action in ("fail", "forbid"):
                    status = 403 if action == "forbid" else faults.fail_status
                    code = "InvalidAccessKeyId" if action == "forbid" else faults.fail_code
                    payload = (
                        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                        f"<Message>injected by the test proxy</Message></Error>"
                    ).encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(payload)
                    return
                conn = http.client.HTTPConnection("127.0.0.1", up, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "expect")}
                headers["Host"] = f"127.0.0.1:{up}"
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                # a HEAD answer has no body: its Content-Length is the object's (clients read sizes from it)
                length = resp.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length if length is not None else str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        open_conns = self._conns = set()

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):  # clients killed mid-request are expected
                pass

            def process_request(self, request, client_address):
                open_conns.add(request)  # so that down() can cut kept-alive connections too
                super().process_request(request, client_address)

            def shutdown_request(self, request):
                open_conns.discard(request)
                super().shutdown_request(request)

        self._server_cls = Server
        self._handler = Handler
        self.server: ThreadingHTTPServer | None = None
        self.port = free_port()
        self.up()

    def up(self) -> None:
        """Listen (again) on ``self.port``."""
        if self.server is not None:
            return
        self.server = self._server_cls(("127.0.0.1", self.port), self._handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def down(self) -> None:
        """An outage: close the port (new connections are refused) and every open connection."""
        if self.server is None:
            return
        self.server.shutdown()
        self.server.server_close()
        self.server = None
        for conn in list(self._conns):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._conns.clear()

    def close(self) -> None:
        self.down()


def storage_options(port: int, **extra) -> dict:
    # No region: s3fs would send it as the bucket's LocationConstraint, which us-east-1 refuses.
    return {"endpoint_url": f"http://127.0.0.1:{port}", "key": "testing", "secret": "testing", **extra}


class StallProxy:
    """A TCP relay on loopback in front of ``upstream`` port that can stop forwarding while keeping every
    connection open: the store, as its clients see it, accepted their connections and then went silent
    (nothing read, nothing answered). ``stall(after=b"...")``: forward until a client sends bytes holding
    ``after`` (a request line, say), then stall every connection, new ones included; ``stall()``: at once.
    Stalled connections stay open until ``close()``."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream = upstream_port
        self.stalled = threading.Event()
        self.trigger: bytes | None = None
        self.connections = 0
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def stall(self, after: bytes | None = None) -> None:
        if after is None:
            self.stalled.set()
        else:
            self.trigger = after

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
                self._socks.append(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(("127.0.0.1", self.upstream))
        except OSError:
            client.close()
            return
        with self._lock:
            self._socks.append(upstream)
        threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()
        self._pump(client, upstream, True)

    def _pump(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        try:
            while not self.stalled.is_set():
                data = src.recv(65536)
                if not data:
                    dst.shutdown(socket.SHUT_WR)
                    return
                if from_client and self.trigger is not None and self.trigger in data:
                    self.stalled.set()  # this request never reaches the store
                if self.stalled.is_set():
                    break
                dst.sendall(data)
        except OSError:
            return
        while not self._closed:  # stalled: read nothing more, forward nothing more, keep the connection
            time.sleep(0.05)

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with self._lock:
            for s in self._socks:
                for end in (lambda: s.shutdown(socket.SHUT_RDWR), s.close):
                    try:
                        end()
                    except OSError:
                        pass
