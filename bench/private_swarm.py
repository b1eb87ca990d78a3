"""`python -m bench.private_swarm`: what a private swarm (`--swarm-key`) costs per decode step, against a public one.

Two swarms in one run, each a bootstrap node and two peers splitting the blocks of the same random model, so a
token crosses two gRPC calls: one public, one private (TLS, per-call tags, the DHT authorizer). Each generates
the same greedy tokens in rounds that alternate between them; the report is the median time per decoded token and
the private/public ratio. A benchmark, never a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.models import RANDOM_SPECS, build_random
from client.demo.local_swarm import LocalSwarm, split_blocks
from client.model import AutoDistributedModelForCausalLM
from swarm.trust.swarmkey import SwarmKey, create_key_file


def _swarm(workdir: Path, model: Path, num_blocks: int, key_file: str | None) -> tuple[LocalSwarm, object]:
    swarm = LocalSwarm(workdir / ("private" if key_file else "public"), swarm_key_file=key_file)
    swarm.start_bootstrap()
    spans = split_blocks(num_blocks, 2)
    for i, (start, end) in enumerate(spans):
        swarm.start_peer(
            f"peer{i}", str(model), "--blocks", f"{start}:{end}", "--throughput", "1000", "--num-threads", "1"
        )
    swarm.wait_online(str(model), num_blocks, spans, timeout_s=180)
    client = AutoDistributedModelForCausalLM.from_pretrained(
        str(model), initial_peers=swarm.initial_peers, swarm_key=None if key_file is None else SwarmKey.load(key_file)
    )
    return swarm, client


def _per_token_s(client, ids: torch.Tensor, new_tokens: int) -> float:
    with client.inference_session(max_length=ids.shape[1] + new_tokens + 1):
        client.generate(ids[:, :1], max_new_tokens=1, do_sample=False)  # the session's streams are open now
        began = time.perf_counter()
        client.generate(ids, max_new_tokens=new_tokens, do_sample=False)
        return (time.perf_counter() - began) / new_tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", choices=sorted(RANDOM_SPECS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=32)
    args = p.parse_args()
    torch.set_num_threads(1)
    workdir = Path(tempfile.mkdtemp(prefix="swarmlm-private-bench-"))
    model = build_random(args.model, workdir / "models")
    num_blocks = RANDOM_SPECS[args.model]["num_hidden_layers"]
    create_key_file(workdir / "swarm.key")
    started = []
    try:
        for key_file in (None, str(workdir / "swarm.key")):
            started.append(_swarm(workdir, model, num_blocks, key_file))
        ids = torch.randint(3, 1000, (1, 8), generator=torch.Generator().manual_seed(0))
        times: dict[str, list[float]] = {"public": [], "private": []}
        outputs = {}
        for _ in range(args.rounds):
            for name, (_, client) in zip(times, started):
                times[name].append(_per_token_s(client, ids, args.new_tokens))
                outputs[name] = client.generate(ids, max_new_tokens=8, do_sample=False).tolist()
        public, private = (statistics.median(times[name]) * 1e3 for name in ("public", "private"))
        print(f"model {args.model} ({num_blocks} blocks over 2 peers), {args.rounds} rounds x {args.new_tokens} tokens")
        print(f"public:  {public:.2f} ms/token  (rounds: {', '.join(f'{t * 1e3:.2f}' for t in times['public'])})")
        print(f"private: {private:.2f} ms/token  (rounds: {', '.join(f'{t * 1e3:.2f}' for t in times['private'])})")
        print(f"private / public: {private / public:.3f}; same tokens: {outputs['public'] == outputs['private']}")
    finally:
        for swarm, client in started:
            client.shutdown()
            swarm.stop()


if __name__ == "__main__":
    main()
