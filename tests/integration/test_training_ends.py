"""A family whose ends differ from Llama's (Phi: a LayerNorm with a bias named `final_layernorm`, and a head with a
bias) trains end to end, as `swarmlm train --local` does.

The trainer holds the final norm and the head, so their biases are trained, saved, resumed from and exported with the
embeddings (client/model.py `local_tensors`). One training peer serves every block; `swarmlm train` runs two steps with
`--save`, then one more resumed from that save, and `swarmlm export` writes the whole model: it equals the local run's
three steps, biases included.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from protocol.records import prefix_for_model
from tests.helpers.models import _common, save_random_model
from tests.helpers.processes import Swarm
from tests.helpers.tokenizer import save_char_tokenizer

pytestmark = pytest.mark.timeout(400)

FLAGS = ["--lr", "3e-3", "--seq-len", "16", "--batch-size", "4", "--micro-batch-size", "2", "--seed", "0",
         "--no-progress", "--matchmaking-time-s", "1", "--averaging-timeout-s", "15"]  # fmt: skip


def test_a_layernorm_family_trains_saves_resumes_and_exports_like_local(tmp_path):
    config = AutoConfig.for_model("phi", **_common(4), layer_norm_eps=1e-5, partial_rotary_factor=0.5)
    path = save_char_tokenizer(save_random_model(config, tmp_path / "phi", seed=0))
    with Swarm(tmp_path / "swarm") as swarm:
        local = swarm.spawn(
            "train-local", "train", str(path), "--local", "--steps", "3", *FLAGS, "--save", str(tmp_path / "local")
        )
        swarm.start_bootstrap()
        swarm.start_peer(path, "--blocks", "0:4", "--train", "--run-id", "ln", "--lr", "3e-3",
                         "--target-batch-size", "4", "--matchmaking-time-s", "1")  # fmt: skip
        swarm.wait_online(prefix_for_model(str(path)), [(0, 4)], timeout_s=120)
        train = ["train", str(path), "--initial-peers", *swarm.initial_peers, "--run-id", "ln", *FLAGS]
        for steps in ("2", "1"):  # the second run resumes from the first one's save: one more step
            done = swarm.run(*train, "--steps", steps, "--save", str(tmp_path / "trainer"), timeout_s=200)
            assert done.returncode == 0, done.stderr[-3000:]
        exported = swarm.run(
            "export", str(path), "--initial-peers", *swarm.initial_peers, "--run-id", "ln",
            "--trainer-dir", str(tmp_path / "trainer"), "--out", str(tmp_path / "exported"), timeout_s=120,
        )  # fmt: skip
        assert exported.returncode == 0, exported.stderr[-3000:]
        local = swarm.finish(local, timeout_s=200)
        assert local.returncode == 0, local.stderr[-3000:]

    mine = load_file(tmp_path / "exported" / "model.safetensors")
    reference = load_file(tmp_path / "local" / "model.safetensors")
    initial = load_file(path / "model.safetensors")
    assert set(mine) == set(reference) and {"model.final_layernorm.bias", "lm_head.bias"} <= set(mine)
    for name, tensor in reference.items():
        torch.testing.assert_close(mine[name], tensor, atol=1e-4, rtol=0, msg=name)
    for name in ("model.final_layernorm.bias", "lm_head.bias"):  # the biases trained
        assert not torch.equal(reference[name], initial[name]), name
