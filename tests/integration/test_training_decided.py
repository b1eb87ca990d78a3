"""A stage whose Apply never came applies the update its trainer decided, exactly.

The trainer (a process of its own) sends Apply to every stage at once; stage 2:4's peer sits behind a proxy
(tests/helpers/liar.py) that withholds Apply calls when told. The trainer's record holds its decision (each stage's
round and the clipping factor), stored before its first Apply.

- The trainer's second step: 2:4's Apply is lost (withheld past the trainer's round timeout). The trainer goes on
  without it, and 2:4 applies its round as decided once the trainer's record shows the next update.
- Its fourth step: stage 0:2 applies the update, and the trainer is SIGKILLed while 2:4's Apply is withheld. Once
  the trainer's record has lapsed, 2:4 applies its round as decided, instead of dropping it and staying one update
  behind 0:2 for good.

After each, both stages equal the local reference, the clipping included, and the run goes on.
"""

from __future__ import annotations

import json
import re
import signal
import sys
from pathlib import Path

import pytest
import torch

from client import AutoDistributedModelForCausalLM, TrainConfig
from client.training.export import fetch_peer_weights
from client.training.local import LocalTrainer
from protocol import swarmlm_pb2 as pb
from protocol.errors import SwarmError
from protocol.records import prefix_for_model
from tests.helpers.models import VOCAB_SIZE, make_tiny
from tests.helpers.processes import Swarm

pytestmark = pytest.mark.timeout(600)

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
RUN = "decided"
SEQ_LEN, BATCH, MICRO = 16, 4, 2
ROUND_TIMEOUT_S = 8.0  # the trainer gives up on an Apply after this long (a lost Apply is withheld longer)
RECIPE = {"lr": 3e-3, "max_grad_norm": 0.05}  # small: every update is clipped, so the decided factor shows
PEER = ["--train", "--run-id", RUN, "--target-batch-size", str(BATCH), "--matchmaking-time-s", "1",
        "--averaging-timeout-s", str(ROUND_TIMEOUT_S), "--load-state-timeout-s", "20", "--lr", "3e-3",
        "--max-grad-norm", "0.05"]  # fmt: skip
ATOL = 1e-4  # as test_training_exact.py
DECIDED = re.compile(r"decided it and (.*?); applying it as decided \(clip scale ([0-9.e-]+)\)")


class Stages:
    """Info and weights of the two stages' peers, through a client of the swarm."""

    def __init__(self, client):
        self.client = client

    def infos(self) -> dict[tuple[int, int], tuple[pb.InfoResponse, str]]:
        sequence = self.client.sequence

        async def ask():
            found = {}
            for info in (await sequence.snapshot(refresh=True)).online().values():
                try:
                    answer = await sequence.pool.unary(info.endpoint, "info", pb.InfoRequest(), 2.0)
                except SwarmError:
                    continue
                found[(info.start_block, info.end_block)] = (answer, info.endpoint)
            return found

        return self.client._run(ask())

    def epochs(self) -> dict[tuple[int, int], int]:
        return {span: int(info.epoch) for span, (info, _) in self.infos().items()}

    def check_weights(self, reference: dict[str, torch.Tensor], logs: str) -> None:
        sequence = self.client.sequence
        for span, (_, endpoint) in self.infos().items():
            weights = self.client._run(fetch_peer_weights(sequence.pool, endpoint, sequence.prefix, *span))
            worst = max(float((weights[n] - reference[n]).abs().max()) for n in weights)
            assert worst < ATOL, (span, worst, logs)


