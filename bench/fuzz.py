"""`python -m bench.fuzz`: thousands of mutated requests against one live peer, which must answer each typed.

One peer (a real `swarmlm peer` process on 127.0.0.1, with its bootstrap node, started by LocalSwarm) serves a
tiny random Llama built into a temporary folder. Valid requests of every method (forward, backward, inference
open and step, info, state) are serialized and mutated (bit flips, truncation, duplicated or dropped fields,
giant varints, many payload fields, huge shapes, wrong dtypes and offsets) and sent as raw bytes. Meanwhile an
honest inference session steps on its own channel and must match the local span within 1e-5 (fp32).

Each answer is classed: `ok` (the mutation was still a valid request), `typed` (our error: a gRPC status with
the swarmlm error code in its trailing metadata, or an Error message on the stream), or `untyped` (a status
without the code, INTERNAL/UNKNOWN, an `internal` code, or no answer within the timeout). A peer that exits is
a crash. The peer's RSS is read before and after. Every process is stopped on exit, Ctrl+C included.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import socket
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psutil
import torch

from client.demo.local_swarm import LocalSwarm
from client.transport import ChannelPool, InferenceStream
from peer.blocks import load_span
from protocol import swarmlm_pb2 as pb
from protocol.codec import decode_tensor, encode_tensor
from protocol.errors import SwarmError
from protocol.packing import Packer, field_spans, payload_field
from protocol.records import prefix_for_model
from protocol.service import ERROR_CODE_KEY, METHODS
from swarm.models.checkpoint import load_config

logger = logging.getLogger(__name__)

HIDDEN, LAYERS, HONEST_LENGTH = 64, 2, 24
ATOL = 1e-5
REQUEST_TIMEOUT_S = 20.0
METHOD_NAMES = ("forward", "backward", "open", "step", "info", "state")
_UNTYPED_STATUSES = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)


def build_model(folder: Path) -> Path:
    """A tiny random Llama (hidden 64, GQA 4/2, 2 layers), seeded, saved as safetensors."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=256,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder, safe_serialization=True)
    return folder


# --- valid requests, and their mutations ---


def _hidden(length: int, seed: int) -> torch.Tensor:
    return torch.randn(1, length, HIDDEN, generator=torch.Generator().manual_seed(seed))


def valid_message(method: str, prefix: str, rng: random.Random, session_id: str = "fuzz"):
    """A valid request of `method` (a pb message, or a Packed one when its tensors go in the payload)."""
    span = pb.Span(model=prefix, start=0, end=LAYERS)
    length = rng.choice([1, 3, 200])  # 200 tokens of float32 travel in the payload
    packer = Packer()
    if method in ("forward", "backward"):
        fields = dict(
            span=span,
            hidden_states=packer.tensor(_hidden(length, rng.randrange(1 << 16))),
            position_ids=packer.tensor(torch.arange(length).unsqueeze(0)),
        )
        if method == "backward":
            fields["grad_outputs"] = packer.tensor(_hidden(length, rng.randrange(1 << 16)))
            return packer.pack(pb.BackwardRequest(**fields))
        return packer.pack(pb.ForwardRequest(**fields))
    if method == "open":
        return pb.InferenceRequest(
            open=pb.OpenSession(
                span=span, session_id=f"{session_id}-{rng.randrange(1 << 30)}", max_length=32, batch_size=1
            )
        )
    if method == "step":
        length = min(length, 8)
        return packer.pack(
            pb.InferenceRequest(
                step=pb.InferenceStep(
                    session_id=session_id,
                    hidden_states=packer.tensor(_hidden(length, rng.randrange(1 << 16))),
                    position_ids=packer.tensor(torch.arange(length).unsqueeze(0)),
                    prefix_length=0,
                )
            )
        )
    if method == "info":
        return pb.InfoRequest(param_digest=rng.random() < 0.5)
    return pb.StateRequest(span=span)


