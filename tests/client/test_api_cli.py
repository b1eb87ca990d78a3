"""`swarmlm api` as a newcomer meets it: help, wrong flags and files said at once, before anything heavy loads."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEAVY = "sorted({'torch', 'transformers', 'hivemind', 'grpc', 'fastapi'} & set(sys.modules))"


def _run_cli(argv: list[str]) -> tuple[str, str]:
    """(what `run` exited or printed with, the heavy modules imported by then)."""
    code = (
        f"import sys, client.api.cli as m\ntry:\n    print(m.run(m.build_parser('x').parse_args({argv!r})))\n"
        f"except SystemExit as exc:\n    print(exc)\nprint({HEAVY})"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    message, heavy = result.stdout.strip().rsplit("\n", 1)
    return message, heavy


def test_the_command_is_listed_and_has_help():
    listed = subprocess.run(
        [sys.executable, "-m", "swarm.cli", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert "  api " in listed.stdout
    helped = subprocess.run(
        [sys.executable, "-m", "swarm.cli", "api", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert helped.returncode == 0 and "--max-concurrency" in helped.stdout and "--api-key" in helped.stdout


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--port", "70000"], "--port must lie in 0..65535"),
        (["--max-concurrency", "0"], "--max-concurrency: max_concurrency must be >= 1, got 0"),
        (["--max-queued", "-1"], "--max-queued: max_queued must be >= 0"),
        (["--wait-for-peers-s", "-2"], "--wait-for-peers-s must be >= 0"),
        (["--speculative", "/no/such/model"], "--speculative takes ngram or a local model's folder"),
        (["--speculative", "ngram", "--draft-tokens", "0"], "--draft-tokens must be >= 1, got 0"),
        (["--adapters", "poems", "poems"], "--adapters: 'poems' must be a distinct name"),
        (["--adapters", "po/ems"], "--adapters: 'po/ems' must be a distinct name"),
        (["--adapters", "law=/no/such/folder"], "--adapters law=/no/such/folder: no such folder"),
    ],
)
def test_bad_flags_are_refused_before_anything_heavy(flags, words):
    message, heavy = _run_cli(["model", "--initial-peers", "/ip4/127.0.0.1/tcp/1", *flags])
    assert words in message
    assert heavy == "[]"


def test_a_bad_swarm_key_file_is_refused_before_anything_heavy(tmp_path):
    bad = tmp_path / "swarm.key"
    bad.write_text("not a key\n")
    message, heavy = _run_cli(["model", "--initial-peers", "/ip4/127.0.0.1/tcp/1", "--swarm-key", str(bad)])
    assert f"swarm key file {bad} does not hold a swarm key" in message
    assert heavy == "[]"


def test_a_port_in_use_and_a_missing_model_are_said_plainly(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        message, _ = _run_cli(["model", "--initial-peers", "/ip4/127.0.0.1/tcp/1", "--port", str(port)])
    assert f"cannot listen on 127.0.0.1:{port}" in message and "--port" in message
    message, heavy = _run_cli([str(tmp_path / "nothing"), "--initial-peers", "/ip4/127.0.0.1/tcp/1", "--port", "0"])
    assert f"model folder '{tmp_path / 'nothing'}' does not exist" in message and heavy == "[]"
