"""bench/proxy.py on real sockets on 127.0.0.1: delay, pipelining, half-closes, resets, gRPC, clean shutdown.

Only lower bounds on time are asserted (the machine is shared); upper bounds are loose enough to tell a pipe
with latency from a stop-and-wait link.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import threading
import time
from concurrent import futures

import grpc
import pytest

from bench.proxy import DelayProxy, netem_available, parse_target

DELAY_S = 0.05


class EchoServer:
    """Echoes every connection until EOF, then closes it; `close()` ends every connection and joins every thread."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._conns: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self._conns.append(conn)
            thread = threading.Thread(target=self._echo, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with conn:
            try:
                while data := conn.recv(1 << 16):
                    conn.sendall(data)
            except OSError:
                pass

    def close(self) -> None:
        self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for conn in list(self._conns):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in list(self._threads):
            thread.join(5)


@pytest.fixture
def echo():
    server = EchoServer()
    yield server
    server.close()


@pytest.fixture
def proxy(echo):
    with DelayProxy(echo.endpoint, DELAY_S) as p:
        yield p


def connect(endpoint: str) -> socket.socket:
    host, port = parse_target(endpoint)
    sock = socket.create_connection((host, port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        part = sock.recv(min(n - got, 1 << 20))
        assert part, f"connection closed after {got} of {n} bytes"
        parts.append(part)
        got += len(part)
    return b"".join(parts)


@pytest.mark.parametrize("size", [5, 4 * 1024 * 1024 + 3])
def test_round_trip_pays_the_delay_both_ways_and_keeps_every_byte(proxy, size):
    message = random.Random(size).randbytes(size)
    with connect(proxy.endpoint) as sock:
        start = time.monotonic()
        sender = threading.Thread(target=sock.sendall, args=(message,))  # while we read: no buffer deadlock
        sender.start()
        try:
            echoed = recv_exactly(sock, size)
        finally:
            sender.join(30)
        elapsed = time.monotonic() - start
    assert echoed == message
    assert 2 * DELAY_S <= elapsed < 20


def test_back_to_back_writes_share_one_delay(echo):
    """Ten writes 5 ms apart, no waiting for answers: a pipe takes ~2 delays, stop-and-wait would take ~20."""
    n, delay_s = 10, 0.1  # 0.1 s rather than DELAY_S: more room between ~0.25 s and the 0.5 s bound on a busy machine
    with DelayProxy(echo.endpoint, delay_s) as proxy, connect(proxy.endpoint) as sock:
        start = time.monotonic()
        for i in range(n):
            sock.sendall(bytes([i]) * 100)
            time.sleep(0.005)  # so that the proxy reads them as separate chunks
        echoed = recv_exactly(sock, 100 * n)
        elapsed = time.monotonic() - start
    assert echoed == b"".join(bytes([i]) * 100 for i in range(n))
    assert 2 * delay_s <= elapsed < n * delay_s / 2


def test_bandwidth_limit_slows_a_transfer(echo):
    size, bandwidth_bps = 200_000, 1_000_000
    with DelayProxy(echo.endpoint, 0.0, bandwidth_bps=bandwidth_bps) as proxy, connect(proxy.endpoint) as sock:
        start = time.monotonic()
        sock.sendall(b"x" * size)
        assert recv_exactly(sock, size) == b"x" * size
        elapsed = time.monotonic() - start
    assert elapsed >= 0.95 * size / bandwidth_bps  # the echo flows back while the rest still goes out: ~1x, not 2x


def test_half_close_reaches_the_server_after_the_queued_data(proxy):
    with connect(proxy.endpoint) as sock:
        sock.sendall(b"last words")
        sock.shutdown(socket.SHUT_WR)  # the echo server closes on EOF, which must come back to us after the data
        received = b""
        while chunk := sock.recv(1024):
            received += chunk
    assert received == b"last words"


def test_a_reset_from_the_server_reaches_the_client():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def accept_and_reset() -> None:
        conn, _ = listener.accept()
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        conn.close()

    thread = threading.Thread(target=accept_and_reset, daemon=True)
    thread.start()
    try:
        with DelayProxy(f"127.0.0.1:{port}", DELAY_S) as proxy, connect(proxy.endpoint) as sock:
            with pytest.raises(ConnectionResetError):
                sock.recv(1024)
    finally:
        listener.close()
        thread.join(5)


def test_an_unreachable_target_ends_the_connection_and_the_proxy_keeps_serving():
    with socket.create_server(("127.0.0.1", 0)) as placeholder:
        dead = f"127.0.0.1:{placeholder.getsockname()[1]}"
    with DelayProxy(dead, DELAY_S) as proxy:
        for _ in range(2):
            with pytest.raises(ConnectionResetError):  # on recv, or on connect when the reset came first
                with connect(proxy.endpoint) as sock:
                    sock.recv(1024)


def test_grpc_round_trip_through_the_proxy():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    echo = grpc.unary_unary_rpc_method_handler(lambda request, context: request[::-1])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Echo", {"Echo": echo}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with DelayProxy(f"127.0.0.1:{port}", DELAY_S) as proxy, grpc.insecure_channel(proxy.endpoint) as channel:
            call = channel.unary_unary("/test.Echo/Echo")
            assert call(b"hello swarm", timeout=30) == b"hello swarm"[::-1]
            start = time.monotonic()
            assert call(b"again", timeout=30) == b"niaga"  # the channel is connected now: one round trip
            assert time.monotonic() - start >= 2 * DELAY_S
    finally:
        server.stop(grace=None).wait(5)


def test_close_with_an_open_connection_leaves_no_thread_and_ends_the_connection(echo):
    before = set(threading.enumerate())
    proxy = DelayProxy(echo.endpoint, DELAY_S)
    endpoint = proxy.start()
    assert proxy.wait_until_ready(1) == endpoint
    with connect(endpoint) as sock:
        sock.sendall(b"ping")
        assert recv_exactly(sock, 4) == b"ping"
        sock.sendall(b"in flight")
        proxy.close()
        proxy.close()  # idempotent
        sock.settimeout(10)  # a connection the proxy failed to close would time out here
        try:
            while sock.recv(1024):
                pass
        except ConnectionResetError:
            pass
    deadline = time.monotonic() + 5  # the echo server's thread for that connection ends once the proxy hung up
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert set(threading.enumerate()) - before == set()
    with pytest.raises(RuntimeError):
        proxy.start()


@pytest.mark.parametrize(
    "target", ["", "localhost", "localhost:", ":80", "host:http", "host:0", "host:65536", "host:-1"]
)
def test_a_malformed_target_is_a_value_error(target):
    with pytest.raises(ValueError, match="target="):
        DelayProxy(target, DELAY_S)


@pytest.mark.parametrize("delay_s", [-0.001, float("nan"), float("inf")])
def test_a_bad_delay_is_a_value_error(delay_s):
    with pytest.raises(ValueError, match="delay_s="):
        DelayProxy("127.0.0.1:1", delay_s)


def test_a_bad_bandwidth_is_a_value_error():
    with pytest.raises(ValueError, match="bandwidth_bps="):
        DelayProxy("127.0.0.1:1", DELAY_S, bandwidth_bps=0)


def test_ipv6_target_is_parsed():
    assert parse_target("[::1]:8080") == ("::1", 8080)


def test_netem_probe_answers_and_leaves_no_namespace():
    assert isinstance(netem_available(timeout_s=5), bool)
    if shutil.which("ip"):
        assert "swarmlm-probe-" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