def _tensors_of(message) -> list[pb.Tensor]:
    found = []
    for f, value in message.ListFields():
        if f.message_type is not None:
            found.extend([value] if isinstance(value, pb.Tensor) else _tensors_of(value))
    return found


def _bend_tensor(message, rng: random.Random) -> str:
    """Change one tensor's metadata in `message` (in place); the name of what was done."""
    tensors = _tensors_of(message)
    if not tensors:
        return "none"
    tensor = rng.choice(tensors)
    kind = rng.choice(["huge shape", "many dims", "wrong dtype", "float16 of int", "offset", "negative", "dims"])
    if kind == "huge shape":
        tensor.shape[rng.randrange(len(tensor.shape))] = rng.choice([2**31, 2**40, 2**62, 2**63 - 1])
    elif kind == "many dims":
        tensor.shape.extend([1] * rng.choice([6, 100, 5000]))
    elif kind == "wrong dtype":
        tensor.dtype = rng.choice(["int64", "bool", "uint8", "float16", "bfloat16", "float64", "complex64", ""])
    elif kind == "float16 of int":
        tensor.dtype, tensor.compression = rng.choice(["int64", "int32", "bool"]), pb.FLOAT16
    elif kind == "offset":
        tensor.in_payload, tensor.offset = True, rng.choice([1, 3, 63, 64, 2**32, 2**64 - 1])
    elif kind == "negative":
        tensor.shape[rng.randrange(len(tensor.shape))] = -rng.choice([1, 2**63])
    else:
        tensor.shape[:] = [rng.randrange(0, 300) for _ in range(rng.randrange(0, 5))]
    return kind


def mutate(message, rng: random.Random) -> tuple[bytes, str]:
    """Serialized `message`, mutated one way (or, rarely, not at all); and the name of the mutation."""
    kind = rng.choice(
        ["flip", "truncate", "duplicate", "drop", "payloads", "varint", "splice", "tensor", "fields", "none"]
    )
    if kind == "tensor":
        inner = getattr(message, "message", message)
        done = _bend_tensor(inner, rng)
        return message.SerializeToString(), f"tensor: {done}"
    data = message.SerializeToString()
    if kind == "none" or not data:
        return data, "none"
    if kind == "flip":
        out = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
        return bytes(out), kind
    if kind == "truncate":
        return data[: rng.randrange(len(data))], kind
    start, end = rng.choice(field_spans(data))
    if kind == "duplicate":
        return data[:end] + data[start:end] * rng.randint(1, 4) + data[end:], kind
    if kind == "drop":
        return data[:start] + data[end:], kind
    if kind == "payloads":  # one more payload field, or thousands
        copies = rng.choice([1, 2, 1000, 100_000])
        return data[:start] + payload_field(bytes(rng.choice([0, 1, 64]))) * copies + data[start:], kind
    if kind == "varint":
        giant = rng.choice([b"\xff" * 11, b"\x80" * 10 + b"\x01", b"\x7a\xff\xff\xff\xff\x0f", b"\x0a\xff\xff\xff\x7f"])
        return data[:start] + giant + data[start:], kind
    if kind == "fields":  # many unknown varint fields
        return data + bytes([(13 << 3) | 0, 1]) * rng.choice([10, 2000, 200_000]), kind
    return data[:start] + rng.randbytes(rng.randint(1, 40)) + data[start:], kind


# --- classifying the answers ---


@dataclass
class Tally:
    tried: Counter = field(default_factory=Counter)
    outcomes: Counter = field(default_factory=Counter)  # (method, "ok" / "typed" / "untyped")
    untyped: list = field(default_factory=list)  # the first few, described

    def add(self, method: str, outcome: str, mutation: str, detail: str = "") -> None:
        self.tried[method] += 1
        self.outcomes[method, outcome] += 1
        if outcome == "untyped" and len(self.untyped) < 20:
            self.untyped.append(f"{method} ({mutation}): {detail[:300]}")


