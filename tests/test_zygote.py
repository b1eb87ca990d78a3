"""The tests' zygote (tests/helpers/zygote.py): a forked command behaves as the same command exec'd would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest

from tests.helpers import zygote
from tests.helpers.processes import Swarm


def test_a_forked_command_has_its_own_session_output_exit_code_and_environment(tmp_path):
    with Swarm(tmp_path / "swarm") as swarm:
        assert zygote.launcher(swarm.env) is not None, "the suite is meant to fork its commands here"
        usage = swarm.run("--help")
        assert usage.returncode == 0 and "usage: swarmlm COMMAND" in usage.stdout
        wrong = swarm.run("no-such-command")
        assert wrong.returncode == 2 and "unknown command 'no-such-command'" in wrong.stderr

        swarm.start_bootstrap()
        bootstrap = swarm.bootstrap
        process = psutil.Process(bootstrap.pid)
        assert process.ppid() == zygote.launcher(swarm.env).proc.pid  # forked, not exec'd
        assert os.getsid(bootstrap.pid) == bootstrap.pid
        assert "--initial-peers" in bootstrap.stdout()  # printed to its own file
        # logged just after the multiaddrs are printed: under load, a moment later
        swarm.wait_for(lambda: "INFO swarm.bootstrap" in bootstrap.stderr(), 30, "the bootstrap's log line")

        swarm.env["SWARMLM_LOG_LEVEL"] = "WARNING"  # the environment each command is given is the one it sees
        quiet = swarm.spawn("quiet-bootstrap", "bootstrap")
        swarm.wait_for(lambda: "--initial-peers" in quiet.stdout(), 60, "the second bootstrap to start")
        assert "INFO" not in quiet.stderr(), quiet.logs()

        assert swarm.terminate(bootstrap, timeout_s=30, sig=signal.SIGTERM) == 0, bootstrap.logs()
        assert not bootstrap.alive() and bootstrap.popen.wait(1) == 0


def test_a_forked_command_killed_by_a_signal_reports_it(tmp_path):
    with Swarm(tmp_path / "swarm") as swarm:
        swarm.start_bootstrap()
        swarm.kill(swarm.bootstrap, signal.SIGKILL)
        assert swarm.bootstrap.popen.wait(30) == -signal.SIGKILL


def test_fork_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("SWARMLM_TEST_FORK", "0")
    assert zygote.launcher({}) is None


def test_a_zygote_with_threads_is_refused_and_commands_are_execd(monkeypatch):
    """Forking a process that runs threads can deadlock the child: such a zygote is stopped, with a warning."""
    monkeypatch.setattr(zygote, "_zygote", None)
    monkeypatch.setattr(zygote, "_failed", False)
    env = dict(os.environ, OMP_NUM_THREADS="2", OPENBLAS_NUM_THREADS="2")  # BLAS starts its thread pools
    with pytest.warns(UserWarning, match=r"exec every command.*threads: [2-9]"):
        assert zygote.launcher(env) is None
    assert zygote.launcher(env) is None


def test_a_forked_process_that_keeps_a_wait_waiting_shows_its_stacks(tmp_path):
    with Swarm(tmp_path / "swarm") as swarm:
        swarm.start_bootstrap()
        with pytest.raises(TimeoutError) as waited:
            swarm.wait_for(lambda: False, 0.5, "something that never comes")
        assert "most recent call first" in str(waited.value) and "swarm/bootstrap.py" in str(waited.value)
        assert swarm.bootstrap.alive()


LOCK_HELD_BY_A_SIBLING = """
import os, signal, sys
from hivemind.utils.mpfuture import MPFuture, SharedBytes
from tests.helpers import zygote

SharedBytes._lock.acquire()  # as a sibling that was SIGKILLed inside it leaves it
pid = os.fork()
if pid == 0:
    zygote.become({"argv": [], "env": dict(os.environ), "cwd": os.getcwd(), "stdout": sys.argv[1], "stderr": sys.argv[1]})
    signal.alarm(20)  # stuck on the lock: killed by SIGALRM
    MPFuture()
    os._exit(0)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_a_forked_command_has_hiveminds_process_wide_locks_to_itself(tmp_path):
    """hivemind's futures take process-wide multiprocessing locks, which a fork shares with the zygote and every
    sibling: a sibling killed while it held one (tests SIGKILL peers) must not leave the next command waiting forever."""
    done = subprocess.run(
        [sys.executable, "-c", LOCK_HELD_BY_A_SIBLING, str(tmp_path / "child.log")],
        cwd=zygote.REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:], (tmp_path / "child.log").read_text()[-3000:])
