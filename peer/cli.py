"""`swarmlm peer MODEL ...`: flags -> PeerConfig -> a running PeerServer until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math

from peer.admission import WorkLimits
from peer.config import DTypeChoice, PeerConfig, QuantizeChoice, ServingLimits, TrainingConfig, TransportMode
from protocol.errors import SwarmError
from protocol.vocab import Offload, TrainMode, choices
from swarm.runtime import run_until_signal, wait_for_signal
from swarm.training.recipe import RunRecipe
from swarm.training.settings import (
    add_averaging_arguments,
    add_recipe_arguments,
    averaging_from_args,
    recipe_arguments,
)
from swarm.trust.swarmkey import SWARM_KEY_HELP, load_optional

logger = logging.getLogger(__name__)


def _span(text: str) -> tuple[int, int]:
    try:
        start, end = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected START:END (e.g. 0:10), got {text!r}") from None
    return start, end


def _size(text: str) -> int:
    from peer.offload import parse_size  # torch: only once a size is given

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _adapter(text: str) -> tuple[str, str]:
    name, sep, folder = text.partition("=")
    if not sep or not name or not folder:
        raise argparse.ArgumentTypeError(f"expected NAME=DIR (e.g. poems=adapters/poems), got {text!r}")
    return name, folder


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Serve a span of a model's blocks to the swarm.")
    p.add_argument("model", help="Hugging Face checkpoint folder, or a hub id already in the local cache")
    p.add_argument("--initial-peers", nargs="+", default=[], metavar="MADDR", help="multiaddrs to join through")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--blocks", type=_span, metavar="START:END", help="serve blocks [START, END)")
    which.add_argument("--num-blocks", type=int, metavar="N", help="serve N blocks where the swarm is weakest")
    p.add_argument("--dht-prefix", help="name of the model in the DHT (default: derived from MODEL)")
    p.add_argument("--swarm-key", metavar="FILE", help=SWARM_KEY_HELP)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    p.add_argument(
        "--dtype",
        default=DTypeChoice.AUTO.value,
        choices=choices(DTypeChoice),
        help="compute dtype (default: the checkpoint's)",
    )
    p.add_argument(
        "--quantize",
        default=QuantizeChoice.NONE.value,
        choices=choices(QuantizeChoice),
        help="hold the blocks' linear weights as int8 (a quarter of float32's memory) or nf4 (about a seventh); "
        "only clients that ask for that quantization use the peer; auto: the least rounding at which the blocks "
        "asked for fit in --memory-budget or half the free memory (the peer logs how many fit at each) "
        "(default: none)",
    )
    p.add_argument(
        "--expert-cache",
        type=int,
        default=0,
        metavar="N",
        help="mixture-of-experts models: keep N experts of each layer on the device, the rest where "
        "--expert-store says, brought in when the router picks them (default: 0, every expert resident)",
    )
    p.add_argument(
        "--expert-store",
        choices=("host", "disk"),
        default="host",
        help="with --expert-cache: where the experts off the device wait: host memory, or files under the cache "
        "dir, read when picked, so that host memory holds N experts a layer (default: host)",
    )
    p.add_argument(
        "--expert-prefetch",
        action="store_true",
        help="with --expert-cache: bring in the experts the next layer's router would pick before it runs, "
        "guessed from the hidden state entering the layer before: a higher hit rate but more copies, on a GPU "
        "beside the compute (default: off; measured by `swarmlm bench --scenarios moe`)",
    )
    p.add_argument(
        "--adapters",
        nargs="+",
        type=_adapter,
        default=[],
        metavar="NAME=DIR",
        help="also serve these LoRA adapters (peft adapter folders, as swarmlm export --adapter-only writes) under "
        "their names: a client picks one per session (from_pretrained(..., adapter=NAME))",
    )
    p.add_argument(
        "--memory-budget",
        type=_size,
        metavar="SIZE",
        help="bytes of block weights and KV cache resident at once, such as 512MB or 8GB (default: no budget); "
        "blocks beyond it need --offload",
    )
    p.add_argument(
        "--offload",
        default=Offload.NONE.value,
        choices=choices(Offload),
        help="where the blocks that --memory-budget does not hold wait, each loaded while the one before it "
        "computes: host (pinned memory, for a GPU) or disk (a file per block under --cache-dir) (default: none)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on and announce (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="gRPC port (default: a free one)")
    p.add_argument(
        "--announce-host",
        metavar="HOST[:PORT]",
        help="announce this address instead of the one listened on (port forwarding, a proxy)",
    )
    p.add_argument("--dht-port", type=int, default=0, help="DHT port (default: a free one)")
    p.add_argument(
        "--transport",
        default=TransportMode.AUTO.value,
        choices=choices(TransportMode),
        help="how clients reach this peer: direct (gRPC), p2p (gRPC through libp2p streams, through a "
        "relay from behind NAT), or auto: direct if a neighbour can connect to it, else p2p "
        "(default: auto)",
    )
    p.add_argument(
        "--relay",
        action="store_true",
        help="also forward streams to peers behind NAT (for a peer that others can connect to)",
    )
    p.add_argument("--cache-tokens", type=int, default=8192, help="KV-cache budget in tokens (default: 8192)")
    p.add_argument(
        "--alloc-timeout-s", type=float, default=10.0, metavar="S", help="wait for cache space (default: 10)"
    )
    p.add_argument("--session-timeout-s", type=float, default=300.0, metavar="S", help="idle session lifetime")
    p.add_argument("--max-message-mb", type=float, default=64.0, help="largest gRPC message in MiB (default: 64)")
    p.add_argument(
        "--activation-cache-mb",
        type=float,
        default=1024.0,
        help="memory for forward activations kept for their backward, in MiB; 0 recomputes the "
        "forward in every backward (default: 1024)",
    )
    p.add_argument("--update-period-s", type=float, default=30.0, metavar="S", help="re-announce period (default: 30)")
    p.add_argument(
        "--rebalance-period-s",
        type=float,
        default=60.0,
        metavar="S",
        help="how often a peer without --blocks considers moving (default: 60, randomised)",
    )
    p.add_argument(
        "--balance-margin",
        type=float,
        default=0.15,
        help="move only for a bottleneck gain above this fraction (default: 0.15)",
    )
    p.add_argument("--num-threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--throughput", type=float, help="announce this many tokens/s instead of measuring")
    p.add_argument("--cache-dir", help="where measurements and the peer's key are kept (default: ~/.cache/swarmlm)")
    p.add_argument(
        "--identity",
        metavar="FILE",
        help="the peer's key file, created if missing (default: a free one under CACHE_DIR/identity)",
    )
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        default=2048,
        metavar="N",
        help="tokens of one inference forward: concurrent sessions' decode steps are batched up to it, "
        "a longer prefill runs in chunks of it between them (default: 2048)",
    )
    add_limit_arguments(p)
    add_training_arguments(p)
    return p


def add_limit_arguments(p: argparse.ArgumentParser) -> None:
    w, d = p.add_argument_group("limits (what one client may ask of this peer)"), WorkLimits()
    w.add_argument(
        "--max-request-tokens",
        type=int,
        default=d.max_request_tokens,
        metavar="N",
        help=f"tokens (batch x new tokens) in one request (default: {d.max_request_tokens})",
    )
    w.add_argument(
        "--max-attention-cost",
        type=int,
        default=d.max_attention_cost,
        metavar="N",
        help=f"batch x new tokens x attended tokens of one request (default: {d.max_attention_cost})",
    )
    w.add_argument(
        "--max-queued-tokens",
        type=int,
        default=d.max_queued_tokens,
        metavar="N",
        help=f"tokens of the requests waiting for compute; beyond, new ones are refused at once "
        f"(default: {d.max_queued_tokens})",
    )
    w.add_argument(
        "--max-queued-mb",
        type=float,
        default=d.max_queued_bytes / 2**20,
        metavar="MB",
        help=f"input MiB of the requests waiting for compute (default: {d.max_queued_bytes // 2**20})",
    )
    w.add_argument(
        "--session-lifetime-s",
        type=float,
        default=3600.0,
        metavar="S",
        help="close a session this long after it opened, however active (default: 3600)",
    )
    w.add_argument(
        "--max-cache-share",
        type=float,
        default=0.5,
        metavar="F",
        help="share of --cache-tokens that one client address, or all clients tunneled through libp2p together, "
        "may hold (default: 0.5)",
    )
    w.add_argument(
        "--max-concurrent-rpcs",
        type=int,
        default=1024,
        metavar="N",
        help="calls served at once, each inference stream counting as one; beyond, new calls are refused "
        "(default: 1024)",
    )
    w.add_argument(
        "--write-timeout-s",
        type=float,
        default=30.0,
        metavar="S",
        help="close a session whose client does not read a response for this long (default: 30)",
    )
    w.add_argument(
        "--open-timeout-s",
        type=float,
        default=10.0,
        metavar="S",
        help="close an inference stream that opens no session within this long (default: 10)",
    )
    w.add_argument(
        "--max-streams-per-source",
        type=int,
        default=256,
        metavar="N",
        help="inference streams one client address (all clients tunneled through libp2p together) may hold at "
        "once; beyond, new ones are refused (default: 256)",
    )


def work_limits_from_args(args: argparse.Namespace) -> WorkLimits:
    return WorkLimits(
        max_request_tokens=args.max_request_tokens,
        max_attention_cost=args.max_attention_cost,
        max_queued_tokens=args.max_queued_tokens,
        max_queued_bytes=int(args.max_queued_mb * 2**20),
    )


def serving_from_args(args: argparse.Namespace) -> ServingLimits:
    return ServingLimits(
        alloc_timeout_s=args.alloc_timeout_s,
        session_timeout_s=args.session_timeout_s,
        session_lifetime_s=args.session_lifetime_s,
        write_timeout_s=args.write_timeout_s,
        open_timeout_s=args.open_timeout_s,
        max_streams_per_source=args.max_streams_per_source,
        max_batch_tokens=args.max_batch_tokens,
        activation_cache_bytes=math.floor(args.activation_cache_mb * 2**20),  # floor: a negative size stays one
        work=work_limits_from_args(args),
    )


def add_training_arguments(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("training (with --train; needs --blocks)")
    t.add_argument("--train", action="store_true", help="train the served blocks with the peers of the same span")
    t.add_argument("--run-id", default="default", help="training run to join (default: default)")
    # the run's recipe: None unless given, so that a peer adopts the run's settings (swarm/training/recipe.py)
    add_recipe_arguments(t)
    d = RunRecipe()
    t.add_argument(
        "--target-batch-size",
        type=int,
        help=f"samples per update, all trainers together (default: the run's; {d.batch_size} when starting one)",
    )
    t.add_argument(
        "--train-mode",
        choices=choices(TrainMode),
        help=f"full weights, or LoRA adapters of the linear layers (default: the run's; {d.train_mode} when "
        f"starting one)",
    )
    t.add_argument(
        "--lora-rank",
        type=int,
        help=f"rank of the LoRA adapters (default: the run's; {d.lora_rank} when starting one)",
    )
    add_averaging_arguments(t)
    t.add_argument("--save-dir", help="save the span's training state here, and resume from it on restart")
    t.add_argument(
        "--save-every",
        type=int,
        default=0,
        metavar="N",
        help="save every N updates (default: 0, only when the peer stops)",
    )


def training_from_args(args: argparse.Namespace) -> TrainingConfig | None:
    if not args.train:
        return None
    return TrainingConfig(
        run_id=args.run_id,
        **recipe_arguments(args),
        target_batch_size=args.target_batch_size,
        mode=args.train_mode,
        lora_rank=args.lora_rank,
        averaging=averaging_from_args(args),
        save_dir=args.save_dir,
        save_every=args.save_every,
    )


def config_from_args(args: argparse.Namespace) -> PeerConfig:
    return PeerConfig(
        model=args.model,
        initial_peers=tuple(args.initial_peers),
        blocks=args.blocks,
        num_blocks=args.num_blocks,
        dht_prefix=args.dht_prefix,
        host=args.host,
        port=args.port,
        announce_host=args.announce_host,
        dht_port=args.dht_port,
        transport=TransportMode(args.transport),
        relay=args.relay,
        device=args.device,
        dtype=DTypeChoice(args.dtype),
        quantization=QuantizeChoice(args.quantize),
        adapters=_named(args.adapters),
        expert_cache=args.expert_cache,
        expert_prefetch=args.expert_prefetch,
        expert_store=args.expert_store,
        memory_budget=args.memory_budget,
        offload=Offload(args.offload),
        cache_tokens=args.cache_tokens,
        max_cache_share=args.max_cache_share,
        serving=serving_from_args(args),
        max_message_bytes=int(args.max_message_mb * 1024 * 1024),
        max_concurrent_rpcs=args.max_concurrent_rpcs,
        update_period_s=args.update_period_s,
        rebalance_period_s=args.rebalance_period_s,
        balance_margin=args.balance_margin,
        num_threads=args.num_threads,
        throughput=args.throughput,
        cache_dir=args.cache_dir,
        identity_path=args.identity,
        training=training_from_args(args),
        swarm_key=load_optional(args.swarm_key),
    )


def _named(adapters: list[tuple[str, str]]) -> dict[str, str]:
    names = [name for name, _ in adapters]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"--adapters names {repeated} more than once; give each adapter its own name")
    return dict(adapters)


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None

    from peer.server import PeerServer  # torch, transformers, hivemind: only once the flags are known good

    async def main() -> int:
        try:
            server = PeerServer(config)  # reads the adapter folders: a wrong one stops it before it joins
        except ValueError as exc:
            logger.error("%s", exc)
            return 1
        try:
            # the DHT process runs in a process group of its own (swarm/dht/node.py): a signal to our group
            # (Ctrl+C, kill -TERM -PGID) leaves it running, so shutdown() can still announce OFFLINE
            await server.join_swarm()
            started = asyncio.create_task(server.start())
            stop = asyncio.create_task(wait_for_signal())
            done, _ = await asyncio.wait({started, stop}, return_when=asyncio.FIRST_COMPLETED)
            if started in done:
                started.result()  # raise a startup failure
                await stop
            else:
                started.cancel()
        except (SwarmError, ValueError, OSError) as exc:
            logger.error("%s", exc)
            return 1
        finally:
            await server.shutdown()
        return 0

    return run_until_signal(main)
