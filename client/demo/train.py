"""`swarmlm demo --train`: a training swarm on this machine fine-tunes the built-in model on Shakespeare.

A bootstrap node, two stages of training peers (LoRA adapters by default, so it fits a laptop), and a trainer
in this process that holds the embeddings and head; the loss falls step by step, then the same swarm writes
a line. Every process is stopped on the way out, also on Ctrl+C or an error.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from client.demo.local_swarm import LocalSwarm, split_blocks
from client.training.data import Prefetcher, TokenBatches, default_corpus, tokenize_files
from swarm.training.settings import AveragingSettings

_START_TIMEOUT_S = 180.0
# one trainer and one peer per stage: rounds need not wait for anyone
_AVERAGING = AveragingSettings(matchmaking_time_s=1.0, averaging_timeout_s=30.0, load_state_timeout_s=30.0)


def run_training(args, model_path: Path, cache_dir: Path, swarm: LocalSwarm) -> int:
    from transformers import AutoTokenizer

    from client.config import TrainConfig
    from client.model import AutoDistributedModelForCausalLM
    from client.training.trainer import SwarmTrainer
    from swarm.models.checkpoint import load_config

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    num_blocks = load_config(model_path).num_hidden_layers
    spans = split_blocks(num_blocks, 2)
    began = time.monotonic()
    maddrs = swarm.start_bootstrap()
    print(f"bootstrap node: {maddrs[0]}")
    for i, (start, end) in enumerate(spans):
        swarm.start_peer(
            f"peer{i}",
            str(model_path),
            "--blocks",
            f"{start}:{end}",
            "--cache-dir",
            str(cache_dir),
            "--train",
            "--run-id",
            "demo",
            "--train-mode",
            args.train_mode,
            "--lr",
            str(args.lr),
            "--target-batch-size",
            str(args.batch_size),
            "--matchmaking-time-s",
            "1",
        )
        print(f"training peer {i}: blocks {start}:{end} ({args.train_mode})  (log: {swarm.log(f'peer{i}')})")
    batches = Prefetcher(
        TokenBatches(
            tokenize_files(tokenizer, default_corpus()), seq_len=args.seq_len, batch_size=args.batch_size, seed=0
        )
    )
    model = trainer = None
    try:
        swarm.wait_online(str(model_path), num_blocks, spans, timeout_s=_START_TIMEOUT_S)
        model = AutoDistributedModelForCausalLM.from_pretrained(
            str(model_path), initial_peers=maddrs, dtype=torch.float32
        )
        trainer = SwarmTrainer(
            model,
            # no recipe settings: the trainer adopts the run's, which the peers published
            TrainConfig(run_id="demo", batch_size=args.batch_size, micro_batch_size=2, averaging=_AVERAGING),
        )
        print(
            f"swarm ready in {time.monotonic() - began:.1f}s; fine-tuning on Shakespeare "
            f"({args.steps} steps of {args.batch_size}x{args.seq_len} tokens)\n"
        )
        losses = []
        for step in range(1, args.steps + 1):
            result = trainer.step(next(batches))
            losses.append(result.loss)
            print(
                f"step {step:>3}/{args.steps}  loss {result.loss:.3f}  {result.tokens / result.seconds:6.0f} tokens/s"
                f"  stage updates {sorted(result.stage_epochs.values())}",
                flush=True,
            )
        window = max(1, min(5, len(losses) // 4))
        first, last = sum(losses[:window]) / window, sum(losses[-window:]) / window
        print(f"\nloss {first:.3f} -> {last:.3f} (mean of the first and last {window} steps)")
        ids = tokenizer(args.train_prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            output = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        print(f"\n{tokenizer.decode(output[0], skip_special_tokens=True)}")
        return 0
    finally:
        batches.close()
        if trainer is not None:
            trainer.close()
        if model is not None:
            model.shutdown()
