"""A trainer that dies between its Apply calls: the stage whose Apply never came applies the update as decided.

The trainer sends Apply to every stage at once. Stage 2:4's peer sits behind a proxy (tests/helpers/liar.py) that
withholds the Apply; once stage 0:2 has applied the update, the trainer's process is SIGKILLed. Stage 2:4 holds
the averaged round, and the trainer's record held its decision (the rounds and the clipping factor), stored before
its first Apply. Once the trainer's record has lapsed, stage 2:4 applies the round as decided, instead of dropping
it and staying one update behind stage 0:2 for good. Both stages then equal the local reference after two steps,
the clipping included.
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
RECIPE = {"lr": 3e-3, "max_grad_norm": 0.05}  # small: every update is clipped, so the decided factor shows
PEER = ["--train", "--run-id", RUN, "--target-batch-size", str(BATCH), "--matchmaking-time-s", "1",
        "--averaging-timeout-s", "8", "--load-state-timeout-s", "20", "--lr", "3e-3", "--max-grad-norm", "0.05"]  # fmt: skip
ATOL = 1e-4  # as test_training_exact.py


def test_a_stage_whose_apply_never_came_applies_the_update_its_dead_trainer_decided(tmp_path):
    path = make_tiny("llama", tmp_path / "tiny-llama", seed=0)
    prefix = prefix_for_model(str(path))
    mode_file = tmp_path / "liar-mode.json"
    with Swarm(tmp_path / "swarm") as swarm:
        swarm.start_bootstrap()
        swarm.start_peer(path, "--blocks", "0:2", *PEER)
        withheld = swarm.start_peer(
            path, "--blocks", "2:4", *PEER, command=[sys.executable, str(HELPERS / "liar.py"), str(mode_file)]
        )
        swarm.wait_for(lambda: len(swarm.snapshot(prefix, 4).online()) == 2, 120, "2 peers ONLINE")
        config = {"model": str(path), "initial_peers": swarm.initial_peers, "run_id": RUN, "batch": BATCH,
                  "micro": MICRO, "seq_len": SEQ_LEN, "vocab_size": VOCAB_SIZE, "averaging_timeout_s": 8.0,
                  "steps": 2, "go_file": str(tmp_path / "go")}  # fmt: skip
        trainer = swarm.start_script("trainer", HELPERS / "trainer.py", json.dumps(config))
        swarm.wait_for(lambda: "step 1 done" in trainer.stdout(), 180, "the trainer's first step")
        mode_file.write_text(json.dumps({"lie": "withhold", "on": "apply"}))
        (tmp_path / "go").touch()  # the second step begins

        client = AutoDistributedModelForCausalLM.from_pretrained(
            str(path), initial_peers=swarm.initial_peers, dtype=torch.float32
        )
        try:

            def infos() -> dict[tuple[int, int], tuple[pb.InfoResponse, str]]:
                async def ask():
                    found = {}
                    for info in (await client.sequence.snapshot(refresh=True)).online().values():
                        try:
                            answer = await client.sequence.pool.unary(info.endpoint, "info", pb.InfoRequest(), 2.0)
                        except SwarmError:
                            continue
                        found[(info.start_block, info.end_block)] = (answer, info.endpoint)
                    return found

                return client._run(ask())

            def epochs() -> dict[tuple[int, int], int]:
                return {span: int(info.epoch) for span, (info, _) in infos().items()}

            # update 1 applied at 0:2; its Apply to 2:4 held by the proxy: the trainer dies now
            swarm.wait_for(
                lambda: "lied: withhold on Apply" in withheld.stdout() and epochs().get((0, 2)) == 2,
                120,
                "stage 0:2 to apply update 1 while 2:4's Apply is withheld",
            )
            swarm.kill(trainer, signal.SIGKILL)
            mode_file.write_text(json.dumps({"lie": "honest"}))
            info, _ = infos()[(2, 4)]
            assert info.epoch == 1 and info.round.state == pb.RoundStatus.AVERAGED, info

            swarm.wait_for(lambda: epochs() == {(0, 2): 2, (2, 4): 2}, 90, "stage 2:4 to apply update 1 as decided")
            applied = re.search(r"applying it as decided \(clip scale ([0-9.e-]+)\)", withheld.stderr())
            assert applied, withheld.logs()
            assert 0 < float(applied.group(1)) < 1  # clipped: the trainer's factor, not a default of 1
            assert "dropped their commits" not in withheld.stderr()

            local = LocalTrainer(path, TrainConfig(batch_size=BATCH, micro_batch_size=MICRO, **RECIPE))
            generator = torch.Generator().manual_seed(0)  # the trainer's batches (tests/helpers/trainer.py)
            for _ in range(2):
                local.step(torch.randint(3, VOCAB_SIZE, (BATCH, SEQ_LEN), generator=generator))
            reference = local.model.state_dict()
            for span, (_, endpoint) in infos().items():
                weights = client._run(fetch_peer_weights(client.sequence.pool, endpoint, client.sequence.prefix, *span))
                worst = max(float((weights[n] - reference[n]).abs().max()) for n in weights)
                assert worst < ATOL, (span, worst, swarm.format_logs())
        finally:
            client.shutdown()
