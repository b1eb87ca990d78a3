"""Training a mixture-of-experts model with the swarm, its load-balancing loss included, equals transformers' training.

A Qwen2-MoE (routed experts beside a shared one, and a plain MLP in block 1) trained with the load-balancing loss
(`TrainConfig.router_aux_loss_coef`, `swarmlm train --router-aux-loss-coef`), which transformers adds to the LM
loss as `router_aux_loss_coef` times its `aux_loss` (where the config sets `output_router_logits`, the
default this test overrides; tests/swarm/models/test_routers.py checks that default). That loss is not per layer: the stages report their router sums, the trainer adds them up and sends
each stage its part of the gradient (swarm/models/routers.py). Step for step, the trainer's loss and every
stage's weights equal local training (client/training/local.py, which takes transformers' own aux_loss).
"""

from __future__ import annotations

import pytest
import torch

from client import AutoDistributedModelForCausalLM, SwarmTrainer, TrainConfig
from client.training.export import fetch_peer_weights
from client.training.local import LocalTrainer
from client.training.microbatches import lm_loss
from protocol.records import prefix_for_model
from swarm.training.settings import AveragingSettings
from tests.helpers.models import MOE_CONFIGS, VOCAB_SIZE, save_random_model
from tests.helpers.processes import Swarm

pytestmark = pytest.mark.timeout(400)

SPANS = [(0, 2), (2, 4)]  # block 1 is a plain MLP: the first stage holds a routed and a dense layer
SEQ_LEN, BATCH, MICRO, STEPS, LR = 16, 4, 2, 3, 3e-3
AUX_COEF = 0.5  # transformers' default is 0.001: large here so that a lost term shows in every weight
ATOL = 1e-4  # as in tests/integration/test_training.py: the reference sums in another order, Adam divides by |g|+eps
AVERAGING = AveragingSettings(matchmaking_time_s=1.0, averaging_timeout_s=15.0, load_state_timeout_s=20.0)
PEER = ["--train", "--run-id", "moe", "--lr", str(LR), "--target-batch-size", str(BATCH), "--matchmaking-time-s", "1",
        "--averaging-timeout-s", "15", "--load-state-timeout-s", "20"]  # fmt: skip


def test_moe_training_with_the_load_balancing_loss_equals_local(tmp_path):
    path = save_random_model(MOE_CONFIGS["qwen2_moe"](4), tmp_path / "qwen2-moe", seed=0)
    local = LocalTrainer(
        path, TrainConfig(batch_size=BATCH, micro_batch_size=MICRO, lr=LR, router_aux_loss_coef=AUX_COEF)
    )
    generator = torch.Generator().manual_seed(0)
    with Swarm(tmp_path / "swarm") as swarm:
        swarm.start_bootstrap()
        for start, end in SPANS:
            swarm.start_peer(path, "--blocks", f"{start}:{end}", *PEER)
        swarm.wait_online(prefix_for_model(str(path)), SPANS, timeout_s=120)
        model = AutoDistributedModelForCausalLM.from_pretrained(
            str(path), initial_peers=swarm.initial_peers, dtype=torch.float32
        )
        trainer = None
        try:
            config = TrainConfig(
                run_id="moe",
                batch_size=BATCH,
                micro_batch_size=MICRO,
                lr=LR,
                router_aux_loss_coef=AUX_COEF,
                averaging=AVERAGING,
            )
            trainer = SwarmTrainer(model, config)
            for step in range(STEPS):
                batch = torch.randint(3, VOCAB_SIZE, (BATCH, SEQ_LEN), generator=generator)
                with torch.no_grad():  # the LM loss alone (micro-batches of equal length: their mean is the batch's)
                    plain = float(lm_loss(local.model(input_ids=batch).logits, batch, VOCAB_SIZE))
                result = trainer.step(batch)
                # the term weighs: the load-balancing loss is at least top_k (2), when the experts are balanced
                assert result.loss > plain + AUX_COEF, (result.loss, plain)
                reference = local.step(batch)
                assert result.loss == pytest.approx(reference.loss, rel=1e-5), (step, result.loss, reference.loss)
                assert result.stage_samples == dict.fromkeys(SPANS, BATCH), result
                state = local.model.state_dict()
                for span in SPANS:
                    weights = _weights(model, span)
                    for name, tensor in weights.items():
                        torch.testing.assert_close(tensor, state[name], atol=ATOL, rtol=0, msg=f"step {step}: {name}")
                for name, p in model.named_parameters():
                    torch.testing.assert_close(p.detach(), state[name], atol=ATOL, rtol=0, msg=name)
        finally:
            if trainer is not None:
                trainer.close()
            model.shutdown()


def _weights(model, span: tuple[int, int]) -> dict[str, torch.Tensor]:
    sequence = model.sequence

    async def fetch():
        snapshot = await sequence.snapshot(refresh=True)
        (info,) = [i for i in snapshot.online().values() if (i.start_block, i.end_block) == span]
        return await fetch_peer_weights(sequence.pool, info.endpoint, sequence.prefix, *span)

    return model._run(fetch())
