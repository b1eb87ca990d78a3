"""A warm launcher for the tests' `swarmlm` processes: it imports our code once, then forks a child per command.

A process that imports the peer's code spends about 4 CPU-seconds on an idle machine before it does anything
(torch, transformers' masking utilities with torch._dynamo, hivemind), and the suite starts about 150 of them
on 2 cores. The zygote imports those modules once, while it has a single thread (OMP_NUM_THREADS=1: no BLAS
pool yet), and for each request forks a child that becomes what `swarmlm ARGS...` would be: a session of its
own, stdin from /dev/null, stdout and stderr to the given files, the given environment and working directory,
fresh random state, then `swarm.cli.main(ARGS)` and a normal interpreter exit. The child is a real process
running the real command; only the interpreter's start and the imports are shared.

Protocol, JSON lines: requests on the zygote's stdin, {"argv", "env", "cwd", "stdout", "stderr", "netns"}; on its
stdout {"ready": pid, "threads": N} once, then {"pid"} (or {"error"}) per request in turn, and {"exit": pid, "code": N}
when a child ends (N < 0: killed by signal -N, as `subprocess` reports it). It exits when its stdin closes.

The test side is `Zygote` (one per test process, started on first use by `launcher()`); `Forked` offers what
tests/helpers/processes.py uses of `subprocess.Popen`. `SWARMLM_TEST_FORK=0` makes every test exec instead.
"""

from __future__ import annotations

import atexit
import ctypes
import faulthandler
import importlib
import json
import os
import queue
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
PRELOAD = (
    "swarm.cli",
    "swarm.bootstrap",
    "swarm.status",
    "peer.cli",
    "peer.server",
    "client.training.cli",
    "client.training.export",
    "client.api.cli",
    "client.monitor.cli",
)
READY_TIMEOUT_S = 120.0
REPLY_TIMEOUT_S = 30.0
CLONE_NEWNET = 0x40000000  # os.setns and os.CLONE_NEWNET come with Python 3.12
ORPHAN_EXIT_CODE = 255  # what a Forked reports when the zygote ended before it did


# --- the zygote process ---


_replies_fd = 1  # the zygote's stdout at start; stray prints of what it imports go to its stderr instead