def _rpc_outcome(exc: grpc.RpcError) -> tuple[str, str]:
    code = dict(exc.trailing_metadata() or ()).get(ERROR_CODE_KEY)
    detail = f"{exc.code().name}: {exc.details()}"
    if code is None and exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # gRPC's own message limit, which
        return "typed", detail  # protocol.service.error_from_rpc rebuilds as MessageTooLargeError
    if code is None or code == "internal" or exc.code() in _UNTYPED_STATUSES:
        return "untyped", f"{detail} (error code {code})"
    return "typed", detail


def _response_outcome(raw: bytes) -> tuple[str, str]:
    response = pb.InferenceResponse.FromString(raw)
    if response.WhichOneof("kind") != "error":
        return "ok", ""
    if response.error.code == "internal" or not response.error.code:
        return "untyped", f"error {response.error.code!r}: {response.error.message}"
    return "typed", response.error.message


async def _ended(call) -> str:
    try:
        return f"{(await call.code()).name}: {await call.details()}"
    except Exception as exc:
        return repr(exc)


def _stream_outcome(raw, sent: bytes) -> tuple[str, str]:
    """An answer on an inference stream; its end is right only when the mutation made `sent` a `close`."""
    if raw is not grpc.aio.EOF:
        return _response_outcome(raw)
    try:
        closing = pb.InferenceRequest.FromString(sent).WhichOneof("kind") == "close"
    except Exception:
        closing = False
    return ("ok", "closed") if closing else ("untyped", "the stream ended without an answer")


# --- the run ---


