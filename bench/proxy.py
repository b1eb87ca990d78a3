"""A TCP proxy that adds one-way delay (and optionally a bandwidth cap) in front of a local server.

It emulates a wide-area link on 127.0.0.1: each chunk read on one side is written on the other `delay_s`
later, independently of the chunks before it (a pipe with latency, not a stop-and-wait link), in order.
Half-closes and resets are forwarded after the data queued before them.

Scenarios use it by putting a proxy in front of a peer's gRPC endpoint and dialling (or announcing) the
proxy's address instead of the peer's:

    with DelayProxy(peer_endpoint, delay_s=0.05) as proxy:
        client = ...connect to proxy.endpoint...   # every message now pays 50 ms each way

`netem_available()` says whether Linux `tc netem` could be used instead (needs root and the sch_netem module).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import secrets
import shutil
import socket
import struct
import subprocess
import sys
import threading

logger = logging.getLogger(__name__)

_CHUNK_BYTES = 64 * 1024
_MAX_QUEUED_CHUNKS = 256  # per direction: at most 16 MiB in flight before the sender is held back
_RESET = None  # queued in place of a chunk when the source side was reset


def parse_target(target: str) -> tuple[str, int]:
    """Split "host:port" (or "[v6]:port"); raises ValueError naming the bad value."""
    host, sep, port = target.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"target={target!r} is not 'host:port' with a port in 1..65535")
    return host, int(port)


class DelayProxy:
    """Listens on 127.0.0.1 (ephemeral port) and forwards each connection to `target` with added delay.

    The asyncio loop runs in a background thread; `start()` returns "127.0.0.1:PORT" once listening and
    `close()` (idempotent; also `shutdown()` and leaving the `with` block) drops every connection and stops it.
    """

    def __init__(self, target: str, delay_s: float, *, bandwidth_bps: float | None = None):
        if not (isinstance(delay_s, (int, float)) and math.isfinite(delay_s) and delay_s >= 0):
            raise ValueError(f"delay_s={delay_s!r} must be a finite number of seconds >= 0")
        if bandwidth_bps is not None and not (math.isfinite(bandwidth_bps) and bandwidth_bps > 0):
            raise ValueError(f"bandwidth_bps={bandwidth_bps!r} must be > 0 bytes/s, or None for no limit")
        self.target, self.delay_s, self.bandwidth_bps = target, float(delay_s), bandwidth_bps
        self._host, self._port = parse_target(target)
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.Task] = set()
        self._endpoint: str | None = None
        self._closed = False  # set once, by close(); read by the loop thread too

    @property
    def endpoint(self) -> str:
        """ "127.0.0.1:PORT" that clients dial instead of the target."""
        if self._endpoint is None:
            raise RuntimeError("DelayProxy is not listening; call start() first")
        return self._endpoint

    def start(self, timeout_s: float = 10.0) -> str:
        """Start the loop thread and listen; returns the endpoint. Raises RuntimeError if started or closed."""
        with self._lock:
            if self._thread is not None or self._closed:
                raise RuntimeError(f"DelayProxy to {self.target} was already started or closed")
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._run, name=f"DelayProxy->{self.target}", daemon=True)
            self._thread.start()
        try:
            port = asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(timeout_s)
        except BaseException:
            self.close()
            raise
        self._endpoint = f"127.0.0.1:{port}"
        self._ready.set()
        return self._endpoint

    def wait_until_ready(self, timeout_s: float | None = None) -> str:
        """Block until the proxy listens; returns the endpoint. Raises TimeoutError."""
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"DelayProxy to {self.target} was not listening within {timeout_s}s")
        return self.endpoint

    def close(self, timeout_s: float = 10.0) -> None:
        """Close the listener and every connection (reset), stop the loop and join its thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(timeout_s)
        except Exception as exc:  # the loop still has to stop, whatever went wrong
            logger.warning("DelayProxy to %s did not shut down cleanly: %r", self.target, exc)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout_s)

    shutdown = close

    def __enter__(self) -> DelayProxy:
        if self._thread is None:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _run(self) -> None:
        assert self._loop is not None
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    async def _listen(self) -> int:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        await asyncio.sleep(0)  # handlers of connections accepted just now start, and see that we are closing
        while self._connections:
            for task in self._connections:
                task.cancel()
            await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()  # from 3.12, this waits for the connections: after cancelling them
        await asyncio.sleep(0)  # let the aborted transports close their sockets

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        target_w: asyncio.StreamWriter | None = None
        try:
            if self._closed:
                return
            try:
                target_r, target_w = await asyncio.open_connection(self._host, self._port)
            except OSError as exc:  # as close to "connection refused" as an accepted connection gets
                logger.debug("DelayProxy cannot reach %s: %r", self.target, exc)
                _reset(client_w)
                return
            await asyncio.gather(self._pipe(client_r, target_w, client_w), self._pipe(target_r, client_w, target_w))
        except asyncio.CancelledError:
            if not self._closed:
                raise
            # close() cancelled us: end normally, as asyncio 3.11 logs an error for a cancelled handler task
        finally:
            for writer in (client_w, target_w):
                if writer is not None and self._closed:
                    writer.transport.abort()  # do not wait for unsent data: the proxy is going away
                elif writer is not None:
                    writer.close()
            self._connections.discard(task)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, src_w: asyncio.StreamWriter) -> None:
        """One direction: a receiver stamps each chunk with its due time, a sender writes it then."""
        queue: asyncio.Queue[tuple[float, bytes | None]] = asyncio.Queue(_MAX_QUEUED_CHUNKS)
        receiver = asyncio.create_task(self._receive(src, queue))
        sender = asyncio.create_task(self._send(queue, dst, src_w))
        try:
            await sender  # ends after EOF or a reset was forwarded, or when writing failed
        finally:
            receiver.cancel()
            sender.cancel()
            await asyncio.gather(receiver, sender, return_exceptions=True)

    async def _receive(self, src: asyncio.StreamReader, queue: asyncio.Queue) -> None:
        loop = asyncio.get_running_loop()
        link_free = 0.0  # when the emulated link finishes sending what it was given (bandwidth cap)
        while True:
            try:
                chunk: bytes | None = await src.read(_CHUNK_BYTES)
            except OSError:
                chunk = _RESET
            link_free = max(loop.time(), link_free)
            if chunk and self.bandwidth_bps is not None:
                link_free += len(chunk) / self.bandwidth_bps
            await queue.put((link_free + self.delay_s, chunk))
            if not chunk:
                return

    async def _send(self, queue: asyncio.Queue, dst: asyncio.StreamWriter, src_w: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due, chunk = await queue.get()
            await asyncio.sleep(max(0.0, due - loop.time()))
            try:
                if chunk:
                    dst.write(chunk)
                await dst.drain()
                if chunk is _RESET:
                    _reset(dst)
                    return
                if not chunk:
                    if dst.can_write_eof():
                        dst.write_eof()  # a half-close: the other direction may still carry data
                    else:
                        dst.close()
                    return
            except OSError:  # the far side is gone: reset the near one, as a real link would
                _reset(src_w)
                return


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with an RST rather than a FIN (SO_LINGER 0), dropping anything unsent."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


def netem_available(timeout_s: float = 5.0) -> bool:
    """Whether `tc qdisc ... netem` works here, probed in a throwaway network namespace that is always removed."""
    if not sys.platform.startswith("linux") or not (shutil.which("ip") and shutil.which("tc")):
        return False
    namespace = f"swarmlm-probe-{os.getpid()}-{secrets.token_hex(3)}"

    def ok(*cmd: str) -> bool:
        try:
            return subprocess.run(cmd, capture_output=True, timeout=timeout_s).returncode == 0
        except (OSError, subprocess.SubprocessError):
            return False

    try:
        return ok("ip", "netns", "add", namespace) and ok(
            "ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"
        )
    finally:
        ok("ip", "netns", "del", namespace)
