"""`swarmlm demo`, the newcomer's first command: it chats, prints the route, and leaves no process behind."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

SWARMLM = str(Path(sys.executable).with_name("swarmlm"))


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [SWARMLM, "demo", "--max-new-tokens", "8", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as in a terminal
    )


def _descendants(proc: subprocess.Popen) -> list[psutil.Process]:
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _assert_all_gone(processes: list[psutil.Process], timeout_s: float = 15.0) -> None:
    # torch's shared-memory manager is not ours to stop: it exits by itself once its clients are gone
    ours = [p for p in processes if _name(p) != "torch_shm_manager"]
    gone, alive = psutil.wait_procs(ours, timeout=timeout_s)
    for leftover in alive:
        leftover.kill()
    assert not alive, f"left running: {[(p.pid, _name(p)) for p in alive]}"


def _name(process: psutil.Process) -> str:
    try:
        return process.name()
    except psutil.NoSuchProcess:
        return "?"


def test_demo_chats_and_stops_everything():
    demo = _start()
    seen: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 280
        while demo.poll() is None and time.monotonic() < deadline:
            seen += [p for p in _descendants(demo) if p not in seen]
            time.sleep(0.5)
        output = demo.communicate(timeout=30)[0]
    finally:
        demo.kill()
    assert demo.returncode == 0, output
    assert "assistant:" in output and "route:" in output, output
    assert output.count("-> peer ") == 3, output
    assert "tokens/s" in output and "all processes stopped" in output
    _assert_all_gone(seen)


def test_ctrl_c_during_startup_stops_everything():
    demo = _start()
    seen: list[psutil.Process] = []
    lines = []
    try:
        for line in demo.stdout:  # wait until the peers are being started, then press Ctrl+C
            lines.append(line)
            seen += [p for p in _descendants(demo) if p not in seen]
            if line.startswith("peer 2:"):
                break
        seen += [p for p in _descendants(demo) if p not in seen]
        demo.send_signal(signal.SIGINT)
        rest = demo.communicate(timeout=60)[0]
    finally:
        demo.kill()
    assert any(line.startswith("peer 2:") for line in lines), "".join(lines)
    assert demo.returncode == 130, "".join(lines) + rest
    assert "all processes stopped" in rest
    _assert_all_gone(seen)