class Fuzz:
    def __init__(self, endpoint: str, prefix: str, span, seed: int):
        self.endpoint, self.prefix, self.span = endpoint, prefix, span
        self.rng = random.Random(seed)
        self.tally = Tally()
        self.honest_steps, self.honest_max_diff, self.honest_error = 0, 0.0, None
        self.stream = None  # the raw inference stream mutated steps go to

    async def run(self, count: int, deadline: float, alive) -> None:
        channel = grpc.aio.insecure_channel(self.endpoint, options=[("grpc.max_send_message_length", 1 << 26)])
        pool = ChannelPool(1 << 26)
        try:
            honest = InferenceStream(pool, self.endpoint)
            await honest.request(
                pb.InferenceRequest(
                    open=pb.OpenSession(
                        span=pb.Span(model=self.prefix, start=0, end=LAYERS),
                        session_id="honest",
                        max_length=HONEST_LENGTH,
                        batch_size=1,
                    )
                ),
                REQUEST_TIMEOUT_S,
            )
            tokens = _hidden(HONEST_LENGTH, seed=1)
            expected = _stepwise(self.span, tokens)
            self.stream, stream_id, sent = None, None, 0
            while sent < count and time.monotonic() < deadline and alive():
                if sent % 10 == 0:
                    await self._honest_step(honest, tokens, expected)
                method = METHOD_NAMES[sent % len(METHOD_NAMES)]
                if method == "step" and (self.stream is None or sent % 60 == 3):  # a fresh session now and then
                    if self.stream is not None:
                        self.stream.cancel()
                    self.stream, stream_id = await self._fuzz_stream(channel)
                await self._one(channel, method, self.stream if method == "step" else None, stream_id)
                sent += 1
            await self._honest_step(honest, tokens, expected)
            if self.stream is not None:
                self.stream.cancel()
            await honest.close()
        finally:
            await pool.close()
            await channel.close()

    async def _honest_step(self, honest: InferenceStream, tokens, expected) -> None:
        p = self.honest_steps % HONEST_LENGTH
        try:
            response = await honest.request(
                pb.InferenceRequest(
                    step=pb.InferenceStep(
                        session_id="honest",
                        hidden_states=encode_tensor(tokens[:, p : p + 1]),
                        position_ids=encode_tensor(torch.tensor([[p]])),
                        prefix_length=p,
                    )
                ),
                REQUEST_TIMEOUT_S,
            )
            got = decode_tensor(response.message.step.hidden_states, "hidden_states", response.payload)
            diff = (got - expected[:, p : p + 1]).abs().max().item()
        except SwarmError as exc:
            self.honest_error = self.honest_error or f"step {self.honest_steps}: {exc}"
            diff = float("inf")
        self.honest_max_diff = max(self.honest_max_diff, diff)
        self.honest_steps += 1

    async def _fuzz_stream(self, channel):
        """A raw inference stream with a session open on it, for mutated steps."""
        stream = channel.stream_stream(METHODS["Inference"].path)()
        session_id = f"fuzz-{self.rng.randrange(1 << 30)}"
        await stream.write(
            pb.InferenceRequest(
                open=pb.OpenSession(
                    span=pb.Span(model=self.prefix, start=0, end=LAYERS),
                    session_id=session_id,
                    max_length=32,
                    batch_size=1,
                )
            ).SerializeToString()
        )
        await asyncio.wait_for(stream.read(), REQUEST_TIMEOUT_S)
        return stream, session_id

    async def _one(self, channel, method: str, stream, session_id: str | None) -> None:
        message = valid_message(method, self.prefix, self.rng, session_id or "fuzz")
        data, mutation = mutate(message, self.rng)
        try:
            if method == "step":
                await stream.write(data)
                raw = await asyncio.wait_for(stream.read(), REQUEST_TIMEOUT_S)
                outcome, detail = _stream_outcome(raw, data)
                if raw is grpc.aio.EOF:
                    self.stream = None
            elif method == "open":  # each on a stream of its own: a session per stream
                call = channel.stream_stream(METHODS["Inference"].path)()
                await call.write(data)
                raw = await asyncio.wait_for(call.read(), REQUEST_TIMEOUT_S)
                call.cancel()
                outcome, detail = _stream_outcome(raw, data)
            elif method == "state":
                parts = [p async for p in channel.unary_stream(METHODS["State"].path)(data, timeout=REQUEST_TIMEOUT_S)]
                outcome, detail = "ok", f"{len(parts)} parts"
            else:
                await channel.unary_unary(METHODS[method.capitalize()].path)(data, timeout=REQUEST_TIMEOUT_S)
                outcome, detail = "ok", ""
        except grpc.RpcError as exc:
            if method == "step":
                self.stream = None
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                outcome, detail = "untyped", "no answer within the timeout (a hang)"
            else:
                outcome, detail = _rpc_outcome(exc)
        except asyncio.TimeoutError:
            outcome, detail = "untyped", "no answer within the timeout (a hang)"
        except asyncio.InvalidStateError:  # the step stream had ended under an earlier request
            outcome, detail = "untyped", f"the stream had ended: {await _ended(stream)}"
        if method == "step" and outcome == "untyped":
            self.stream = None  # a fresh one for the next step
        self.tally.add(method, outcome, mutation, detail)


