"""A fault-injecting HTTP proxy on loopback, for pushing through unreliable networks in tests.

It sits in front of one upstream server (the GCS emulator, moto's S3) and forwards each request on a
fresh upstream connection, one request per client connection. A seeded share of requests fails:

- "503": answered with 503 and never forwarded (the server never saw it);
- "reset": the connection is dropped (RST) after the request was read, never forwarded;
- "truncate": a GET is forwarded and its response cut off halfway through the body (other methods
  get a 503 instead);
- "drop": the request is forwarded and applied by the server, then the connection is dropped (RST)
  before any of the response reaches the client: the client cannot tell whether its write landed.
  Not among the default kinds: ask for it by name. What a client does next (resend, query, give up)
  is what it tests; a resumable-upload chunk resent to the GCS emulator is answered 400 "Invalid
  Content-Range start" (see tests/test_upload_restart.py).

`status=403` (say) answers every targeted request with that status instead (permanent errors), and
`delay` slows every request down. Faults are drawn from `random.Random(seed)` and bounded by
`max_faults`; `requests` and `faults` count what happened.

Every forwarded response is also recorded as a `Transfer` (method, path, the request's `Range`,
status, body bytes), so a test can tell ranged reads from whole-object downloads and add up the
bytes each client fetched: `range_reads`, `range_bytes` and `media_downloads` summarize them.
"""

from __future__ import annotations

import json
import random
import re
import socket
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

KINDS = ("503", "reset", "truncate")
ALL_KINDS = (*KINDS, "drop")


@dataclass
class FaultPlan:
    """What the proxy does to the requests it forwards."""

    rate: float = 0.0
    kinds: tuple[str, ...] = KINDS
    seed: int = 0
    max_faults: int | None = None
    status: int | None = None
    delay: float = 0.0
    only_paths: tuple[str, ...] = ()  # when set, faults hit only request paths containing one of these
    spare_first: int = 0  # let this many targeted requests through before any fault
    message: str = "injected permanent error"  # the error text of `status` answers (stores echo odd things)
    # (method, path substring, status): answered by the proxy itself, never forwarded, e.g. what real GCS
    # answers where the emulator has no handler: ("DELETE", "upload_id=", 499) cancels a resumable upload.
    answers: tuple[tuple[str, str, int], ...] = ()


@dataclass(frozen=True)
class Transfer:
    """One forwarded request and what came back: `range` is the request's `Range: bytes=a-b` as
    [a, b + 1) (None without one), `body` the response body bytes sent to the client."""

    method: str
    path: str
    range: tuple[int, int] | None
    status: int
    body: int
    content_type: str


@dataclass
class _Counters:
    requests: int = 0
    targeted: int = 0
    bytes_down: int = 0  # response bytes sent to clients, headers included
    faults: Counter = field(default_factory=Counter)
    log: list = field(default_factory=list)
    transfers: list[Transfer] = field(default_factory=list)

    @property
    def range_reads(self) -> list[Transfer]:
        """Successful GETs that asked for a byte range."""
        return [t for t in self.transfers if t.method == "GET" and t.range is not None and t.status in (200, 206)]

    @property
    def range_bytes(self) -> int:
        return sum(t.body for t in self.range_reads)

    @property
    def media_downloads(self) -> list[Transfer]:
        """Successful GETs of object data without a range: whole-object downloads (GCS `alt=media`, or
        an S3 object, which moto serves as `binary/octet-stream`)."""
        return [
            t for t in self.transfers
            if t.method == "GET" and t.range is None and t.status == 200
            and ("alt=media" in t.path or "octet-stream" in t.content_type)
        ]


