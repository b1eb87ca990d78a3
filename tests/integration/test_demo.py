"""`swarmlm demo`: it chats over 3 peers, answers exactly what the local model answers, and leaves no process behind.

Both tests share one swarmlm cache under tmp: the first demo converts the built-in model's GGUF file into it,
and the reference answer is computed with transformers from that converted folder.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from swarm.models.default_model import DEFAULT_MODEL
from tests.helpers.processes import reaping_descendants, sigint_as_in_a_terminal

pytestmark = pytest.mark.timeout(480)

SWARMLM = str(Path(sys.executable).with_name("swarmlm"))
PROMPT = "What is the capital of France? Answer in one sentence."
MAX_NEW_TOKENS = 8
DEMO_TIMEOUT_S = 400  # converting the model, starting 3 peers on a shared 2-core machine, then 8 tokens


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("swarmlm-cache")


def _start(cache_dir: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [SWARMLM, "demo", "--max-new-tokens", str(MAX_NEW_TOKENS), "--prompt", PROMPT, "--cache-dir", str(cache_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=sigint_as_in_a_terminal,
    )


def _peers(watch) -> set[str]:
    """The peers the demo started, by command line (each peer's DHT process, forked from it, shows the same)."""
    return {cmdline for cmdline in watch.cmdlines.values() if " swarm.cli peer " in cmdline}


def _local_answer(model_dir: Path) -> str:
    """What the local Hugging Face model answers, prompted and decoded as the demo does (greedy)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    input_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    with torch.no_grad():
        output = model.generate(input_ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    return tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True)


def test_demo_chats_like_the_local_model_and_stops_everything(cache_dir):
    demo = _start(cache_dir)
    with reaping_descendants(demo) as watch:  # nothing it started may outlive it, also if this test fails
        output = demo.communicate(timeout=DEMO_TIMEOUT_S)[0]
    assert demo.returncode == 0, output
    assert len(_peers(watch)) == 3, (watch.cmdlines, output)
    assert "route:" in output and output.count("-> peer ") == 3, output
    assert "tokens/s" in output and "all processes stopped" in output, output

    # the streamed answer ends with a newline, then a blank line comes before the route
    assert f"user: {PROMPT}\nassistant: " in output and "\n\nroute:\n" in output, output
    answer = output.split(f"user: {PROMPT}\nassistant: ", 1)[1].split("\n\nroute:\n", 1)[0]
    expected = _local_answer(cache_dir / "models" / DEFAULT_MODEL)  # the folder the demo converted
    assert expected.strip(), "the local model gave an empty answer: nothing to compare"
    assert answer == expected, (answer, expected)


def test_ctrl_c_during_startup_stops_everything(cache_dir):
    demo = _start(cache_dir)
    lines = []
    with reaping_descendants(demo) as watch:
        for line in demo.stdout:  # wait until the peers are being started, then press Ctrl+C
            lines.append(line)
            if line.startswith("peer 2:"):
                break
        watch.poll()
        assert len(_peers(watch)) == 3, (watch.cmdlines, "".join(lines))
        demo.send_signal(signal.SIGINT)
        # the demo gives its children 10 s to stop; the rest is slack for a loaded 2-core machine
        rest = demo.communicate(timeout=120)[0]
    assert demo.returncode == 130, "".join(lines) + rest
    assert "all processes stopped" in rest, rest
