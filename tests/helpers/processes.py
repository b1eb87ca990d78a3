"""A real swarm on 127.0.0.1 for integration tests: bootstrap and peer processes that are always reaped.

Every process runs `swarmlm ...` in its own session (`start_new_session=True`), so the process, the hivemind
DHT process it forks and that one's p2pd daemon can all be found by session id and signalled as one group.
`Swarm.close()` (also on exceptions, through `with` or the `swarm` fixture) stops every process group with
SIGTERM, then SIGKILL after a bounded wait, and raises `LeftoverProcessError` if anything of ours survives.

`reaping_descendants(popen)` does the same for a process that starts its own children (`swarmlm demo`): it
remembers every descendant while the process runs, and SIGKILLs and checks them at the end, whatever happened.

Commands run with `swarmlm` itself (also inside a network namespace) are forked from the test process's zygote
(tests/helpers/zygote.py), which has our modules imported already: the same command in a real process of its own,
without the 4 CPU-seconds of imports each; `SWARMLM_TEST_FORK=0` execs them all instead.

Each process writes stdout and stderr to files under the swarm's log folder; `Swarm.format_logs()` gives their
tails, which waits that time out include in their error and the `swarm` fixture attaches to a failing test's report.

    with Swarm(tmp_path) as swarm:
        maddrs = swarm.start_bootstrap()
        peer = swarm.start_peer(model_path, "--blocks", "0:2")
        swarm.wait_online("tiny-llama", [(0, 2)])
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import psutil

from tests.helpers.zygote import Zygote, launcher

T = TypeVar("T")

LOG_TAIL_CHARS = 4000
STOP_TIMEOUT_S = 10.0  # SIGTERM -> SIGKILL; a healthy peer announces OFFLINE and exits in about 2 s
KILL_TIMEOUT_S = 10.0


class LeftoverProcessError(AssertionError):
    """Processes of ours were still running after the swarm was stopped."""


def sigint_as_in_a_terminal() -> None:
    """`preexec_fn` for a command whose Ctrl+C is tested: SIGINT reaches it as in a terminal, also when the suite
    itself runs with SIGINT ignored (a background job, some CI runners): a child inherits SIG_IGN, and Python then
    installs no handler of its own."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def swarmlm_command() -> list[str]:
    """The `swarmlm` console script of this interpreter's environment, or `python -m swarm.cli` without one."""
    script = Path(sys.executable).parent / "swarmlm"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-m", "swarm.cli"]


def child_env(cache_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        SWARMLM_LOG_LEVEL="INFO",
        SWARMLM_CACHE_DIR=str(cache_dir),
        PYTHONUNBUFFERED="1",  # logs reach the files as they happen, so a timed-out wait shows where it hung
        # several processes share a 2-core machine: one compute thread each keeps them from starving each other
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        # nothing is downloaded in tests
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
    )
    return env


def session_members(sid: int) -> list[psutil.Process]:
    """Live (non-zombie) processes whose session id is `sid`: a process we started and all it spawned."""
    found = []
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getsid(proc.pid) == sid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return found


def describe(procs: Sequence[psutil.Process], threads: bool = False) -> str:
    """A line per process; with `threads`, also where each of its threads waits in the kernel (for a process that
    writes no stacks on SIGUSR1: a native library's threads, or an interpreter past its own shutdown)."""
    lines = []
    for proc in procs:
        try:
            lines.append(f"  pid {proc.pid}: {' '.join(proc.cmdline())[:200]}")
        except psutil.Error:
            lines.append(f"  pid {proc.pid}: (gone)")
            continue
        if threads:
            lines.append(f"    catches SIGUSR1: {catches(proc.pid, signal.SIGUSR1)}; threads: {thread_waits(proc.pid)}")
    return "\n".join(lines)


def thread_waits(pid: int, most: int = 40) -> str:
    """Each of the process's threads (the first `most`) as its name, state and kernel wait channel, from /proc."""
    found = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*"), key=lambda path: int(path.name))[:most]:
        try:
            name = (task / "comm").read_text().strip()
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
            wchan = (task / "wchan").read_text().strip() or "-"
        except (OSError, IndexError):
            continue
        found.append(f"{name} {state} {wchan}")
    return "; ".join(found) or "(none readable)"