def _send(message: dict) -> None:
    data = (json.dumps(message) + "\n").encode()
    while data:
        data = data[os.write(_replies_fd, data) :]


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def serve() -> dict | None:
    """Import, then fork a child per request. Returns the request in each child; None in the zygote at EOF."""
    global _replies_fd
    _replies_fd = os.dup(1)
    os.dup2(2, 1)
    for name in PRELOAD:
        importlib.import_module(name)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a child's end wakes select() through the wakeup fd
    _send({"ready": os.getpid(), "threads": len(os.listdir("/proc/self/task"))})
    pending = b""
    while True:
        ready, _, _ = select.select([0, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
        _reap()
        if 0 not in ready:
            continue
        chunk = os.read(0, 65536)
        if not chunk:
            return None
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            try:
                pid = os.fork()
            except OSError as exc:
                _send({"error": repr(exc)})
                continue
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.close(wake_r)
                os.close(wake_w)
                os.close(_replies_fd)
                return request
            _send({"pid": pid})


def become(request: dict) -> None:
    """In the forked child: what `subprocess.Popen(..., start_new_session=True)` and a fresh interpreter give."""
    import numpy
    from hivemind.utils.mpfuture import MPFuture

    os.setsid()
    if request.get("netns"):
        enter_netns(request["netns"])
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(out, fd)
        os.close(out)
    numpy.random.seed()  # `random` reseeds itself after fork; numpy's global generator does not
    # hivemind's futures share process-wide multiprocessing locks, made when the zygote imported hivemind: without
    # locks of its own, a child waits forever on one that a sibling held when it was SIGKILLed (as tests kill peers)
    MPFuture.reset_backend()
    # SIGUSR1 writes every thread's stack to stderr (the processes this one forks inherit it): how a test shows
    # where a process that stays silent is stuck (Swarm.wait_for)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # Ctrl+C as in a terminal, also when the suite runs where SIGINT is ignored (a background job, some CI
    # runners): the zygote then inherited SIG_IGN, and so would every command's Ctrl+C test
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = ["swarmlm", *request["argv"]]


def enter_netns(name: str) -> None:
    """Move this (single-threaded) process into the network namespace `name`, as `ip netns exec` does for the
    command it runs: what it binds and reaches from then on, and what it starts, is in there."""
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into network namespace {name!r} failed")
    finally:
        os.close(fd)


# --- the test side ---


class Forked:
    """A child of the zygote, with the part of `subprocess.Popen`'s interface the tests' helpers use."""

    def __init__(self, pid: int, args: list[str]):
        self.pid, self.args = pid, args
        self.returncode: int | None = None
        self.orphaned = False  # the zygote ended before it: its exit code can no longer be known
        self._ended = threading.Event()

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._ended.set()

    def poll(self) -> int | None:
        if self.returncode is None and self.orphaned:
            try:
                gone = psutil.Process(self.pid).status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                gone = True
            if gone:
                self._exited(ORPHAN_EXIT_CODE)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._ended.wait(0.1 if left is None else min(left, 0.1))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ZygoteError(RuntimeError):
    """The zygote did not start, or stopped answering."""


class Zygote:
    """The zygote process, seen from the test process: `start()` forks a command in it."""

    def __init__(self, env: dict[str, str]):
        self._log = tempfile.NamedTemporaryFile(prefix="swarmlm-zygote-", suffix=".err", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.zygote"],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            start_new_session=True,
        )
        self._lock = threading.Lock()  # one request at a time, so replies come in the order they are read
        self._replies: queue.Queue[dict | None] = queue.Queue()  # None: the zygote is gone
        self._children: dict[int, Forked] = {}
        self.alive = True
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self._reader.start()
        ready = self._reply(READY_TIMEOUT_S)
        if ready is None or ready["threads"] != 1:  # forking a process with threads can deadlock its child
            log = Path(self._log.name).read_text(errors="replace")[-4000:]
            self.close()
            raise ZygoteError(f"the tests' zygote did not start (threads: {ready and ready['threads']}):\n{log}")

    def _read(self) -> None:
        for line in self.proc.stdout:
            message = json.loads(line)
            if "exit" in message:
                child = self._children.pop(message["exit"], None)
                if child is not None:
                    child._exited(message["code"])
                continue
            if "pid" in message:  # registered before its exit report can come
                message["child"] = self._children[message["pid"]] = Forked(message["pid"], [])
            self._replies.put(message)
        self.alive = False  # EOF: the zygote is gone; its children, if any, are orphans now
        for child in self._children.values():
            child.orphaned = True
        self._replies.put(None)

    def _reply(self, timeout_s: float) -> dict | None:
        try:
            return self._replies.get(timeout=timeout_s)
        except queue.Empty:
            self.alive = False  # a late reply would answer the next request
            return None

    def start(
        self, args: list[str], argv: list[str], env: dict[str, str], stdout: Path, stderr: Path, netns: str = ""
    ) -> Forked:
        """Fork `swarmlm ARGV...` (shown as `args`) with its output appended to the given files, in the network
        namespace `netns` if given (`ip netns add` made it)."""
        with self._lock:
            if not self.alive:
                raise ZygoteError("the tests' zygote has stopped")
            request = {"argv": argv, "env": env, "cwd": os.getcwd(), "stdout": str(stdout), "stderr": str(stderr)}
            request["netns"] = netns
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            reply = self._reply(REPLY_TIMEOUT_S)
            if reply is None or "error" in reply:
                raise ZygoteError(
                    f"the tests' zygote did not fork `{' '.join(args)}` within {REPLY_TIMEOUT_S} s: {reply}"
                )
            reply["child"].args = args
            return reply["child"]

    def close(self) -> None:
        self.alive = False
        try:
            self.proc.stdin.close()
            self.proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self._reader.join(5)  # it reads to EOF, which the zygote's exit gave it
        self.proc.stdout.close()
        self._log.close()
        os.unlink(self._log.name)


_zygote: Zygote | None = None
_zygote_lock = threading.Lock()
_failed = False  # a zygote failed to start: exec from then on


def launcher(env: dict[str, str]) -> Zygote | None:
    """The test process's zygote (started on first use with `env`), or None where tests exec every command:
    with `SWARMLM_TEST_FORK=0`, or once a zygote failed to start (a warning says why; exec is only slower)."""
    global _zygote, _failed
    if os.environ.get("SWARMLM_TEST_FORK", "1") == "0" or _failed:
        return None
    with _zygote_lock:
        if _zygote is None or not _zygote.alive:
            try:
                _zygote = Zygote(env)
            except ZygoteError as exc:
                _failed = True
                warnings.warn(f"tests exec every command from now on: {exc}", stacklevel=2)
                return None
            atexit.register(_zygote.close)
        return _zygote


if __name__ == "__main__":
    chosen = serve()
    if chosen is None:
        sys.exit(0)
    become(chosen)
    from swarm.cli import main

    sys.exit(main(chosen["argv"]))
