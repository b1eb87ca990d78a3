"""`swarmlm demo --api`: the demo swarm with the API server and the monitor on it, serving until Ctrl+C, then nothing left.

A tiny random Llama with the character tokenizer stands in for the built-in model, split over two peers.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.helpers.models import make_tiny_llama
from tests.helpers.processes import child_env, reaping_descendants, sigint_as_in_a_terminal
from tests.helpers.tokenizer import save_char_tokenizer

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 120  # a bootstrap, two peers, the API and the monitor on a shared machine


def _get_json(url: str):
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200, url
        return json.loads(response.read())


def _lines(stream) -> queue.Queue:
    lines: queue.Queue = queue.Queue()

    def read():
        for line in stream:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return lines


def _read_until(lines: queue.Queue, marker: str, timeout_s: float) -> list[str]:
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            raise AssertionError(f"the demo ended before {marker!r}:\n{''.join(seen)}")
        seen.append(line)
        if marker in line:
            return seen
    raise AssertionError(f"no {marker!r} within {timeout_s}s:\n{''.join(seen)}")


def test_demo_api_serves_the_api_and_the_monitor_until_ctrl_c(tmp_path):
    model = make_tiny_llama(tmp_path / "tiny-llama", num_layers=4)
    save_char_tokenizer(model)
    env = {**child_env(tmp_path / "cache"), "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    demo = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "swarm.cli",
            "demo",
            "--api",
            "--model",
            str(model),
            "--peers",
            "2",
            "--port",
            "0",
            "--monitor-port",
            "0",
            "--cache-dir",
            str(tmp_path / "cache"),
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=sigint_as_in_a_terminal,
    )
    with reaping_descendants(demo) as watch:  # nothing it started may outlive it, also if this test fails
        lines = _lines(demo.stdout)
        output = "".join(_read_until(lines, "running until Ctrl+C", READY_TIMEOUT_S))
        api_url = next(line.split()[1] for line in output.splitlines() if line.startswith("API:"))
        monitor_url = next(line.split()[1] for line in output.splitlines() if line.startswith("monitor:"))
        assert "curl " + api_url + "/chat/completions" in output, output

        assert _get_json(api_url.removesuffix("/v1") + "/health")
        models = _get_json(api_url + "/models")
        assert [m["id"] for m in models["data"]] and models["object"] == "list", models
        state = _get_json(monitor_url + "api/state")
        assert isinstance(state, dict), state
        watch.poll()
        started = set(watch.cmdlines.values())
        for role in (" swarm.cli bootstrap", " swarm.cli peer ", " swarm.cli api ", " swarm.cli monitor "):
            assert any(role in cmdline for cmdline in started), (role, started)

        demo.send_signal(signal.SIGINT)
        rest = demo.wait(timeout=60)
        tail = []
        while (line := lines.get(timeout=10)) is not None:
            tail.append(line)
    assert rest == 0, output + "".join(tail)
    assert "all processes stopped" in "".join(tail), "".join(tail)