def test_a_stage_whose_apply_never_came_applies_the_update_its_trainer_decided(tmp_path):
    path = make_tiny("llama", tmp_path / "tiny-llama", seed=0)
    prefix = prefix_for_model(str(path))
    mode_file = tmp_path / "liar-mode.json"
    local = LocalTrainer(path, TrainConfig(batch_size=BATCH, micro_batch_size=MICRO, **RECIPE))
    generator = torch.Generator().manual_seed(0)  # the trainer's batches (tests/helpers/trainer.py)

    def reference_after(steps: int) -> dict[str, torch.Tensor]:
        while local.steps_done < steps:
            local.step(torch.randint(3, VOCAB_SIZE, (BATCH, SEQ_LEN), generator=generator))
        return local.model.state_dict()

    with Swarm(tmp_path / "swarm") as swarm:
        swarm.start_bootstrap()
        swarm.start_peer(path, "--blocks", "0:2", *PEER)
        withheld = swarm.start_peer(
            path, "--blocks", "2:4", *PEER, command=[sys.executable, str(HELPERS / "liar.py"), str(mode_file)]
        )
        swarm.wait_for(lambda: len(swarm.snapshot(prefix, 4).online()) == 2, 120, "2 peers ONLINE")
        go = {step: tmp_path / f"go-{step}" for step in (2, 3, 4)}  # each step waits for the test's checks
        config = {"model": str(path), "initial_peers": swarm.initial_peers, "run_id": RUN, "batch": BATCH,
                  "micro": MICRO, "seq_len": SEQ_LEN, "vocab_size": VOCAB_SIZE,
                  "averaging_timeout_s": ROUND_TIMEOUT_S, "steps": 5,
                  "wait_before": {str(step): str(file) for step, file in go.items()}}  # fmt: skip
        trainer = swarm.start_script("trainer", HELPERS / "trainer.py", json.dumps(config))
        client = AutoDistributedModelForCausalLM.from_pretrained(
            str(path), initial_peers=swarm.initial_peers, dtype=torch.float32
        )
        stages = Stages(client)
        try:
            swarm.wait_for(lambda: "step 1 done" in trainer.stdout(), 180, "the trainer's first step")

            # step 2: 2:4's Apply is lost; the trainer goes on without it
            mode_file.write_text(json.dumps({"lie": "withhold", "on": "apply", "for_s": ROUND_TIMEOUT_S + 4}))
            go[2].touch()
            swarm.wait_for(lambda: "step 2 done" in trainer.stdout(), 120, "the trainer to go on past step 2")
            mode_file.write_text(json.dumps({"lie": "honest"}))
            assert "did not apply" in trainer.stderr(), trainer.logs()
            swarm.wait_for(lambda: stages.epochs() == {(0, 2): 2, (2, 4): 2}, 60, "2:4 to apply step 2's update")
            (why, scale), *_ = DECIDED.findall(withheld.stderr())
            assert why == "went on past it without applying it here" and 0 < float(scale) < 1
            stages.check_weights(reference_after(2), swarm.format_logs())

            # step 4: applied at 0:2; 2:4's Apply withheld, and the trainer dies
            go[3].touch()
            swarm.wait_for(lambda: "step 3 done" in trainer.stdout(), 120, "the trainer's third step")
            mode_file.write_text(json.dumps({"lie": "withhold", "on": "apply"}))
            go[4].touch()
            swarm.wait_for(lambda: stages.epochs().get((0, 2)) == 4, 120, "0:2 to apply step 4's update")
            swarm.kill(trainer, signal.SIGKILL)
            mode_file.write_text(json.dumps({"lie": "honest"}))
            info, _ = stages.infos()[(2, 4)]
            assert info.epoch == 3 and info.round.state == pb.RoundStatus.AVERAGED, info
            swarm.wait_for(lambda: stages.epochs() == {(0, 2): 4, (2, 4): 4}, 90, "2:4 to apply step 4's update")
            (why, scale) = DECIDED.findall(withheld.stderr())[-1]
            assert why == "is gone without applying it here" and 0 < float(scale) < 1
            assert "dropped their commits" not in withheld.stderr()
            stages.check_weights(reference_after(4), swarm.format_logs())
        finally:
            client.shutdown()