class FaultProxy:
    """`FaultProxy(upstream_port).start()`; its `url` is what clients use instead of the upstream's.
    `xml_errors` makes injected errors S3-style XML instead of GCS-style JSON."""

    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1", *, xml_errors: bool = False) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.xml = xml_errors
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        # Requests read and not yet counted: `reset` waits for them, since a client can have its whole
        # answer before the proxy's thread records the transfer.
        self._busy = 0
        self._idle = threading.Condition(self._lock)
        self._stopping = threading.Event()
        self.plan = FaultPlan()
        self._rng = random.Random(0)
        self.counters = _Counters()

    def start(self) -> FaultProxy:
        threading.Thread(target=self._accept_loop, name="faultproxy", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._sock.close()

    def configure(self, **plan: object) -> None:
        """Replace the plan (unset fields take their defaults) and reset the counters."""
        with self._lock:
            self.plan = FaultPlan(**plan)  # type: ignore[arg-type]
            self._rng = random.Random(self.plan.seed)
            self.counters = _Counters()

    def reset(self) -> None:
        """New counters, once every request already read has been counted in the old ones."""
        with self._idle:
            self._idle.wait_for(lambda: self._busy == 0, timeout=60)  # a hang guard only
        self.configure()

    @property
    def requests(self) -> int:
        return self.counters.requests

    @property
    def faults(self) -> Counter:
        return self.counters.faults

    # Internals.

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _decide(self, method: str, path: str) -> str | None:
        with self._lock:
            plan, counters = self.plan, self.counters
            counters.requests += 1
            fault = None
            targeted = not plan.only_paths or any(p in path for p in plan.only_paths)
            if targeted:
                counters.targeted += 1
                targeted = counters.targeted > plan.spare_first
            if plan.status is not None and targeted:
                fault = "status"
            elif plan.rate > 0 and targeted:
                if plan.max_faults is None or sum(counters.faults.values()) < plan.max_faults:
                    if self._rng.random() < plan.rate:
                        fault = self._rng.choice(plan.kinds)
                        if fault == "truncate" and method != "GET":
                            fault = "503"
            if fault is not None:
                counters.faults[fault] += 1
            counters.log.append((method, path, fault))
            return fault

    def _serve(self, client: socket.socket) -> None:
        try:
            head, body = _read_request(client)
            if head is None:
                return
            with self._lock:
                self._busy += 1
            try:
                self._answer(client, head, body)
            finally:
                with self._idle:
                    self._busy -= 1
                    self._idle.notify_all()
        except OSError:
            pass
        finally:
            client.close()

    def _answer(self, client: socket.socket, head: bytes, body: bytes) -> None:
        method, path = head.split(b" ", 2)[:2]
        fault = self._decide(method.decode(), path.decode("latin-1"))
        if self.plan.delay:
            time.sleep(self.plan.delay)
        answer = next((status for m, p, status in self.plan.answers
                       if m == method.decode() and p in path.decode("latin-1")), None)
        if answer is not None and fault is None:
            _respond(client, method.decode(), answer, "answered by the proxy", xml=self.xml)
        elif fault == "status":
            _respond(client, method.decode(), self.plan.status or 500, self.plan.message, xml=self.xml)
        elif fault == "503":
            _respond(client, method.decode(), 503, "injected: service unavailable", xml=self.xml)
        elif fault == "reset":
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        else:
            self._forward(client, head, body, truncate=fault == "truncate", drop=fault == "drop")

    def _forward(self, client: socket.socket, head: bytes, body: bytes, *, truncate: bool, drop: bool = False) -> None:
        upstream = socket.create_connection(self.upstream, timeout=120)
        try:
            upstream.sendall(_with_header(head, b"Connection", b"close") + body)
            response = _read_until(upstream, b"\r\n\r\n")
            if drop:  # the server has answered, so it applied the request; the client never hears of it
                while upstream.recv(1 << 20):
                    pass
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return
            resp_head, _, rest = response.partition(b"\r\n\r\n")
            resp_head = _with_header(resp_head + b"\r\n\r\n", b"Connection", b"close")
            length = _header(resp_head, b"content-length")
            if truncate and length is not None and int(length) > 1:
                client.sendall(resp_head)
                cut, body = int(length) // 2, bytearray(rest)
                while len(body) < cut:
                    more = upstream.recv(1 << 20)
                    if not more:
                        break
                    body += more
                client.sendall(body[:cut])
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return
            client.sendall(resp_head + rest)
            sent = len(resp_head) + len(rest)
            while more := upstream.recv(1 << 20):
                client.sendall(more)
                sent += len(more)
            transfer = Transfer(
                method=head.split(b" ", 1)[0].decode(),
                path=head.split(b" ", 2)[1].decode("latin-1"),
                range=_byte_range(_header(head, b"range")),
                status=_status(resp_head),
                body=sent - len(resp_head),
                content_type=(_header(resp_head, b"content-type") or b"").decode("latin-1"),
            )
            with self._lock:
                self.counters.bytes_down += sent
                self.counters.transfers.append(transfer)
        finally:
            upstream.close()


_S3_CODES = {403: "AccessDenied", 404: "NoSuchBucket", 503: "SlowDown"}


def _respond(client: socket.socket, method: str, status: int, message: str, *, xml: bool) -> None:
    """An error response in the upstream's dialect (GCS JSON or S3 XML); no body for HEAD."""
    if xml:
        code = _S3_CODES.get(status, "InternalError")
        body = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code>"
                f"<Message>{message}</Message></Error>").encode()
        content_type = "application/xml"
    else:
        body = json.dumps({"error": {"code": status, "message": message}}).encode()
        content_type = "application/json"
    reason = {403: "Forbidden", 404: "Not Found", 499: "Client Closed Request", 503: "Service Unavailable"}.get(status,
                                                                                                                "Error")
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    client.sendall(head if method == "HEAD" else head + body)


