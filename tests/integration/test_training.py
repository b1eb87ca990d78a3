"""Training with the swarm equals training in one process: real peers, trainers and averaging groups.

The exact case runs the user's commands end to end: `swarmlm train` against `swarmlm train --local` on the same
Shakespeare data (a character tokenizer fits the tiny model's vocabulary), then `swarmlm export` against the
local run's saved checkpoint. The group cases drive trainers from Python to check every step: two peers per
stage and two trainers, whose batches together are the local reference's batch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import threading
import time

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from client import AutoDistributedModelForCausalLM, SwarmTrainer, TrainConfig
from client.sequence import TrainingTag
from client.training.adapters import ADAPTER_FILE, export_adapter
from client.training.export import TRAINER_FILE, export_model, fetch_peer_weights
from client.training.local import LocalTrainer
from protocol.errors import BadRequestError, StaleEpochError, SwarmError
from protocol.records import prefix_for_model
from swarm.training.settings import AveragingSettings
from tests.helpers.models import VOCAB_SIZE, make_tiny
from tests.helpers.processes import Swarm
from tests.helpers.tokenizer import save_char_tokenizer

SEQ_LEN = 32
LR = 3e-3
# rounds gather for a second here; volunteers on the internet keep the defaults (15 s, 60 s)
AVERAGING = AveragingSettings(matchmaking_time_s=1.0, averaging_timeout_s=15.0, load_state_timeout_s=20.0)
# members of a group are bit-identical in practice (gradients cross the all-reduce in float64, swarm/training/group.py);
# GROUP_ATOL leaves a few float32 ulps. The local reference sums the batch in another order, and Adam divides by
# |g| + eps, so near-zero gradients move it by up to a few 1e-5 from the swarm after some steps.
GROUP_ATOL, LOCAL_ATOL = 1e-7, 1e-4
AVERAGING_FLAGS = ["--matchmaking-time-s", "1", "--averaging-timeout-s", "15", "--load-state-timeout-s", "20"]


def peer_flags(run_id: str, target: int) -> list[str]:
    return ["--train", "--run-id", run_id, "--lr", str(LR), "--target-batch-size", str(target), *AVERAGING_FLAGS]


def training_peers(swarm, model_path, run_id: str, target: int, spans, *extra: str) -> list:
    """A training peer of run `run_id` for each of `spans` (with `extra` flags), once every one is online."""
    peers = [
        swarm.start_peer(model_path, "--blocks", f"{start}:{end}", *peer_flags(run_id, target), *extra)
        for start, end in spans
    ]
    swarm.wait_online(prefix_for_model(str(model_path)), spans, timeout_s=120)
    return peers


def client(swarm, model_path):
    """A float32 client of the swarm's model."""
    return AutoDistributedModelForCausalLM.from_pretrained(
        str(model_path), initial_peers=swarm.initial_peers, dtype=torch.float32
    )


def train_flags(run_id: str, steps: int, *extra: str) -> list[str]:
    return [
        "--run-id",
        run_id,
        "--lr",
        str(LR),
        "--seq-len",
        str(SEQ_LEN),
        "--batch-size",
        "8",
        "--micro-batch-size",
        "2",
        "--steps",
        str(steps),
        "--seed",
        "0",
        "--no-progress",
        *AVERAGING_FLAGS,
        *extra,
    ]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = make_tiny("llama", tmp_path_factory.mktemp("models") / "tiny-llama", seed=0)
    save_char_tokenizer(path)
    return path