def _stepwise(span, tokens: torch.Tensor) -> torch.Tensor:
    """What the honest session must get: one token per step on a growing cache, on one thread as the peer."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cache = span.new_cache()
        with torch.inference_mode():
            return torch.cat(
                [span(tokens[:, i : i + 1], None, torch.tensor([[i]]), cache, i) for i in range(tokens.shape[1])], dim=1
            )
    finally:
        torch.set_num_threads(threads)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mib(pid: int) -> float | None:
    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except psutil.Error:
        return None


def run(count: int, minutes: float, seed: int, workdir: Path) -> dict:
    model = build_model(workdir / "model")
    prefix = prefix_for_model(str(model))
    span = load_span(model, load_config(model), 0, LAYERS, dtype=torch.float32, device=torch.device("cpu"))
    port = _free_port()
    with LocalSwarm(workdir / "logs") as swarm:
        swarm.start_bootstrap()
        peer = swarm.start_peer(
            "peer",
            str(model),
            "--blocks",
            f"0:{LAYERS}",
            "--port",
            str(port),
            "--transport",
            "direct",
            "--throughput",
            "100",
            "--num-threads",
            "1",
            "--max-message-mb",
            "4",
            "--cache-tokens",
            "2048",
            "--alloc-timeout-s",
            "0.5",
            "--session-timeout-s",
            "60",
        )
        swarm.wait_online(str(model), LAYERS)
        rss_before = _rss_mib(peer.pid)
        fuzz = Fuzz(f"127.0.0.1:{port}", prefix, span, seed)
        started = time.monotonic()
        asyncio.run(fuzz.run(count, started + 60 * minutes, lambda: peer.poll() is None))
        elapsed = time.monotonic() - started
        crashed = peer.poll() is not None
        rss_after = _rss_mib(peer.pid)
        log_tail = swarm.tail("peer") if crashed else ""
    tally = fuzz.tally
    return {
        "tried": dict(tally.tried),
        "total": sum(tally.tried.values()),
        "seconds": round(elapsed, 1),
        "outcomes": {f"{m}/{o}": n for (m, o), n in sorted(tally.outcomes.items())},
        "untyped": sum(n for (_, o), n in tally.outcomes.items() if o == "untyped"),
        "untyped_examples": tally.untyped,
        "crashes": int(crashed),
        "crash_log": log_tail,
        "rss_mib_before": rss_before,
        "rss_mib_after": rss_after,
        "honest_steps": fuzz.honest_steps,
        "honest_max_abs_diff": fuzz.honest_max_diff,
        "honest_exact": fuzz.honest_error is None and fuzz.honest_max_diff <= ATOL,
        "honest_error": fuzz.honest_error,
    }


def report(result: dict) -> str:
    lines = [f"{'method':<10}{'tried':>8}{'ok':>8}{'typed':>8}{'untyped':>9}"]
    for method in METHOD_NAMES:
        o = result["outcomes"]
        lines.append(
            f"{method:<10}{result['tried'].get(method, 0):>8}{o.get(f'{method}/ok', 0):>8}"
            f"{o.get(f'{method}/typed', 0):>8}{o.get(f'{method}/untyped', 0):>9}"
        )
    rss = lambda v: "?" if v is None else f"{v:.0f} MiB"  # noqa: E731
    lines += [
        f"{result['total']} requests in {result['seconds']} s; crashes {result['crashes']}, "
        f"untyped {result['untyped']}; peer RSS {rss(result['rss_mib_before'])} before, "
        f"{rss(result['rss_mib_after'])} after",
        f"honest session: {result['honest_steps']} steps, max |diff| {result['honest_max_abs_diff']:.2e}, "
        f"{'exact' if result['honest_exact'] else 'NOT EXACT'}"
        + (f" ({result['honest_error']})" if result["honest_error"] else ""),
    ]
    lines += [f"  untyped: {example}" for example in result["untyped_examples"]]
    if result["crash_log"]:
        lines.append(f"peer log:\n{result['crash_log']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fuzz", description=__doc__.split("\n")[0])
    p.add_argument("--count", type=int, default=3000, help="mutated requests to send (default: 3000)")
    p.add_argument("--minutes", type=float, default=10.0, help="stop after this long (default: 10)")
    p.add_argument("--seed", type=int, default=0, help="seed of the mutations (default: 0)")
    p.add_argument("--out", type=Path, help="also write the figures as JSON here")
    args = p.parse_args(argv)
    if args.count < 1 or args.minutes <= 0:
        p.error("--count must be >= 1 and --minutes > 0")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    with tempfile.TemporaryDirectory(prefix="swarmlm-fuzz-") as workdir:
        result = run(args.count, args.minutes, args.seed, Path(workdir))
    print(report(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0 if result["crashes"] == 0 and result["untyped"] == 0 and result["honest_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
