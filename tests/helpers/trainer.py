"""A trainer in a process of its own, for tests that kill it mid-step:

    python tests/helpers/trainer.py CONFIG_JSON

CONFIG_JSON names the model folder, the initial peers, the run id, the batch and micro-batch sizes, the sequence
length, the vocabulary size, the averaging timeout and the number of steps, and may name files to wait for before
some steps ("wait_before": {"2": PATH}), for a test to set up a fault meanwhile. The batches are drawn from a generator
seeded with 0, as a test's reference draws them. After each step it prints "step N done".
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # run as a script: import this repository's packages
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from client import AutoDistributedModelForCausalLM, SwarmTrainer, TrainConfig
from swarm.training.settings import AveragingSettings


def batches(config: dict):
    generator = torch.Generator().manual_seed(0)
    while True:
        yield torch.randint(3, config["vocab_size"], (config["batch"], config["seq_len"]), generator=generator)


def wait_for_file(path: Path, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s:g}s")
        time.sleep(0.05)


def main(argv: list[str]) -> int:
    config = json.loads(argv[0])
    model = AutoDistributedModelForCausalLM.from_pretrained(
        config["model"], initial_peers=config["initial_peers"], dtype=torch.float32
    )
    averaging = AveragingSettings(
        matchmaking_time_s=1.0, averaging_timeout_s=config["averaging_timeout_s"], load_state_timeout_s=20.0
    )
    trainer = SwarmTrainer(
        model,
        TrainConfig(
            run_id=config["run_id"], batch_size=config["batch"], micro_batch_size=config["micro"], averaging=averaging
        ),
    )
    try:
        for step, batch in zip(range(1, config["steps"] + 1), batches(config)):
            if str(step) in config.get("wait_before", {}):
                wait_for_file(Path(config["wait_before"][str(step)]))
            result = trainer.step(batch)
            print(f"step {step} done: loss {result.loss:.6f}", flush=True)
    finally:
        trainer.close()
        model.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