def _read_until(sock: socket.socket, marker: bytes) -> bytes:
    data = bytearray()
    while marker not in data:
        more = sock.recv(65536)
        if not more:
            break
        data += more
    return bytes(data)


def _read_request(client: socket.socket) -> tuple[bytes | None, bytes]:
    """The request head (with its blank line) and its whole body; answers `Expect: 100-continue`."""
    data = _read_until(client, b"\r\n\r\n")
    if b"\r\n\r\n" not in data:
        return None, b""
    head, _, rest = data.partition(b"\r\n\r\n")
    head += b"\r\n\r\n"
    if (_header(head, b"expect") or b"").lower() == b"100-continue":
        head = _without_header(head, b"Expect")
        client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
    body = bytearray(rest)  # grows in place: bodies are tens of MB
    length = _header(head, b"content-length")
    if length is not None:
        while len(body) < int(length):
            more = client.recv(1 << 20)
            if not more:
                break
            body += more
    elif (_header(head, b"transfer-encoding") or b"").lower() == b"chunked":
        while not body.endswith(b"0\r\n\r\n"):
            more = client.recv(1 << 20)
            if not more:
                break
            body += more
    return head, bytes(body)


def _header(head: bytes, name: bytes) -> bytes | None:
    for line in head.split(b"\r\n")[1:]:
        key, sep, value = line.partition(b":")
        if sep and key.strip().lower() == name:
            return value.strip()
    return None


def _status(head: bytes) -> int:
    try:
        return int(head.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return 0


def _byte_range(value: bytes | None) -> tuple[int, int] | None:
    """`bytes=a-b` as [a, b + 1); None for no header or a form other than one closed range."""
    if value is None:
        return None
    m = re.fullmatch(rb"bytes=(\d+)-(\d+)", value.strip())
    return (int(m.group(1)), int(m.group(2)) + 1) if m else None


def _without_header(head: bytes, name: bytes) -> bytes:
    lines = head.rstrip(b"\r\n").split(b"\r\n")
    kept = [lines[0]] + [line for line in lines[1:] if line.partition(b":")[0].strip().lower() != name.lower()]
    return b"\r\n".join(kept) + b"\r\n\r\n"


def _with_header(head: bytes, name: bytes, value: bytes) -> bytes:
    stripped = _without_header(head, name)
    return stripped[:-2] + name + b": " + value + b"\r\n\r\n"
