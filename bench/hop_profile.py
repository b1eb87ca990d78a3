"""Where each millisecond of a decode step over the swarm goes, hop by hop, next to the local model's step.

One model's blocks split over N fresh peers on 127.0.0.1 (bench.harness), one inference session, batch 1,
greedy, the client sending every hop's step itself (forward_steps=False: one request, one answer per hop).
Per decode step, means over all steps of all rounds:

    client embed+head  embeddings, final norm, LM head and argmax, in this process
    client pack        building and packing each hop's request (client/session.py HopTimings.pack_s)
    per hop            the peer's parse, wait, compute, reply (peer/timings.py, from its Info before and after),
                       and transport: the client's rpc time to that hop less those four phases (gRPC on both
                       sides, loopback, reading the messages, the peer's session queue, event loop scheduling)
    client check       checking each answer and casting its hidden states
    unaccounted        the step less all of the above (the session's own bookkeeping, the hand-off from the
                       caller's thread to the client's event loop and back)

Beside them: the same step through `model(token)` in an inference session (what bench/scenarios/decode.py
times), the local Hugging Face model's whole step, and each hop's blocks computed in this process (the local
model's layers run as a peer runs them, peer/blocks.py BlockSpan). Rounds alternate local and swarm runs.
Not measured: prefill, batches, concurrent sessions, steps pushed peer to peer, delayed links (the scenarios
decode, prefill, concurrency and wan do). A machine shared with other work makes every figure noisy.

Peers run with OMP_WAIT_POLICY=PASSIVE (bench.plan). Run this process with it too when other work shares the
cores: otherwise the local model's OpenMP threads spin against that work, and its step took 10x longer in one
run (tiny, 2 cores). The section's title says which policy this process had.

    python -m bench.hop_profile [--config tiny|small|default] [--peers 3] [--steps 64] [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench import models
from bench.harness import ModelRun, peer_infos
from bench.load import OutsideLoad
from bench.plan import preset
from bench.scenarios.decode import decode_local, decode_swarm, prompt_ids
from client.session import HopTimings, InferenceSession
from peer.blocks import BlockSpan
from protocol import swarmlm_pb2 as pb

FIGURE = Path(__file__).resolve().parent / "figures" / "hop_profile.md"
PHASES = ("parse_s", "wait_s", "compute_s", "reply_s")
HEAD = """# Where a decode step's milliseconds go

`python -m bench.hop_profile --config CONFIG --peers N`: one section per config and peer count, replaced when
rerun. What each part is: the docstring of bench/hop_profile.py; the peer's phases: peer/timings.py.
"""


async def _peer_timings(client) -> dict[str, pb.InfoResponse.StepTimings]:
    """Each online peer's step timings since its start, by peer id."""
    return {peer_id: info.step_timings for peer_id, info in (await peer_infos(client)).items()}


def _profiled_round(client, prompt: torch.Tensor, steps: int, acc: dict) -> None:
    """One session's greedy decode, each step's parts timed; sums go into `acc`."""
    length = prompt.shape[1]
    session = InferenceSession(client.sequence, length + steps + 1, batch_size=1)
    embed = client.model.embed_tokens
    try:
        with torch.inference_mode():
            out = client._run(session.step(embed(prompt), None, torch.arange(length).unsqueeze(0)))  # prefill
            token = client.head(out[:, -1:]).argmax(-1)
            hops_before = {k: dataclasses.replace(v) for k, v in session.hop_timings.items()}
            peers_before = client._run(_peer_timings(client))
            for i in range(steps):
                positions = torch.tensor([[length + i]])
                began = time.perf_counter()
                hidden = embed(token)
                sent = time.perf_counter()
                out = client._run(session.step(hidden, None, positions))
                back = time.perf_counter()
                token = client.head(out[:, -1:]).argmax(-1)
                ended = time.perf_counter()
                acc["embed_head"] += (sent - began) + (ended - back)
                acc["steps"].append(ended - began)
            peers_after = client._run(_peer_timings(client))
        for span in session.spans:
            peer_id = span.hop.peer_id
            hop = acc["hops"].setdefault(
                peer_id,
                {
                    "blocks": (span.hop.start, span.hop.end),
                    "peer_steps": 0,
                    **dict.fromkeys(PHASES, 0.0),
                    "client": HopTimings(),
                },
            )
            then, now = peers_before.get(peer_id, pb.InfoResponse.StepTimings()), peers_after[peer_id]
            hop["peer_steps"] += now.steps - then.steps
            for phase in PHASES:
                hop[phase] += getattr(now, phase) - getattr(then, phase)
            before, after, mine = hops_before.get(peer_id, HopTimings()), session.hop_timings[peer_id], hop["client"]
            for name in ("steps", "pack_s", "rpc_s", "check_s"):
                setattr(mine, name, getattr(mine, name) + getattr(after, name) - getattr(before, name))
    finally:
        client._run(session.close())