def show_stacks(procs: Sequence[ManagedProcess], wait_s: float = 1.0) -> None:
    """Have the Python processes of the given commands' sessions that catch SIGUSR1 (forked ones and what they fork:
    tests/helpers/zygote.py) write their threads' stacks to their stderr: where a process that keeps a test waiting
    is stuck. Others are left alone: SIGUSR1 would end them (p2pd's Go runtime catches it, and then exits)."""
    signalled = False
    for proc in procs:
        if not proc.alive():
            continue
        for member in proc.members():
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                if member.name().startswith("python") and catches(member.pid, signal.SIGUSR1):
                    os.kill(member.pid, signal.SIGUSR1)
                    signalled = True
    if signalled:
        time.sleep(wait_s)


def catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler for `sig` (the kernel's SigCgt mask)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next((line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), "0")
    return bool(int(caught, 16) >> (sig - 1) & 1)


def _tail(path: Path, chars: int = LOG_TAIL_CHARS) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
    return text if len(text) <= chars else "..." + text[-chars:]


class ManagedProcess:
    """One `swarmlm` process in its own session, with stdout/stderr in files."""

    def __init__(
        self,
        name: str,
        args: Sequence[str],
        log_dir: Path,
        env: dict[str, str],
        zygote: Zygote | None = None,
        argv: Sequence[str] = (),
        netns: str | None = None,
    ):
        """Runs `args`; or, given a zygote, forks `swarmlm ARGV...` there, in network namespace `netns` if given
        (`args` is then what it stands for)."""
        self.name = name
        self.args = list(args)
        self.stdout_path = log_dir / f"{name}.out"
        self.stderr_path = log_dir / f"{name}.err"
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            if zygote is not None:
                self.popen = zygote.start(self.args, list(argv), env, self.stdout_path, self.stderr_path, netns or "")
            else:
                self.popen = subprocess.Popen(
                    self.args,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    env=env,
                    start_new_session=True,
                    preexec_fn=sigint_as_in_a_terminal,
                )
        self.pid = self.popen.pid
        # The session id equals the pid (start_new_session); the DHT process and p2pd inherit it.
        self.sid = self.pid
        self.expected_alive = True  # False once a test stops it on purpose: its exit is not a failure then
        self.seen_members: dict[int, psutil.Process] = {}

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def members(self) -> list[psutil.Process]:
        """The live processes of this session, also remembered so that `leftovers` can check them later."""
        members = session_members(self.sid)
        for proc in members:
            self.seen_members.setdefault(proc.pid, proc)
        return members

    def leftovers(self) -> list[psutil.Process]:
        """Processes of this session still alive, including any seen earlier (even if they changed session)."""
        current = {proc.pid: proc for proc in session_members(self.sid)}
        for pid, proc in self.seen_members.items():
            try:
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    current.setdefault(pid, proc)
            except psutil.Error:
                continue
        return list(current.values())

    def signal_group(self, sig: int) -> None:
        self.members()  # remember the children before they may be re-parented or vanish
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            pass
        for proc in self.leftovers():  # anything that left our group (setsid/setpgid) still gets the signal
            try:
                if os.getpgid(proc.pid) != self.pid:
                    proc.send_signal(sig)
            except (ProcessLookupError, psutil.Error):
                continue

    def wait_gone(self, timeout_s: float) -> list[psutil.Process]:
        """Wait until the main process has exited and nothing of its session is left; return what is left."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.popen.poll()  # reap our direct child so it does not linger as a zombie
            left = self.leftovers()
            if not left and self.popen.returncode is not None:
                return []
            if time.monotonic() >= deadline:
                show_stacks([self])  # where it is stuck, into its stderr for the test's report
                return left
            time.sleep(0.1)

    def logs(self) -> str:
        status = "running" if self.alive() else f"exited with {self.returncode}"
        return (
            f"===== {self.name} (pid {self.pid}, {status}): {' '.join(self.args)}\n"
            f"----- stdout ({self.stdout_path})\n{_tail(self.stdout_path)}\n"
            f"----- stderr ({self.stderr_path})\n{_tail(self.stderr_path)}\n"
        )


class BootstrapProcess(ManagedProcess):
    maddrs: list[str]


class PeerProcess(ManagedProcess):
    model_path: Path
    cache_dir: Path


class Swarm:
    """Bootstrap and peer processes on 127.0.0.1, a client-mode DHT to watch them, and guaranteed cleanup."""

    def __init__(self, workdir: str | Path, swarm_key=None):
        self.workdir = Path(workdir)
        self.swarm_key = swarm_key  # a private swarm's SwarmKey, for the watching DHT node
        self.log_dir = self.workdir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = child_env(self.workdir / "swarmlm-cache")
        self.processes: list[ManagedProcess] = []
        self.bootstrap: BootstrapProcess | None = None
        self.initial_peers: list[str] = []
        self._dht = None
        self._dht_members: list[psutil.Process] = []
        self._names: dict[str, int] = {}
        self._closed = False
        self.needed_sigkill: list[str] = []  # names of processes that ignored SIGTERM at close()

    # lifecycle

    def __enter__(self) -> Swarm:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close(check=exc_info[0] is None)

    def close(self, *, check: bool = True) -> None:
        """Stop every process group (SIGTERM, then SIGKILL), stop the watching DHT, and make sure nothing is left.

        Raises:
            LeftoverProcessError: (when `check`) something of ours survived SIGKILL.
        """
        if self._closed:
            return
        self._closed = True
        problems = []
        if self._dht is not None:
            problems += self._shutdown_dht()
        running = [proc for proc in self.processes if proc.leftovers() or proc.alive()]
        for proc in reversed(running):  # peers before the bootstrap node, so they can still announce OFFLINE
            proc.expected_alive = False
            if proc.alive():
                proc.popen.send_signal(signal.SIGTERM)  # as an operator would: the process then stops its children
            else:
                proc.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in running:
            left = proc.wait_gone(max(0.0, deadline - time.monotonic()))
            if left:
                self.needed_sigkill.append(proc.name)
                print(
                    f"swarm: {proc.name} was still running {STOP_TIMEOUT_S} s after SIGTERM; "
                    f"sending SIGKILL to:\n{describe(left, threads=True)}",
                    file=sys.stderr,
                )
                proc.signal_group(signal.SIGKILL)
        for proc in running:
            left = proc.wait_gone(KILL_TIMEOUT_S)
            if left:
                problems.append(f"{proc.name} left processes behind after SIGKILL:\n{describe(left)}")
        if problems and check:
            raise LeftoverProcessError("\n".join(problems) + "\n" + self.format_logs())

    def _shutdown_dht(self) -> list[str]:
        dht, self._dht = self._dht, None
        try:
            dht.shutdown()
        except Exception as exc:  # still reap its processes below
            print(f"watching DHT shutdown failed: {exc!r}", file=sys.stderr)
        _gone, alive = psutil.wait_procs(self._dht_members, timeout=KILL_TIMEOUT_S)
        for proc in alive:
            try:
                proc.kill()
            except psutil.Error:
                pass
        if alive:
            return [f"the watching DHT left processes behind after shutdown():\n{describe(alive)}"]
        return []

    # starting processes

    def spawn(self, name: str, *args: str, netns: str | None = None) -> ManagedProcess:
        """Start `swarmlm ARGS...` as a managed process named `name` (numbered if the name was used), inside the
        network namespace `netns` if given (forked into it, or run by `ip netns exec`, which keeps the pid: signals
        reach swarmlm itself)."""
        return self._spawn(ManagedProcess, name, list(args), netns)

    def _spawn(
        self, cls: type[T], name: str, args: list[str], netns: str | None = None, command: Sequence[str] | None = None
    ) -> T:
        assert not self._closed, "this swarm was closed"
        count = self._names.get(name, 0)
        self._names[name] = count + 1
        unique = name if count == 0 else f"{name}-{count}"
        prefix = ["ip", "netns", "exec", netns] if netns else []
        zygote = launcher(self.env) if command is None else None
        proc = cls(
            unique, prefix + list(command or swarmlm_command()) + args, self.log_dir, self.env, zygote, args, netns
        )
        self.processes.append(proc)
        return proc

    def start_script(self, name: str, script: str | Path, *args: str) -> ManagedProcess:
        """Start `python SCRIPT ARGS...` (a test's own program, e.g. tests/helpers/trainer.py) as a managed process."""
        return self._spawn(ManagedProcess, name, list(args), command=[sys.executable, str(script)])

    def start_bootstrap(self, *extra_args: str, timeout_s: float = 60.0, netns: str | None = None) -> list[str]:
        """Start `swarmlm bootstrap EXTRA...`, wait for the multiaddrs it prints, and make them the initial peers."""
        proc = self._spawn(BootstrapProcess, "bootstrap", ["bootstrap", *extra_args], netns)

        def printed_maddrs() -> list[str] | None:
            lines = proc.stdout().splitlines()
            if not any(line.startswith("--initial-peers ") for line in lines):
                return None  # the multiaddr lines come first; the --initial-peers line ends the announcement
            return [line.strip() for line in lines if line.startswith("/ip4/")]

        proc.maddrs = self.wait_for(printed_maddrs, timeout_s, f"{proc.name} to print its multiaddrs", watch=[proc])
        assert proc.maddrs, f"{proc.name} printed no /ip4/ multiaddrs\n{proc.logs()}"
        self.bootstrap = proc
        self.initial_peers = proc.maddrs
        return proc.maddrs

    def start_peer(
        self, model_path: str | Path, *extra_args: str, netns: str | None = None, command: Sequence[str] | None = None
    ) -> PeerProcess:
        """Start `swarmlm peer MODEL --initial-peers ... --throughput 1000 --update-period-s 5 --cache-dir ... EXTRA...`.

        `command` replaces `swarmlm` (a test's own launcher that takes the same arguments, e.g. tests/helpers/liar.py).
        """
        assert self.initial_peers, "start_bootstrap() first"
        count = self._names.get("peer", 0)
        cache_dir = self.workdir / f"peer-cache-{count}"
        cache_dir.mkdir(parents=True, exist_ok=True)
        args = [
            "peer",
            str(model_path),
            "--initial-peers",
            *self.initial_peers,
            "--throughput",
            "1000",
            "--update-period-s",
            "5",
            "--cache-dir",
            str(cache_dir),
            *extra_args,
        ]
        proc = self._spawn(PeerProcess, "peer", args, netns, command)
        proc.model_path, proc.cache_dir = Path(model_path), cache_dir
        return proc

    def run(self, *args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
        """Run `swarmlm ARGS...` to completion (bounded), returning its exit code and output; nothing is left."""
        name = args[0].lstrip("-") if args else "swarmlm"
        return self.finish(self.spawn(name or "swarmlm", *args), timeout_s)

    def finish(self, proc: ManagedProcess, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
        """Wait (bounded) for a spawned command to exit; its exit code and output. Nothing of it may be left."""
        args = proc.args
        try:
            proc.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.expected_alive = False
            proc.signal_group(signal.SIGKILL)
            proc.wait_gone(KILL_TIMEOUT_S)
            raise TimeoutError(f"`{' '.join(args)}` ran over {timeout_s} s\n{proc.logs()}") from None
        proc.expected_alive = False
        left = proc.wait_gone(5.0)
        if left:
            raise LeftoverProcessError(f"`{' '.join(args)}` exited but left:\n{describe(left)}\n{proc.logs()}")
        return subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout(), proc.stderr())

    # stopping processes

    def kill(self, proc: ManagedProcess, sig: int = signal.SIGKILL, *, group: bool = True) -> None:
        """Send `sig` to the process's whole group (its DHT process and p2pd too), or with group=False to it alone.

        SIGKILL to the group is a machine dying; SIGTERM to the process alone is an operator stopping it.
        """
        proc.expected_alive = False
        if group:
            proc.signal_group(sig)
        else:
            proc.members()
            proc.popen.send_signal(sig)

    def signal_process_group(self, proc: ManagedProcess, sig: int) -> None:
        """Send `sig` to the process group the process leads, and to nothing else, as `kill -SIG -PGID` does.

        A terminal's Ctrl+C does the same with SIGINT. Unlike `kill`, children that moved to a group of their own
        (a peer's DHT process and its p2pd do) are not signalled.
        """
        proc.expected_alive = False
        proc.members()  # remembered, so that `wait_gone` still checks them
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass

    def terminate(self, proc: ManagedProcess, timeout_s: float = 30.0, sig: int = signal.SIGTERM) -> int:
        """Send `sig` to the process alone and wait until it and everything it spawned are gone; its exit code.

        Raises:
            TimeoutError: it did not exit in time, or left processes behind (they are then killed).
        """
        self.kill(proc, sig, group=False)
        left = proc.wait_gone(timeout_s)
        if left:
            still_running = proc.alive()
            seen = describe(left, threads=True)  # before the SIGKILL that ends them
            proc.signal_group(signal.SIGKILL)
            proc.wait_gone(KILL_TIMEOUT_S)
            what = "did not exit" if still_running else "exited but left processes behind"
            raise TimeoutError(f"{proc.name} {what} within {timeout_s} s of signal {sig}:\n{seen}\n{proc.logs()}")
        return proc.returncode

    # watching the swarm

    @property
    def dht(self):
        """A client-mode DHT node joined through the bootstrap, started on first use."""
        if self._dht is None:
            from swarm.dht.node import start_dht

            assert self.initial_peers, "start_bootstrap() first"
            self._dht = start_dht(self.initial_peers, client_mode=True, swarm_key=self.swarm_key)
            # hivemind runs the node in a forked process that spawns p2pd: remember them to reap them
            self._dht_members = [psutil.Process(self._dht.pid)]
            self._dht_members += self._dht_members[0].children(recursive=True)
        return self._dht

    def snapshot(self, prefix: str, num_blocks: int | None = None):
        """The current SwarmSnapshot of a model; `num_blocks` from the model index when not given (None if absent)."""
        from swarm.dht.directory import fetch_models, fetch_snapshot

        if num_blocks is None:
            record = fetch_models(self.dht).get(prefix)
            if record is None:
                return None
            num_blocks = record.num_blocks
        return fetch_snapshot(self.dht, prefix, num_blocks)

    def wait_online(self, prefix: str, expected_spans: Sequence[tuple[int, int]], timeout_s: float = 60.0):
        """Poll the DHT until, for each span, some peer announces exactly that span as ONLINE; the snapshot.

        Fails early, with logs, if a peer that should be running has exited.
        """
        wanted = [tuple(span) for span in expected_spans]

        def all_online():
            snapshot = self.snapshot(prefix)
            if snapshot is None:
                return None
            spans = {(info.start_block, info.end_block) for info in snapshot.online().values()}
            return snapshot if all(span in spans for span in wanted) else None

        return self.wait_for(all_online, timeout_s, f"spans {wanted} of {prefix!r} to be ONLINE", poll_s=0.5)

    def wait_for(
        self,
        probe: Callable[[], T | None],
        timeout_s: float,
        what: str,
        *,
        poll_s: float = 0.2,
        watch: Sequence[ManagedProcess] | None = None,
    ) -> T:
        """Call `probe` until it returns something truthy; fail with every process's logs on timeout.

        Args:
            watch: processes whose exit fails the wait at once (default: all that should be running).
        """
        deadline = time.monotonic() + timeout_s
        last_error: Exception | None = None
        while True:
            try:
                result = probe()
                if result:
                    return result
            except Exception as exc:  # a DHT read may fail while the swarm is still forming
                last_error = exc
            watched = watch if watch is not None else [p for p in self.processes if p.expected_alive]
            dead = [p for p in watched if not p.alive()]
            if dead:
                names = ", ".join(f"{p.name} (exit {p.returncode})" for p in dead)
                raise AssertionError(f"while waiting for {what}: {names} exited\n{self.format_logs()}")
            if time.monotonic() >= deadline:
                detail = f"; last probe error: {last_error!r}" if last_error else ""
                show_stacks(watched)
                raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}{detail}\n{self.format_logs()}")
            time.sleep(poll_s)

    def format_logs(self) -> str:
        """The tail of every process's stdout and stderr."""
        if not self.processes:
            return "(no processes were started)"
        return "\n".join(proc.logs() for proc in self.processes)


class DescendantWatch:
    """Remembers every descendant of a process, polling in a background thread, and reaps them at the end.

    A child that started its own session is re-parented when its parent dies, so it can no longer be found from
    the parent then: hence the polling while the parent runs. At the end, processes in the sessions of those
    seen count too (a DHT process or p2pd started after the last poll).
    """

    def __init__(self, root_pid: int, poll_s: float = 0.2):
        self.root_pid = root_pid
        self.poll_s = poll_s
        self.seen: dict[int, psutil.Process] = {}
        self.cmdlines: dict[int, str] = {}  # pid -> command line, as last read while the process ran
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"watch-{root_pid}", daemon=True)

    def start(self) -> DescendantWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.poll()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll()

    def poll(self) -> None:
        try:
            children = psutil.Process(self.root_pid).children(recursive=True)
        except psutil.Error:
            return
        for proc in children:
            try:
                cmdline = " ".join(proc.cmdline())
            except psutil.Error:
                cmdline = None
            with self._lock:
                self.seen.setdefault(proc.pid, proc)
                if cmdline:  # read each time: a child seen between fork and exec still shows its parent's
                    self.cmdlines[proc.pid] = cmdline

    def alive(self) -> list[psutil.Process]:
        """Seen processes still running (not zombies), and any process in a session that one of them leads."""
        ours = os.getsid(0)
        with self._lock:
            found = dict(self.seen)
        sessions = set()
        for proc in found.values():
            try:
                sid = os.getsid(proc.pid)
            except OSError:
                continue
            if sid != ours and sid == proc.pid:
                sessions.add(sid)
        for sid in sessions:
            for proc in session_members(sid):
                found.setdefault(proc.pid, proc)
        alive = []
        for proc in found.values():
            try:
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc)
            except psutil.Error:
                continue
        return alive

    def kill_all(self) -> list[psutil.Process]:
        """SIGKILL whatever is left; return what survived that (nothing, normally)."""
        for proc in self.alive():
            try:
                proc.kill()
            except psutil.Error:
                continue
        deadline = time.monotonic() + KILL_TIMEOUT_S
        while (left := self.alive()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return left


@contextmanager
def reaping_descendants(
    popen: subprocess.Popen, *, grace_s: float = 15.0, exempt: Sequence[str] = ("torch_shm_manager",)
) -> Iterator[DescendantWatch]:
    """Watch `popen`'s descendants while the block runs; afterwards nothing of them may be left running.

    On leaving the block `popen` itself is SIGKILLed if still running. If the block succeeded, its descendants
    get `grace_s` to be gone, and any that are not fail it (`exempt` names exit by themselves and are only
    killed: torch's shared-memory manager is torch's to stop). Whatever happened, what is left is SIGKILLed and
    must then be gone.

    Raises:
        LeftoverProcessError: descendants outlived the grace period, or survived SIGKILL.
    """
    watch = DescendantWatch(popen.pid).start()
    failed = True
    try:
        yield watch
        failed = False
    finally:
        watch.poll()  # before the root dies: its children are still its children
        if popen.poll() is None:
            popen.kill()
        popen.wait()
        watch.stop()
        outlived: list[psutil.Process] = []
        if not failed:
            deadline = time.monotonic() + grace_s
            while (outlived := [p for p in watch.alive() if _name(p) not in exempt]) and time.monotonic() < deadline:
                time.sleep(0.2)
            outlived_text = describe(outlived)  # while they still run
        survivors = watch.kill_all()
        if survivors:
            raise LeftoverProcessError(f"still running after SIGKILL:\n{describe(survivors)}")
        if outlived:
            raise LeftoverProcessError(f"still running {grace_s} s after {popen.args[:2]} ended:\n{outlived_text}")


def _name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.Error:
        return "?"
