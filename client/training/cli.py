"""`swarmlm train MODEL ...`: train with the peers of a run (or alone with --local, the reference), on your data.

The data (--data: text files, JSON lines, Parquet, or a folder of them) is streamed: tokenized as it is read,
shuffled within windows, this trainer's --data-shard of the documents only (client/training/stream.py).

Prints a progress bar (loss, tokens/s, each stage's update count), writes one JSON line per step with
--log-json, and with --save keeps the trainer's state (embeddings, norm, head, optimizer, data position) so
that a later run resumes from it.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from collections import Counter
from pathlib import Path

from client.config import TrainConfig
from client.training.documents import Shard, Source, find_sources, sources_of
from protocol.errors import SwarmError
from protocol.vocab import TrainMode, WireDType, choices
from swarm.training.recipe import RunRecipe
from swarm.training.settings import (
    add_averaging_arguments,
    add_recipe_arguments,
    averaging_from_args,
    recipe_arguments,
)
from swarm.trust.swarmkey import SWARM_KEY_HELP, load_optional

# torch, transformers and hivemind are imported once the flags are known good: a wrong one is answered at once

logger = logging.getLogger(__name__)

STATE_FILE = "train_state.json"


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Train a model with the swarm's training peers.")
    p.add_argument("model", help="checkpoint folder (the one the peers were started with)")
    p.add_argument("--initial-peers", nargs="+", default=[], metavar="MADDR", help="multiaddrs to join through")
    p.add_argument("--swarm-key", metavar="FILE", help=SWARM_KEY_HELP)
    p.add_argument("--local", action="store_true", help="train the whole model in this process: the reference")
    p.add_argument(
        "--wire-dtype",
        choices=choices(WireDType),
        default=WireDType.NONE.value,
        help="how activations and their gradients travel to and from the peers: as computed (none, exact), or "
        "compressed to float16, bfloat16 (half the bytes) or blockwise int8 (a quarter); lossy, see docs/training.md",
    )
    p.add_argument(
        "--data",
        metavar="PATH",
        help="training data: a text file (.txt, .md, ...), a JSON lines (.jsonl) or Parquet (.parquet) file, or a "
        "folder of them, read recursively; streamed, never held whole (default: the bundled Shakespeare plays)",
    )
    p.add_argument(
        "--text-field",
        default="text",
        metavar="NAME",
        help="the field of JSON lines records, or the Parquet column, that holds the text (default: text)",
    )
    p.add_argument(
        "--data-shard",
        type=_data_shard,
        default="0/1",
        metavar="I/N",
        help="this trainer's share of the documents: those whose number %% N == I (a document is a text file or a "
        "record); give the N trainers of a run 0/N .. N-1/N, so that none trains on another's text (default: 0/1)",
    )
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default: 256)")
    p.add_argument(
        "--batch-size",
        type=int,
        default=8,
        help="sequences per step from this trainer, its share of the run's batch (default: 8)",
    )
    p.add_argument("--micro-batch-size", type=int, default=2, help="sequences per request (default: 2)")
    p.add_argument(
        "--max-in-flight", type=int, default=0, help="micro-batches in flight at once (default: 0, all of a step's)"
    )
    p.add_argument("--steps", type=int, default=100, help="optimizer steps to run (default: 100)")
    recipe = p.add_argument_group("the run's recipe (given ones must equal a running run's)")
    add_recipe_arguments(recipe)
    d = RunRecipe()
    recipe.add_argument(
        "--train-mode",
        choices=choices(TrainMode),
        help=f"what the peers train: full weights, or LoRA adapters of their linear layers (the run's; with --local, "
        f"the reference does the same; default {d.train_mode})",
    )
    recipe.add_argument("--lora-rank", type=int, help=f"rank of the LoRA adapters (the run's; default {d.lora_rank})")
    p.add_argument(
        "--router-aux-loss-coef",
        type=float,
        metavar="X",
        help="mixture-of-experts models: weight of the load-balancing loss added to the LM loss (0: none; default: "
        "the model config's router_aux_loss_coef where it sets output_router_logits, as transformers trains it)",
    )
    p.add_argument("--seed", type=int, default=0, help="data order: the shuffle within windows (default: 0)")
    p.add_argument("--run-id", default="default", help="the peers' training run (default: default)")
    p.add_argument("--dht-prefix", help="name of the model in the DHT (default: derived from MODEL)")
    p.add_argument("--host", default="127.0.0.1", help="address the trainer's DHT node listens on")
    p.add_argument(
        "--step-timeout-s",
        type=float,
        default=60.0,
        metavar="S",
        help="after a batch, how long to wait for the stages' update once no trainer adds samples to "
        "it; then the next batch adds to it (default: 60)",
    )
    add_averaging_arguments(p)
    p.add_argument("--log-json", help="append one JSON line per step to this file")
    p.add_argument("--save", metavar="DIR", help="save the trainer's state here after the run, and resume from it")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        run_id=args.run_id,
        batch_size=args.batch_size,
        micro_batch_size=args.micro_batch_size,
        max_in_flight=args.max_in_flight,
        router_aux_loss_coef=args.router_aux_loss_coef,
        **recipe_arguments(args),
        train_mode=args.train_mode,
        lora_rank=args.lora_rank,
        averaging=averaging_from_args(args),
        step_timeout_s=args.step_timeout_s,
        host=args.host,
    )


def _data_shard(text: str) -> Shard:
    try:
        return Shard.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def data_sources(args: argparse.Namespace) -> list[Source]:
    """The files of --data, or the default corpus. Raises OSError or ValueError, naming the path."""
    if args.data:
        return find_sources(args.data)
    from client.training.data import default_corpus

    return sources_of(default_corpus())


def load_batches(model_path: Path, args: argparse.Namespace, state: dict | None, sources: list[Source] | None = None):
    """The Prefetcher over the streaming loader of --data, resumed from `state` (a saved `state_dict()`)."""
    from transformers import AutoTokenizer

    from client.training.data import Prefetcher
    from client.training.stream import StreamingBatches

    sources = data_sources(args) if sources is None else sources
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"cannot load the tokenizer of {model_path}: {exc}; the checkpoint folder must hold one"
        ) from None
    batches = StreamingBatches(
        sources,
        tokenizer,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        seed=args.seed,
        shard=args.data_shard,
        text_field=args.text_field,
        state=state,
    )
    kinds = Counter(source.kind.value for source in sources)
    logger.info(
        "data: %s, data shard %s, streamed in shuffle windows of %d sequences of %d tokens",
        ", ".join(f"{n} {kind} file(s)" for kind, n in sorted(kinds.items())),
        args.data_shard,
        batches.window_chunks,
        args.seq_len,
    )
    return Prefetcher(batches)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    if args.steps < 1 or args.seq_len < 2:
        raise SystemExit(f"error: --steps must be >= 1 and --seq-len >= 2, got {args.steps}, {args.seq_len}")
    if not args.local and not args.initial_peers:
        raise SystemExit("error: pass --initial-peers (the bootstrap node's multiaddr), or --local to train alone")
    if args.local and args.wire_dtype != WireDType.NONE:
        raise SystemExit("error: --wire-dtype is how tensors travel to the peers; --local sends none")
    try:
        config = config_from_args(args)
        if args.local:
            config.recipe()  # alone, this process is the run: its settings must go together now
        swarm_key = load_optional(args.swarm_key)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    try:
        sources = data_sources(args)  # files only: nothing is read before the first batch
    except (OSError, ValueError) as exc:
        raise SystemExit(f"error: {exc}") from None
    signal.signal(signal.SIGTERM, _interrupt)  # stop like Ctrl+C: through the cleanup below
    save = Path(args.save) if args.save else None
    resumed = json.loads((save / STATE_FILE).read_text()) if save and (save / STATE_FILE).exists() else None
    trainer = batches = model = None
    from swarm.models.checkpoint import resolve_model_path

    try:
        model_path = resolve_model_path(args.model)
        batches = load_batches(model_path, args, resumed["data"] if resumed else None, sources)
        trainer, model = _make_trainer(
            args, config, model_path, save if resumed else None, swarm_key, steps_done=resumed["step"] if resumed else 0
        )
        _train(trainer, batches, args, first=resumed["step"] + 1 if resumed else 1)
    except KeyboardInterrupt:
        logger.warning("interrupted")
        return 130
    except (SwarmError, ValueError, OSError) as exc:
        logger.error("%s", exc)
        return 1
    finally:
        if save is not None and trainer is not None and batches is not None:
            _save(save, trainer, batches, args)
        for closing in (batches, trainer, model):
            if closing is not None:
                (closing.shutdown if hasattr(closing, "shutdown") else closing.close)()
    return 0


def _make_trainer(
    args, config: TrainConfig, model_path: Path, resume: Path | None, swarm_key=None, *, steps_done: int = 0
):
    import torch

    from client.training.export import OPTIMIZER_FILE

    if args.local:
        from client.training.local import LocalTrainer

        if config.recipe().train_mode == TrainMode.LORA:  # its save is an adapter folder on the checkpoint
            local = LocalTrainer(model_path, config, steps_done=steps_done)
            if resume is not None:
                local.load_adapter(resume)
        else:
            local = LocalTrainer(resume or model_path, config, steps_done=steps_done)
        if resume is not None and (resume / OPTIMIZER_FILE).exists():
            local.load_state_dict(torch.load(resume / OPTIMIZER_FILE, weights_only=True))
        return local, None
    from client.model import AutoDistributedModelForCausalLM
    from client.training.trainer import SwarmTrainer

    model = AutoDistributedModelForCausalLM.from_pretrained(
        str(model_path),
        initial_peers=args.initial_peers,
        dht_prefix=args.dht_prefix,
        dtype=torch.float32,
        swarm_key=swarm_key,
        wire_dtype=args.wire_dtype,
    )
    try:
        if resume is not None:
            from client.training.export import TRAINER_FILE

            _load_local_parts(model, resume / TRAINER_FILE)
        trainer = SwarmTrainer(model, config)
        if resume is not None and (resume / OPTIMIZER_FILE).exists():
            trainer.load_state_dict(torch.load(resume / OPTIMIZER_FILE, weights_only=True))
        return trainer, model
    except BaseException:
        model.shutdown()
        raise


def _train(trainer, batches, args, first: int) -> None:
    from tqdm import tqdm

    log = open(args.log_json, "a") if args.log_json else None  # noqa: SIM115 (closed in the finally below)
    try:
        bar = tqdm(range(first, first + args.steps), disable=args.no_progress, unit="step", file=sys.stderr)
        for step in bar:
            result = trainer.step(next(batches))
            tokens_per_s = result.tokens / result.seconds if result.seconds > 0 else 0.0
            epochs = " ".join(f"{s}-{e}:{n}" for (s, e), n in sorted(result.stage_epochs.items()))
            bar.set_postfix_str(
                f"loss {result.loss:.4f}, {tokens_per_s:.0f} tok/s" + (f", updates {epochs}" if epochs else "")
            )
            if log is not None:
                log.write(
                    json.dumps(
                        {
                            "step": step,
                            "loss": result.loss,
                            "samples": result.samples,
                            "tokens_per_s": tokens_per_s,
                            # what every stage and the trainers really applied in this step's update
                            "stage_samples": {f"{s}:{e}": n for (s, e), n in sorted(result.stage_samples.items())},
                            "trainer_samples": result.trainer_samples,
                            "faults": result.faults,
                            "phases": result.phases,
                        }
                    )
                    + "\n"
                )
                log.flush()
            if args.no_progress:
                logger.info("step %d: loss %.4f, %.0f tokens/s %s", step, result.loss, tokens_per_s, epochs)
            args.last_step = step
    finally:
        if log is not None:
            log.close()


def _save(save: Path, trainer, batches, args) -> None:
    """The trainer's part of the model and where the data stands; the peers save their own (--save-dir)."""
    from safetensors.torch import save_file

    from client.training.export import OPTIMIZER_FILE, TRAINER_FILE

    save.mkdir(parents=True, exist_ok=True)
    if args.local:
        trainer.save_pretrained(save)
    else:
        model = trainer.model
        tensors = model.local_tensors()
        if model.lm_head.weight is model.model.embed_tokens.weight:
            tensors.pop("lm_head.weight")
        save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()}, str(save / TRAINER_FILE))
    import torch

    tmp = save / (OPTIMIZER_FILE + ".tmp")
    torch.save(trainer.state_dict(), tmp)
    tmp.replace(save / OPTIMIZER_FILE)
    step = getattr(args, "last_step", None)
    if step is not None:
        (save / STATE_FILE).write_text(json.dumps({"step": step, "data": batches.state_dict()}))
    logger.info("saved the trainer's state to %s", save)


def _load_local_parts(model, file: Path) -> None:
    import torch
    from safetensors.torch import load_file

    tensors = load_file(str(file))
    with torch.no_grad():
        for name, tensor in model.local_tensors().items():
            if name in tensors:  # a tied head is saved once, as the embeddings
                tensor.copy_(tensors[name])