def _local_blocks(reference, spans: list[tuple[int, int]], prompt: torch.Tensor, tokens: list[int]) -> dict:
    """Seconds of each span's blocks per decode step, computed here as a peer computes them."""
    model, length, found = reference.model, prompt.shape[1], {}
    with torch.inference_mode():
        for start, end in spans:
            span = BlockSpan(reference.config, start, end, model.layers[start:end], model.rotary_emb)
            cache = span.new_cache()
            span(model.embed_tokens(prompt), None, None, cache, 0)
            times = []
            for i, token in enumerate(tokens):
                hidden = model.embed_tokens(torch.tensor([[token]]))
                began = time.perf_counter()
                span(hidden, None, torch.tensor([[length + i]]), cache, length + i)
                times.append(time.perf_counter() - began)
            found[(start, end)] = times
    return found


def measure(model_run: ModelRun, peers: int, steps: int, rounds: int) -> dict:
    model, plan = model_run.model, model_run.plan
    prompt = prompt_ids(model.config.vocab_size, plan.decode_prompt)
    acc = {"embed_head": 0.0, "steps": [], "hops": {}}
    local, facade, blocks = [], [], {}
    with model_run.split(peers) as split:
        client = split.client
        # on loopback "auto" sends every hop from the client already; False makes sure of it
        client.sequence.config = dataclasses.replace(client.sequence.config, forward_steps=False)
        reference = model_run.reference
        decode_local(reference, prompt, min(8, steps), plan.device)  # warm-up of all three paths
        decode_swarm(client, prompt, min(8, steps))
        _profiled_round(client, prompt, min(8, steps), {"embed_head": 0.0, "steps": [], "hops": {}})
        with OutsideLoad() as load:
            for _ in range(rounds):
                times, tokens = decode_local(reference, prompt, steps, plan.device)
                local += times
                _profiled_round(client, prompt, steps, acc)
                facade += decode_swarm(client, prompt, steps)[0]
                for span, times in _local_blocks(reference, split.spans, prompt, tokens).items():
                    blocks.setdefault(span, []).extend(times)
    return {
        "acc": acc,
        "local": local,
        "facade": facade,
        "blocks": blocks,
        "outside_cores": load.cores,
        "spans": split.spans,
    }


