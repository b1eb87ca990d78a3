"""`swarmlm api`: an OpenAI-compatible HTTP server on top of one swarm client.

Flags are checked before anything heavy is imported; the port is bound before the model and the DHT are
loaded, so a port in use or a wrong model is said at once. The line `swarmlm api: serving ... at URL` on stdout
says the server is ready.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import sys

from protocol.records import ADAPTER_NAME_PATTERN
from protocol.vocab import DType, Quantization, choices
from swarm.extras import require_extra
from swarm.trust.swarmkey import SWARM_KEY_HELP, load_optional

API_KEY_ENV = "SWARMLM_API_KEY"


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Serve a model of the swarm over an OpenAI-compatible HTTP API "
        "(/v1/models, /v1/completions, /v1/chat/completions, /health, /metrics).",
    )
    p.add_argument(
        "model",
        help="checkpoint folder, a hub id in the local cache, or SmolLM2-135M-Instruct (the "
        "built-in model); its embeddings, head and tokenizer are loaded here",
    )
    p.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR", help="multiaddrs to join through")
    p.add_argument("--dht-prefix", help="name of the model in the DHT (default: derived from MODEL)")
    p.add_argument("--swarm-key", metavar="FILE", help=SWARM_KEY_HELP)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default: 8000; 0: a free one)")
    p.add_argument(
        "--api-key",
        metavar="KEY",
        help=f"require `Authorization: Bearer KEY` on /v1 (default: ${API_KEY_ENV} if set, else open)",
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=8,
        metavar="N",
        help="generations at once, one inference session each (default: 8)",
    )
    p.add_argument(
        "--max-queued",
        type=int,
        default=32,
        metavar="N",
        help="requests waiting for a slot beyond those; more get 429 at once (default: 32)",
    )
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=256,
        metavar="N",
        help="tokens a chat request gets when it sets no max_tokens (default: 256)",
    )
    p.add_argument("--max-body-mb", type=float, default=4.0, metavar="MB", help="largest request body (default: 4)")
    p.add_argument(
        "--wait-for-peers-s",
        type=float,
        default=10.0,
        metavar="S",
        help="how long a request waits for uncovered blocks to be served before 503 (default: 10)",
    )
    p.add_argument(
        "--request-timeout-s",
        type=float,
        default=60.0,
        metavar="S",
        help="longest wait for one peer's answer before failing over (default: 60)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", *choices(DType)),
        help="dtype of the local embeddings and head (default: the checkpoint's)",
    )
    p.add_argument(
        "--speculative",
        metavar="ngram|MODEL_DIR",
        help="decode every request speculatively: drafts from n-grams of the context (ngram) or from a local model "
        "with the same tokenizer (its folder), several tokens checked per trip through the swarm (default: off)",
    )
    p.add_argument(
        "--draft-tokens",
        type=int,
        default=8,
        metavar="N",
        help="with --speculative: drafts per trip at most (ngram), or at first (a model adapts it) (default: 8)",
    )
    p.add_argument(
        "--quantization",
        default=Quantization.NONE.value,
        choices=choices(Quantization),
        help="use only peers holding their weights so (swarmlm peer --quantize); answers are then the model's with "
        "its linear weights rounded the same way (default: none, the checkpoint's weights)",
    )
    p.add_argument(
        "--adapters",
        nargs="+",
        type=_adapter,
        default=[],
        metavar="NAME[=DIR]",
        help="also serve the model with these LoRA adapters, which peers serve (swarmlm peer --adapters), as models "
        "named MODEL:NAME; DIR: the adapter's folder, needed when it replaces the embeddings or head (default: none)",
    )
    p.add_argument("--cache-dir", help="where the built-in model is converted to (default: ~/.cache/swarmlm)")
    return p


def _adapter(text: str) -> tuple[str, str | None]:
    name, sep, folder = text.partition("=")
    if not name or (sep and not folder):
        raise argparse.ArgumentTypeError(f"expected NAME or NAME=DIR (e.g. poems=adapters/poems), got {text!r}")
    return name, folder or None


def config_from_args(args: argparse.Namespace):
    """ApiConfig from the flags (model_id filled in once the model is known), or SystemExit naming the bad flag."""
    from client.api.config import ApiConfig

    if not 0 <= args.port <= 65535:
        raise SystemExit(f"error: --port must lie in 0..65535, got {args.port}")
    if not args.wait_for_peers_s >= 0 or not args.request_timeout_s > 0 or not args.max_body_mb > 0:
        raise SystemExit(
            f"error: --wait-for-peers-s must be >= 0, --request-timeout-s and --max-body-mb positive, got "
            f"{args.wait_for_peers_s}, {args.request_timeout_s}, {args.max_body_mb}"
        )
    if args.draft_tokens < 1:
        raise SystemExit(f"error: --draft-tokens must be >= 1, got {args.draft_tokens}")
    if args.speculative not in (None, "ngram") and not os.path.isdir(args.speculative):
        raise SystemExit(f"error: --speculative takes ngram or a local model's folder; {args.speculative!r} is neither")
    names = [name for name, _ in args.adapters]
    for name, folder in args.adapters:
        if not re.fullmatch(ADAPTER_NAME_PATTERN, name) or names.count(name) > 1:
            raise SystemExit(
                f"error: --adapters: {name!r} must be a distinct name of 1-64 letters, digits, '_', '.', '-'"
            )
        if folder is not None and not os.path.isdir(folder):
            raise SystemExit(f"error: --adapters {name}={folder}: no such folder")
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    try:
        return ApiConfig(
            model_id="pending",
            api_key=api_key,
            max_concurrency=args.max_concurrency,
            max_queued=args.max_queued,
            default_max_tokens=args.default_max_tokens,
            max_body_bytes=int(args.max_body_mb * 2**20),
        )
    except ValueError as exc:
        flag = str(exc).split(" ", 1)[0].replace("_", "-")
        raise SystemExit(f"error: --{flag}: {exc}") from None


def _check_model_arg(model: str) -> None:
    """A path that does not exist is said at once (a bare name may be the built-in model or a cached hub id)."""
    from pathlib import Path

    looks_like_path = model.startswith((".", "/", "~")) or model.count("/") > 1
    if looks_like_path and not Path(model).expanduser().exists():
        raise SystemExit(
            f"error: model folder {model!r} does not exist; pass a Hugging Face checkpoint folder, a hub "
            f"id in the local cache, or the built-in model's name"
        )


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SystemExit(
            f"error: cannot listen on {host}:{port}: {exc.strerror or exc}; choose another --port (0: a free one)"
        ) from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def _model_path(args: argparse.Namespace):
    from pathlib import Path

    from swarm.models.checkpoint import resolve_model_path
    from swarm.models.default_model import DEFAULT_MODEL, resolve_default_model
    from swarm.paths import default_cache_dir

    if args.model == DEFAULT_MODEL and not Path(args.model).exists():
        return resolve_default_model(Path(args.cache_dir) if args.cache_dir else default_cache_dir())
    return resolve_model_path(args.model)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    require_extra("api", "swarmlm api")  # before the model and the DHT: not an ImportError once they are up
    config = config_from_args(args)
    try:
        swarm_key = load_optional(args.swarm_key)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    _check_model_arg(args.model)
    sock = _bind(args.host, args.port)
    try:
        from protocol.errors import SwarmError

        try:
            return _serve(args, config, swarm_key, sock)
        except (SwarmError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    finally:
        sock.close()


def _drafter(args, model):
    """A function returning a fresh drafter for each generation, as --speculative asks (None: plain decoding)."""
    from client import speculative
    from protocol.errors import BadRequestError, ModelNotFoundError

    if args.speculative is None:
        return None
    if args.speculative == "ngram":
        return lambda: speculative.NgramDrafter(args.draft_tokens)
    from transformers import AutoModelForCausalLM

    try:
        assistant = AutoModelForCausalLM.from_pretrained(args.speculative, dtype=model.lm_head.weight.dtype).eval()
    except Exception as exc:
        raise ModelNotFoundError(
            f"--speculative {args.speculative}: not 'ngram', and no model loads from that folder ({exc})"
        ) from None
    if assistant.config.vocab_size != model.config.vocab_size:
        raise BadRequestError(
            f"--speculative {args.speculative}: its vocabulary ({assistant.config.vocab_size} tokens) is not the "
            f"served model's ({model.config.vocab_size}); draft with a model of the same tokenizer, or with ngram"
        )
    return lambda: speculative.AssistantDrafter(assistant, args.draft_tokens, adapt=True)


def _serve(args, config, swarm_key, sock) -> int:
    import dataclasses

    import uvicorn
    from transformers import AutoTokenizer

    from client.api.app import create_app
    from client.api.engine import SwarmBackend
    from client.model import AutoDistributedModelForCausalLM
    from protocol.errors import ModelNotFoundError, SwarmError
    from protocol.records import prefix_for_model

    path = _model_path(args)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise ModelNotFoundError(
            f"cannot load a tokenizer from {path}: {exc}; the API needs the model's "
            f"tokenizer files beside its checkpoint"
        ) from None
    model_id = args.dht_prefix or prefix_for_model(args.model)

    def connect(**options):
        try:
            return AutoDistributedModelForCausalLM.from_pretrained(
                str(path),
                initial_peers=args.initial_peers,
                dht_prefix=args.dht_prefix,
                dtype=args.dtype,
                swarm_key=swarm_key,
                wait_for_peers_s=args.wait_for_peers_s,
                request_timeout_s=args.request_timeout_s,
                quantization=args.quantization,
                **options,
            )
        except (SwarmError, ValueError):
            raise
        except Exception as exc:  # hivemind's daemon errors: say which flag to check, without its traceback
            raise SwarmError(
                f"could not join the swarm through --initial-peers {' '.join(args.initial_peers)}: "
                f"{type(exc).__name__}: {exc}"
            ) from None

    model, adapted = connect(), {}
    try:
        for name, folder in args.adapters:  # a client each: its routes use only the peers serving that adapter
            adapted[name] = connect(adapter=name, adapter_path=folder)
        aliases = tuple({args.model, str(path)} - {model_id})
        config = dataclasses.replace(config, model_id=model_id, aliases=aliases)
        app = create_app(
            SwarmBackend(model, tokenizer, model_id, _drafter(args, model)),
            config,
            {
                name: SwarmBackend(client, tokenizer, f"{model_id}:{name}", _drafter(args, client))
                for name, client in adapted.items()
            },
        )
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5, access_log=False))
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        auth = "API key required" if config.api_key else "no API key"
        print(
            f"swarmlm api: serving {model_id} at http://{shown}:{port}/v1 ({auth}; at most "
            f"{config.max_concurrency} generations at once, {config.max_queued} queued)",
            flush=True,
        )
        # uvicorn stops gracefully on SIGINT/SIGTERM, then raises the signal again: here, so that the client is
        # shut down (its DHT process stopped) on the way out
        signal.signal(signal.SIGTERM, _interrupt)
        server.run(sockets=[sock])
        return 0
    finally:
        for client in (model, *adapted.values()):
            client.shutdown()
