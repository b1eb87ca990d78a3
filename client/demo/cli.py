"""`swarmlm demo`: a whole swarm on this machine (bootstrap, three peers, a client), one chat, then stop.

With --api it serves the swarm instead (client/demo/api.py); with --train it fine-tunes it (client/demo/train.py).

The peers are real processes started through the `swarmlm` CLI on 127.0.0.1; every one of them is
stopped on the way out, also on Ctrl+C or an error.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import tempfile
import time
from pathlib import Path

from client.demo.api import check_ports, run_with_api, start_demo_swarm
from client.demo.local_swarm import LocalSwarm
from protocol.vocab import TrainMode, choices
from swarm.extras import require_extra
from swarm.models.default_model import DEFAULT_MODEL, resolve_default_model
from swarm.net.tunnel import describe_address
from swarm.paths import default_cache_dir
from swarm.trust.swarmkey import load_optional

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 180.0


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Run a whole swarm on this machine, chat with it, then stop.")
    p.add_argument("--model", help=f"checkpoint folder (default: the built-in {DEFAULT_MODEL})")
    p.add_argument(
        "--prompt", default="What is the capital of France? Answer in one sentence.", help="the chat question to ask"
    )
    p.add_argument("--peers", type=int, default=3, help="how many peers split the blocks (default: 3)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="answer length limit (default: 48)")
    p.add_argument("--cache-dir", help="where the default model is converted to (default: ~/.cache/swarmlm)")
    p.add_argument(
        "--swarm-key",
        metavar="FILE",
        help="run the swarm private with this key file (see `swarmlm bootstrap --new-swarm-key`)",
    )
    a = p.add_argument_group("serving (--api)")
    a.add_argument(
        "--api",
        action="store_true",
        help="instead of one chat: serve the swarm over the OpenAI-compatible API and the monitor's "
        "web page on 127.0.0.1, print their URLs, and run until Ctrl+C",
    )
    a.add_argument("--port", type=int, default=8000, help="the API's port (default: 8000; 0: a free one)")
    a.add_argument("--monitor-port", type=int, default=8080, help="the monitor's port (default: 8080; 0: a free one)")
    t = p.add_argument_group("training (--train)")
    t.add_argument(
        "--train",
        action="store_true",
        help="fine-tune the model on Shakespeare with two stages of training peers, then write a line",
    )
    t.add_argument("--steps", type=int, default=30, help="training steps (default: 30)")
    t.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default: 64)")
    t.add_argument("--batch-size", type=int, default=4, help="sequences per step (default: 4)")
    t.add_argument(
        "--train-mode",
        default="lora",
        choices=choices(TrainMode),
        help="what the peers train (default: lora, small enough for a laptop)",
    )
    t.add_argument("--lr", type=float, default=1e-3, help="the run's learning rate, peers and trainer (default: 1e-3)")
    t.add_argument("--train-prompt", default="ROMEO:\n", help="what the trained model continues (default: ROMEO:)")
    return p


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    try:
        swarm_key = load_optional(args.swarm_key)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    if swarm_key is not None and args.train:
        raise SystemExit("error: --swarm-key runs the chat demo only; drop it with --train")
    if args.api:
        if args.train:
            raise SystemExit("error: --api and --train are two different demos; choose one")
        require_extra("api", "swarmlm demo --api")
        check_ports("127.0.0.1", {"--port": args.port, "--monitor-port": args.monitor_port})
    from transformers import AutoTokenizer, TextStreamer

    from client.model import AutoDistributedModelForCausalLM

    # SIGTERM stops the demo like Ctrl+C does: through the cleanup below, not around it
    signal.signal(signal.SIGTERM, _interrupt)
    cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    model_path = Path(args.model) if args.model else resolve_default_model(cache_dir)
    if args.train:
        if args.steps < 1 or args.seq_len < 2 or args.batch_size < 2 or args.batch_size % 2:
            raise SystemExit(
                f"error: --steps must be >= 1, --seq-len >= 2 and --batch-size an even number >= 2, "
                f"got {args.steps}, {args.seq_len}, {args.batch_size}"
            )
        return _run_training(args, model_path, cache_dir)
    if args.api:
        return _run_api(args, model_path, cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    swarm = LocalSwarm(Path(tempfile.mkdtemp(prefix="swarmlm-demo-")), swarm_key_file=args.swarm_key)
    model = None
    try:
        began = time.monotonic()
        maddrs, num_blocks, spans = start_demo_swarm(swarm, model_path, cache_dir, args.peers)
        swarm.wait_online(str(model_path), num_blocks, spans, timeout_s=_START_TIMEOUT_S)
        model = AutoDistributedModelForCausalLM.from_pretrained(
            str(model_path), initial_peers=maddrs, swarm_key=swarm_key
        )
        print(f"swarm ready in {time.monotonic() - began:.1f}s\n")

        messages = [{"role": "user", "content": args.prompt}]
        input_ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        print(f"user: {args.prompt}\nassistant: ", end="", flush=True)
        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        with model.inference_session(max_length=input_ids.shape[1] + args.max_new_tokens) as session:
            started = time.perf_counter()
            output = model.generate(input_ids, max_new_tokens=args.max_new_tokens, do_sample=False, streamer=streamer)
            elapsed = time.perf_counter() - started
            route = [(s.hop.peer_id, s.hop.endpoint, s.hop.start, s.hop.end) for s in session.remote.spans]
        new_tokens = output.shape[1] - input_ids.shape[1]
        print("\nroute:")
        for peer_id, endpoint, start, end in route:
            print(f"  blocks {start:>2}:{end:<2} -> peer {peer_id}, {describe_address(endpoint)}")
        print(f"{new_tokens} tokens in {elapsed:.2f}s ({new_tokens / elapsed:.1f} tokens/s, prefill included)")
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted; stopping the swarm", flush=True)
        return 130
    finally:
        if model is not None:
            model.shutdown()
        swarm.stop()
        print(f"all processes stopped (logs in {swarm.log_dir})")


def _run_api(args: argparse.Namespace, model_path: Path, cache_dir: Path) -> int:
    swarm = LocalSwarm(Path(tempfile.mkdtemp(prefix="swarmlm-demo-api-")), swarm_key_file=args.swarm_key)
    try:
        return run_with_api(args, model_path, cache_dir, swarm)
    except KeyboardInterrupt:
        print("\ninterrupted; stopping the swarm, the API server and the monitor", flush=True)
        return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        swarm.stop()
        print(f"all processes stopped (logs in {swarm.log_dir})", flush=True)


def _run_training(args: argparse.Namespace, model_path: Path, cache_dir: Path) -> int:
    from client.demo.train import run_training

    swarm = LocalSwarm(Path(tempfile.mkdtemp(prefix="swarmlm-demo-train-")))
    try:
        return run_training(args, model_path, cache_dir, swarm)
    except KeyboardInterrupt:
        print("\ninterrupted; stopping the swarm", flush=True)
        return 130
    finally:
        swarm.stop()
        print(f"all processes stopped (logs in {swarm.log_dir})")