def table(result: dict, title: str) -> str:
    """The markdown section of one run: milliseconds per decode step."""
    acc, n = result["acc"], len(result["acc"]["steps"])

    def ms(seconds: float, count: int = n) -> float:
        return 1e3 * seconds / max(1, count)

    step, local, facade = (
        ms(sum(acc["steps"])),
        ms(sum(result["local"]), len(result["local"])),
        ms(sum(result["facade"]), len(result["facade"])),
    )
    hops = sorted(acc["hops"].values(), key=lambda h: h["blocks"])
    pack, check = sum(ms(h["client"].pack_s) for h in hops), sum(ms(h["client"].check_s) for h in hops)
    parts = [("client embed + head", ms(acc["embed_head"])), (f"client pack ({len(hops)} requests)", pack)]
    per_hop = [
        "| hop | peer steps | client rpc | peer parse + wait + compute + reply | transport | "
        "same blocks computed here |",
        "|---|---|---|---|---|---|",
    ]
    for hop in hops:
        name = f"hop {hop['blocks'][0]}:{hop['blocks'][1]}"
        peer = [ms(hop[phase], hop["peer_steps"]) for phase in PHASES]
        rpc = ms(hop["client"].rpc_s, hop["client"].steps)
        parts += [(f"{name} peer {phase[:-2]}", value) for phase, value in zip(PHASES, peer)]
        parts.append((f"{name} transport", rpc - sum(peer)))
        here = 1e3 * statistics.fmean(result["blocks"][hop["blocks"]])
        per_hop.append(
            f"| {name} | {hop['peer_steps']} | {rpc:.3f} | {sum(peer):.3f} | {rpc - sum(peer):.3f} | {here:.3f} |"
        )
    parts.append((f"client check ({len(hops)} answers)", check))
    parts.append(("unaccounted (session bookkeeping, thread hand-offs)", step - sum(v for _, v in parts)))
    blocks_here = sum(1e3 * statistics.fmean(t) for t in result["blocks"].values())
    lines = [
        f"## {title}",
        "",
        f"{n} decode steps, batch 1; means in ms per step; other processes kept "
        f"{result['outside_cores'] or 0:.2f} cores busy meanwhile.",
        "",
        "| part of a decode step | ms | share of the step |",
        "|---|---|---|",
        *(f"| {name} | {value:.3f} | {value / step:.1%} |" for name, value in parts),
        f"| **swarm step, as timed above** | **{step:.3f}** | {step / local:.2f}x local |",
        f"| swarm step through `model(token)` (as bench decode) | {facade:.3f} | {facade / local:.2f}x local |",
        f"| **local HF model, whole step** | **{local:.3f}** | |",
        f"| local HF model's blocks alone, as the peers compute them | {blocks_here:.3f} | |",
        "",
        "Per hop (transport = client rpc - the peer's four phases):",
        "",
        *per_hop,
        "",
    ]
    return "\n".join(lines)


def write_section(path: Path, section: str, head: str = HEAD) -> None:
    """Put `section` in the markdown file at `path`, replacing the section of the same title; a new file starts
    with `head`."""
    title = section.splitlines()[0]
    sections: list[str] = []
    if path.is_file():
        text = path.read_text()
        head, *rest = text.split("\n## ")
        sections = ["## " + s.rstrip("\n") + "\n" for s in rest]
    sections = [s for s in sections if s.splitlines()[0].split(" (")[0] != title.split(" (")[0]] + [section]
    path.write_text(head.rstrip("\n") + "\n\n" + "\n".join(sections))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.hop_profile", description=__doc__.splitlines()[0])
    p.add_argument("--config", choices=models.MODELS, default="tiny")
    p.add_argument("--peers", type=int, default=3)
    p.add_argument("--steps", type=int, default=64, help="decode steps per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each local, swarm profiled, swarm model(token)")
    p.add_argument("--out", type=Path, default=FIGURE, help="markdown file to put the table in")
    p.add_argument("--cache-dir", type=Path, help="swarmlm cache (default: $SWARMLM_CACHE_DIR or ~/.cache/swarmlm)")
    p.add_argument("--models-dir", type=Path, help="where random models are built (default: CACHE/bench-models)")
    args = p.parse_args(argv)
    if min(args.peers, args.steps, args.rounds) < 1:
        p.error("--peers, --steps and --rounds must be >= 1")
    logging.basicConfig(
        level=os.environ.get("SWARMLM_LOG_LEVEL", "WARNING").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    from swarm.paths import default_cache_dir

    cache_dir = args.cache_dir or Path(os.environ.get("SWARMLM_CACHE_DIR") or default_cache_dir())
    plan = preset(quick=True, device="cpu").replace(
        configs=(args.config,), decode_steps=args.steps, peer_threads=torch.get_num_threads()
    )
    model = models.resolve(
        args.config,
        models_dir=args.models_dir or cache_dir / "bench-models",
        cache_dir=cache_dir,
        dtype=plan.dtype,
        device=plan.device,
    )
    log_dir = Path(tempfile.mkdtemp(prefix="hop-profile-"))
    with ModelRun(model, plan, log_dir) as model_run:
        result = measure(model_run, args.peers, args.steps, args.rounds)
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    section = table(
        result,
        f"{args.config}, {args.peers} peers ({model.description}; run of {when}, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}, float32, {plan.peer_threads} "
        f"threads per peer and here, OMP_WAIT_POLICY here "
        f"{os.environ.get('OMP_WAIT_POLICY', 'unset')})",
    )
    print(section)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_section(args.out, section)
    print(f"written to {args.out} (peer logs in {log_dir})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