def read_log(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_swarm_training_equals_local_training(model_path, tmp_path):
    """One trainer, two stages of one peer each, fp32: the same losses for 10 steps and the same weights."""
    steps = 10  # the loss falls to 0.72x its first value by then
    with Swarm(tmp_path / "swarm") as swarm:
        # the reference needs no swarm: it trains while the swarm starts
        local = swarm.spawn(
            "train-local",
            "train",
            str(model_path),
            "--local",
            *train_flags("exact", steps),
            "--log-json",
            str(tmp_path / "local.jsonl"),
            "--save",
            str(tmp_path / "local"),
        )
        swarm.start_bootstrap()
        for start, end in [(0, 2), (2, 4)]:
            swarm.start_peer(model_path, "--blocks", f"{start}:{end}", *peer_flags("exact", 8))
        swarm.wait_online(prefix_for_model(str(model_path)), [(0, 2), (2, 4)], timeout_s=120)
        local = swarm.finish(local, timeout_s=300)
        assert local.returncode == 0, local.stderr[-3000:]
        remote = swarm.run(
            "train",
            str(model_path),
            "--initial-peers",
            *swarm.initial_peers,
            *train_flags("exact", steps),
            "--log-json",
            str(tmp_path / "swarm.jsonl"),
            "--save",
            str(tmp_path / "trainer"),
            timeout_s=300,
        )
        assert remote.returncode == 0, remote.stderr[-3000:]
        exported = swarm.run(
            "export",
            str(model_path),
            "--initial-peers",
            *swarm.initial_peers,
            "--run-id",
            "exact",
            "--trainer-dir",
            str(tmp_path / "trainer"),
            "--out",
            str(tmp_path / "exported"),
            timeout_s=120,
        )
        assert exported.returncode == 0, exported.stderr[-3000:]
        refused = swarm.run(
            "export", str(model_path), "--initial-peers", *swarm.initial_peers, "--run-id", "exact", "--adapter-only",
            "--out", str(tmp_path / "adapter"), timeout_s=120,
        )  # fmt: skip
        assert refused.returncode == 1 and "trains full weights" in refused.stderr, refused.stderr[-3000:]
        # the run's trainer left cleanly: the next one starts at once from the checkpoint, waiting for no state
        again = swarm.run(
            "train", str(model_path), "--initial-peers", *swarm.initial_peers, *train_flags("exact", 1), timeout_s=120
        )
        assert again.returncode == 0, again.stderr[-3000:]
        assert "start from the checkpoint" in again.stderr, again.stderr[-3000:]

    local_log, swarm_log = read_log(tmp_path / "local.jsonl"), read_log(tmp_path / "swarm.jsonl")
    assert [r["step"] for r in swarm_log] == [r["step"] for r in local_log] == list(range(1, steps + 1))
    for mine, reference in zip(swarm_log, local_log):
        assert mine["samples"] == reference["samples"] == 8
        assert mine["loss"] == pytest.approx(reference["loss"], rel=1e-4), (mine, reference)
        # where the step's time went: each phase once, adding up to the step's seconds (tokens over tokens/s)
        phases = mine["phases"]
        assert (
            set(phases) == {"ready", "micro_batches", "rounds", "decide", "apply", "sync"} and min(phases.values()) >= 0
        )
        assert sum(phases.values()) == pytest.approx(8 * SEQ_LEN / mine["tokens_per_s"], rel=1e-6), mine
    # the model really learns: Shakespeare's characters are far from uniform
    assert local_log[-1]["loss"] < 0.8 * local_log[0]["loss"], [r["loss"] for r in local_log]

    mine, reference = (
        load_file(tmp_path / "exported" / "model.safetensors"),
        load_file(tmp_path / "local" / "model.safetensors"),
    )
    assert set(mine) == set(reference)
    initial = load_file(model_path / "model.safetensors")
    for name, tensor in reference.items():
        torch.testing.assert_close(mine[name], tensor, atol=1e-5, rtol=0, msg=name)
        assert not torch.equal(tensor, initial[name]) or "norm" in name, f"{name} was not trained"
    # and transformers loads the export like any checkpoint, with the local run's logits
    ids = torch.randint(3, VOCAB_SIZE, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(
            AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()(ids).logits,
            AutoModelForCausalLM.from_pretrained(tmp_path / "local").eval()(ids).logits,
            atol=1e-4,
            rtol=0,
        )


def group_weights(
    model, span: tuple[int, int], skip_silent: bool = False, members: int | None = None
) -> list[dict[str, torch.Tensor]]:
    """The current weights of every live peer of `span`, each asked for its own (`skip_silent`: leaving out those
    that do not answer, such as a killed peer whose record has not lapsed yet). `members`: read the directory again
    (for up to 30 s) until that many ONLINE records of `span` are in it: on a loaded machine one read can miss a
    record being refreshed."""
    sequence = model.sequence

    async def fetch():
        deadline = time.monotonic() + 30.0
        while True:
            snapshot = await sequence.snapshot(refresh=True)
            online = [i for i in snapshot.online().values() if (i.start_block, i.end_block) == span]
            if members is None or len(online) >= members or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        found = []
        for info in online:
            try:
                found.append(await fetch_peer_weights(sequence.pool, info.endpoint, sequence.prefix, *span))
            except SwarmError:
                if not skip_silent:
                    raise
        return found

    return model._run(fetch())


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max(float((a[name] - b[name]).abs().max()) for name in a)


def test_two_peers_per_stage_and_two_trainers_stay_together(model_path, tmp_path):
    """Each group stays identical after every step, and the swarm follows local training of the joint batch."""
    spans = [(0, 2), (0, 2), (2, 4), (2, 4)]
    steps = 3
    config = TrainConfig(run_id="pairs", batch_size=8, micro_batch_size=2, lr=LR, averaging=AVERAGING)
    with Swarm(tmp_path / "swarm") as swarm:
        swarm.start_bootstrap()
        training_peers(swarm, model_path, "pairs", 16, spans)
        models = [client(swarm, model_path) for _ in range(2)]
        trainers = []
        try:
            trainers = [SwarmTrainer(model, config) for model in models]
            local = LocalTrainer(model_path, TrainConfig(batch_size=16, micro_batch_size=2, lr=LR))
            generator = torch.Generator().manual_seed(0)
            for step in range(steps):
                batch = torch.randint(3, VOCAB_SIZE, (16, SEQ_LEN), generator=generator)
                results = [None, None]

                def run(i, batch=batch, results=results):
                    results[i] = trainers[i].step(batch[8 * i : 8 * i + 8])

                threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join(timeout=120)
                assert all(results), f"a trainer did not finish step {step}\n{swarm.format_logs()}"
                reference = local.step(batch)
                assert (results[0].loss + results[1].loss) / 2 == pytest.approx(reference.loss, rel=1e-4)
                for result in results:  # both trainers' micro-batches, once, at every stage and both trainers
                    assert result.stage_epochs == {(0, 2): step + 1, (2, 4): step + 1}, result
                    assert result.stage_samples == {(0, 2): 16, (2, 4): 16}, result
                    assert result.trainer_samples == 16, result
                # every member of a group holds the same weights
                local_state = local.model.state_dict()
                for span in [(0, 2), (2, 4)]:
                    first, second = group_weights(models[0], span, members=2)
                    assert max_difference(first, second) < GROUP_ATOL, (step, span)
                    assert max_difference(first, {name: local_state[name] for name in first}) < LOCAL_ATOL
                # and both trainers hold the same embeddings and head, equal to the local model's
                for name, p in models[0].named_parameters():
                    other = dict(models[1].named_parameters())[name]
                    assert float((p - other).detach().abs().max()) < GROUP_ATOL, name
                    assert float((p - local_state[name]).detach().abs().max()) < LOCAL_ATOL, name
        finally:
            for trainer in trainers:
                trainer.close()
            for model in models:
                model.shutdown()


def test_lora_training_exports_what_the_swarm_serves(model_path, tmp_path):
    """LoRA peers train adapters only, as the local LoRA reference does on the same batches; the export (adapters
    merged) is what the swarm computes and generates, and what the reference computes; the adapters exported alone
    and served by frozen peers (`--adapters`) compute it too."""
    # the recipe (lr 3e-2, LoRA) is the peers's: a trainer that gives no lr adopts it
    config = TrainConfig(run_id="lora", batch_size=4, micro_batch_size=2, averaging=AVERAGING)
    with Swarm(tmp_path / "swarm") as swarm:
        swarm.start_bootstrap()
        for start, end in [(0, 3), (3, 4)]:
            swarm.start_peer(
                model_path,
                "--blocks",
                f"{start}:{end}",
                *peer_flags("lora", 4),
                "--train-mode",
                "lora",
                "--lr",
                "3e-2",
                "--save-dir",
                str(tmp_path / "saved"),
            )
        swarm.wait_online(prefix_for_model(str(model_path)), [(0, 3), (3, 4)], timeout_s=120)
        model = AutoDistributedModelForCausalLM.from_pretrained(
            str(model_path), initial_peers=swarm.initial_peers, dtype=torch.float32
        )
        trainer = None
        try:
            trainer = SwarmTrainer(model, config)
            generator = torch.Generator().manual_seed(0)
            batches = [torch.randint(3, VOCAB_SIZE, (4, SEQ_LEN), generator=generator) for _ in range(3)]
            losses = [trainer.step(batch).loss for batch in batches]
            # the `swarmlm train --local` reference of a LoRA run: the same adapters, trained on the same batches
            reference = LocalTrainer(model_path, config, recipe=trainer.recipe)
            assert trainer.recipe.train_mode == "lora"
            expected = [reference.step(batch).loss for batch in batches]
            assert losses == pytest.approx(expected, rel=1e-5), (losses, expected)
            # a peer stopped with --save-dir saves its span; restarted alone in its group, it resumes there
            (before,) = group_weights(model, (3, 4))
            first = next(p for p in swarm.processes if "3:4" in p.args)
            assert swarm.terminate(first, timeout_s=60) == 0, first.logs()
            again = swarm.start_peer(
                model_path,
                "--blocks",
                "3:4",
                *peer_flags("lora", 4),
                "--train-mode",
                "lora",
                "--lr",
                "3e-2",
                "--save-dir",
                str(tmp_path / "saved"),
            )
            swarm.wait_for(lambda: "ONLINE" in again.stderr(), 120, "the restarted peer to be ONLINE")
            assert "resumed run 'lora' at update 3" in again.stderr(), again.logs()
            (after,) = group_weights(model, (3, 4))
            assert max_difference(before, after) == 0.0

            initial = load_file(model_path / "model.safetensors")
            served = {}
            for span in [(0, 3), (3, 4)]:
                (weights,) = group_weights(model, span)
                served.update(weights)
            changed = {name for name, t in served.items() if not torch.equal(t, initial[name])}
            assert changed and all(name.endswith("_proj.weight") for name in changed), sorted(changed)

            trainer_dir = tmp_path / "trainer"
            trainer_dir.mkdir()
            save_file(
                {name: p.detach().contiguous() for name, p in model.named_parameters()}, str(trainer_dir / TRAINER_FILE)
            )
            out = export_model(
                str(model_path), swarm.initial_peers, tmp_path / "exported", trainer_dir=trainer_dir, run_id="lora"
            )
            exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
            # the adapters alone, as peft saves them: on the original checkpoint, they compute the same model
            adapter = export_adapter(
                str(model_path), swarm.initial_peers, tmp_path / "adapter", run_id="lora", trainer_dir=trainer_dir
            )
            saved = load_file(adapter / ADAPTER_FILE)
            assert all(".lora_" in name or "layers" not in name for name in saved), sorted(saved)[:5]
            # `swarmlm train --local --train-mode lora --save` writes the reference's run the same way
            reference.save_pretrained(tmp_path / "reference")
            own = load_file(tmp_path / "reference" / ADAPTER_FILE)
            assert set(own) == set(saved)
            for name, tensor in own.items():
                torch.testing.assert_close(saved[name], tensor, atol=1e-4, rtol=0, msg=name)
            base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
            adapted = PeftModel.from_pretrained(base, adapter).eval()
            ids = torch.randint(3, VOCAB_SIZE, (2, 16), generator=generator)
            with torch.no_grad():
                torch.testing.assert_close(model(ids).logits, exported(ids).logits, atol=1e-4, rtol=0)
                torch.testing.assert_close(adapted(ids).logits, exported(ids).logits, atol=1e-4, rtol=0)
                torch.testing.assert_close(reference.model(ids).logits, exported(ids).logits, atol=1e-4, rtol=0)
                prompt = ids[:1, :6]
                assert torch.equal(
                    model.generate(prompt, max_new_tokens=8, do_sample=False),
                    exported.generate(prompt, max_new_tokens=8, do_sample=False),
                )
            # the exported adapter, served by two frozen peers and chosen per session, is the same model again
            for span in ("0:2", "2:4"):
                swarm.start_peer(model_path, "--blocks", span, "--adapters", f"trained={adapter}")
            served = AutoDistributedModelForCausalLM.from_pretrained(
                str(model_path), initial_peers=swarm.initial_peers, adapter="trained", adapter_path=str(adapter)
            )
            try:
                with torch.no_grad():
                    torch.testing.assert_close(served(ids).logits, adapted(ids).logits, atol=1e-4, rtol=0)
            finally:
                served.shutdown()

            # training requests that do not fit get typed errors, and the peers train on
            sequence = model.sequence
            hop = next(h for h in model._run(sequence.plan(0, 3, inference=False)) if h.start == 0)
            hidden = torch.randn(1, 4, model.config.hidden_size)
            positions = torch.arange(4).unsqueeze(0)
            epoch = 3  # after three steps

            def backward(tag, on=hop):
                return model._run(sequence._call_backward(on, hidden, hidden, None, positions, "", tag))

            with pytest.raises(BadRequestError, match="trains run 'lora', not 'other'"):
                backward(TrainingTag("other", {(0, 3): epoch}))
            with pytest.raises(StaleEpochError, match="at update 3"):
                backward(TrainingTag("lora", {(0, 3): epoch - 1}))
            with pytest.raises(BadRequestError, match="whole span 0:3"):
                backward(TrainingTag("lora", {(0, 2): epoch}), on=dataclasses.replace(hop, end=2))
            with pytest.raises(BadRequestError, match="needs its micro_batch id"):
                backward(TrainingTag("lora", {(0, 3): epoch}))
            with pytest.raises(BadRequestError, match="whole span 0:3"):
                model._run(fetch_peer_weights(sequence.pool, hop.endpoint, sequence.prefix, 0, 2))
            trainer.step(torch.randint(3, VOCAB_SIZE, (4, SEQ_LEN), generator=generator))
        finally:
            if trainer is not None:
                trainer.close()
            model.shutdown()


def train_in_threads(trainers, batch: torch.Tensor, swarm) -> list:
    """One step of every trainer at once, each on its share of `batch`."""
    share = batch.shape[0] // len(trainers)
    results = [None] * len(trainers)

    def run(i):
        results[i] = trainers[i].step(batch[share * i : share * (i + 1)])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(trainers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert all(results), f"a trainer did not finish its step\n{swarm.format_logs()}"
    return results


@pytest.mark.parametrize("sync_overlap", [0, 1])
def test_local_steps_equal_the_local_diloco_reference(model_path, tmp_path, sync_overlap):
    """With --local-steps 2, one peer per stage and one trainer compute what the one-process reference computes:
    inner AdamW steps, and every second update the outer Nesterov step, for blocks and trainer parts alike. With
    --sync-overlap 1 that step lands one update later, on top of it (Streaming DiLoCo), in both."""
    steps, local_steps = 4 + sync_overlap, 2
    config = TrainConfig(run_id="diloco", batch_size=8, micro_batch_size=2, lr=LR, averaging=AVERAGING)
    overlap = ["--sync-overlap", str(sync_overlap)] if sync_overlap else []
    with Swarm(tmp_path / "swarm") as swarm:
        swarm.start_bootstrap()
        training_peers(swarm, model_path, "diloco", 8, [(0, 2), (2, 4)], "--local-steps", str(local_steps), *overlap)
        model = client(swarm, model_path)
        trainer = None
        try:
            trainer = SwarmTrainer(model, config)  # adopts the run's recipe: local steps and DiLoCo's outer step
            assert trainer.recipe.local_steps == local_steps and trainer.recipe.outer_lr == 0.7
            assert trainer.recipe.sync_overlap == sync_overlap
            local = LocalTrainer(
                model_path, dataclasses.replace(config, local_steps=local_steps, sync_overlap=sync_overlap)
            )
            initial = {name: p.detach().clone() for name, p in local.model.named_parameters()}
            generator = torch.Generator().manual_seed(0)
            for step in range(steps):
                batch = torch.randint(3, VOCAB_SIZE, (8, SEQ_LEN), generator=generator)
                (result,) = train_in_threads([trainer], batch, swarm)
                reference = local.step(batch)
                assert result.loss == pytest.approx(reference.loss, rel=1e-4), step
                assert result.stage_samples == {(0, 2): 8, (2, 4): 8}, result
                # with an overlap, each took the sync of updates 1 and 3 and lands it after the next
                overlapping = bool(sync_overlap) and step % 2 == 1
                assert (local.pending is not None) is (trainer.syncs.pending is not None) is overlapping, step
                local_state = local.model.state_dict()
                for span in [(0, 2), (2, 4)]:
                    (weights,) = group_weights(model, span)
                    assert max_difference(weights, {name: local_state[name] for name in weights}) < LOCAL_ATOL
                for name, p in model.named_parameters():
                    assert float((p - local_state[name]).detach().abs().max()) < LOCAL_ATOL, (step, name)
            # the outer step moved the weights from where AdamW alone would: the reference did take it
            moved = local.outer.momenta[0].abs().max()
            assert moved > 0 and not torch.equal(local.outer.anchors[0], initial[next(iter(initial))])

        finally:
            if trainer is not None:
                trainer.close()
            model.shutdown()


def test_local_steps_go_on_when_a_member_dies_between_syncs_and_a_trainer_joins(model_path, tmp_path):
    """Three peers in a stage, two trainers, --local-steps 2: after an inner step the members differ (each stepped
    on its own micro-batches), and one is SIGKILLed, with local changes nobody else has. The next update, a sync, goes on without it: the stages still apply every
    micro-batch once, and the two members left, and both trainers, hold the same weights after the sync. (What
    the dead member learnt since the last sync is lost, as in DiLoCo: docs/training.md#local-steps-diloco.) Then
    a third trainer joins: it copies the others' state and, after the next sync, holds what they hold."""
    spans = [(0, 2), (0, 2), (0, 2), (2, 4)]
    config = TrainConfig(run_id="diloco-kill", batch_size=8, micro_batch_size=2, lr=LR, averaging=AVERAGING)
    with Swarm(tmp_path / "swarm") as swarm:
        swarm.start_bootstrap()
        peers = training_peers(swarm, model_path, "diloco-kill", 16, spans, "--local-steps", "2")
        models = [client(swarm, model_path) for _ in range(2)]
        trainers = []
        try:
            trainers = [SwarmTrainer(model, config) for model in models]
            generator = torch.Generator().manual_seed(0)
            batches = [torch.randint(3, VOCAB_SIZE, (n, SEQ_LEN), generator=generator) for n in (16, 16, 24, 24)]
            for result in train_in_threads(trainers, batches[0], swarm):  # an inner step: the members differ
                assert result.stage_samples == {(0, 2): 16, (2, 4): 16}, result
            assert_apart(models, group_weights(models[0], (0, 2)))
            swarm.kill(peers[0], signal.SIGKILL)
            for result in train_in_threads(trainers, batches[1], swarm):  # the sync, without it
                assert result.stage_samples == {(0, 2): 16, (2, 4): 16}, result
                assert result.trainer_samples == 16, result
            assert_synced(models, group_weights(models[0], (0, 2), skip_silent=True))

            models.append(client(swarm, model_path))
            trainers.append(SwarmTrainer(models[-1], config))
            for batch in batches[2:]:  # an inner step and a sync, with the joiner
                for result in train_in_threads(trainers, batch, swarm):
                    assert result.stage_samples == {(0, 2): 24, (2, 4): 24}, result
                    assert result.trainer_samples == 24, result
            assert_synced(models, group_weights(models[0], (0, 2), skip_silent=True))
        finally:
            for trainer in trainers:
                trainer.close()
            for model in models:
                model.shutdown()


def test_overlapped_syncs_keep_two_members_and_two_trainers_together(model_path, tmp_path):
    """--local-steps 2 --sync-overlap 1 with two peers in one stage and two trainers: each sync's round runs while
    everyone takes the next update, and lands after it. The members' and the trainers' sync points (what they
    vouch for) agree after every update, as each trainer's Apply checks, though their weights differ by their own
    inner steps; the rounds did average the two members, and the two trainers."""
    spans = [(0, 2), (0, 2), (2, 4)]
    config = TrainConfig(run_id="overlap", batch_size=8, micro_batch_size=2, lr=LR, averaging=AVERAGING)
    with Swarm(tmp_path / "swarm") as swarm:
        swarm.start_bootstrap()
        peers = training_peers(swarm, model_path, "overlap", 16, spans, "--local-steps", "2", "--sync-overlap", "1")
        models = [client(swarm, model_path) for _ in range(2)]
        trainers = []
        try:
            trainers = [SwarmTrainer(model, config) for model in models]
            generator = torch.Generator().manual_seed(0)
            for step in range(4):  # syncs taken after updates 1 and 3, the first landed after update 2
                batch = torch.randint(3, VOCAB_SIZE, (16, SEQ_LEN), generator=generator)
                for result in train_in_threads(trainers, batch, swarm):
                    assert result.stage_samples == {(0, 2): 16, (2, 4): 16}, result
                    assert result.trainer_samples == 16 and result.faults == [], result
                if step == 2:
                    first, second = (trainer.outer for trainer in trainers)
                    assert first.momenta[0].abs().max() > 0
                    for mine, theirs in zip(first.state(), second.state()):
                        assert torch.equal(mine, theirs)
                    assert not torch.equal(first.params[0], first.anchors[0])  # plus its own inner step
            assert all(trainer.syncs.pending is not None for trainer in trainers)  # the second sync, under way
            for peer in peers[:2]:
                log = peer.stderr_path.read_text()
                assert "the sync of update 1 of run 'overlap': synced among 2 members" in log, swarm.format_logs()
        finally:
            for trainer in trainers:
                trainer.close()
            for model in models:
                model.shutdown()


def assert_synced(models, members: list[dict[str, torch.Tensor]]) -> None:
    """Right after a sync: the two members of a stage, and every trainer, hold the same weights."""
    assert len(members) == 2
    assert max_difference(*members) < GROUP_ATOL
    parts = [dict(m.named_parameters()) for m in models]
    for other in parts[1:]:
        apart = max(float((p - other[name]).detach().abs().max()) for name, p in parts[0].items())
        assert apart < GROUP_ATOL, apart


def assert_apart(models, members: list[dict[str, torch.Tensor]]) -> None:
    """Between syncs: the members of a stage, and the trainers, hold weights of their own."""
    assert len(members) == 3
    assert min(max_difference(a, b) for i, a in enumerate(members) for b in members[i + 1 :]) > 1e-5
    parts = [dict(m.named_parameters()) for m in models]
    apart = max(float((p - parts[1][name]).detach().abs().max()) for name, p in parts[0].items())
    assert apart > 1e-5, apart
