"""A slow link for bench runs: a Linux network namespace whose loopback (at an Ethernet MTU) passes every packet of
the processes inside through one qdisc, so they all share it. The namespace is removed also on failure."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path


class SlowLinkError(RuntimeError):
    """The namespace could not be built, or the runs inside it failed."""


def tbf(rate_mbit: float) -> list[str]:
    """A rate limit alone."""
    return ["tbf", "rate", f"{rate_mbit:g}mbit", "burst", "128kb", "latency", "100ms"]


def run_inside(module: str, args: list[str], qdisc: list[str], *, timeout_s: float) -> dict:
    """Run `python -m module *args --inside FILE` in a fresh namespace whose loopback uses `qdisc`; returns the JSON
    the run wrote to FILE. Needs root, `ip netns` and `tc`."""
    if os.geteuid() != 0:
        raise SlowLinkError("the slow link's namespace needs root (ip netns, tc)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # unwind: the namespace is removed below
    namespace = f"swarmlm-slow-{os.getpid()}"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "figures.json"
        try:
            _run(["ip", "netns", "add", namespace])
            # an Ethernet MTU: tbf drops a packet larger than its bucket, and loopback's are 64 KiB
            _run(["ip", "netns", "exec", namespace, "ip", "link", "set", "lo", "mtu", "1500", "up"])
            _run(["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", "lo", "root", *qdisc])
            inner = [sys.executable, "-m", module, *args, "--inside", str(out)]
            child = subprocess.Popen(["ip", "netns", "exec", namespace, *inner], start_new_session=True)
            try:
                child.wait(timeout=timeout_s)
            finally:
                if child.poll() is None:
                    os.killpg(child.pid, signal.SIGTERM)
                    child.wait(timeout=60)
            if child.returncode != 0:
                raise SlowLinkError(f"the runs inside the namespace failed (exit {child.returncode})")
            return json.loads(out.read_text())
        except (subprocess.CalledProcessError, FileNotFoundError) as exc:
            detail = (getattr(exc, "stderr", None) or "").strip()
            raise SlowLinkError(f"could not set up the slow link's namespace: {exc} {detail}".strip()) from exc
        finally:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)


def _run(command: list[str]) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=30)
