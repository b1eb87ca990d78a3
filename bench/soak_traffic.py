"""Malformed traffic for a soak run: bad requests to random ONLINE peers, at a bounded rate, each answer classed.

A request is first valid for its target (its span, the model's hidden size), then bent: bench.fuzz's mutations
(bit flips, truncation, duplicated or dropped fields, giant varints, many payload fields, huge or negative
shapes, wrong dtypes and offsets), or one of a few requests wrong on purpose: garbage bytes, NaN hidden states,
a step of a session that does not exist, a session far longer than the model. Steps go to a session opened
for them on a stream of its own, which is cancelled afterwards (the peer must free its cache). And two attacks
of their own: "unread state" opens 8 State calls at once and reads none of them for a second (a peer sends its
weights to one caller at a time and refuses more than four waiting), and "nonce flood" asks for 60 identity
proofs at once (a peer signs 40 at most in a burst for one address).

Answers are classed as in bench.fuzz (`ok`, `typed`, `untyped`), plus `churned` (the target was being
stopped by the churn, or could not be reached: it was killed) and `timeout` (no answer within the timeout, on
a machine the whole soak shares).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc
import torch

from bench.fuzz import mutate
from bench.soak_fleet import Fleet, Incarnation
from protocol import swarmlm_pb2 as pb
from protocol.packing import Packer
from protocol.service import ERROR_CODE_KEY, METHODS

REQUEST_TIMEOUT_S = 20.0
METHOD_NAMES = ("forward", "backward", "open", "step", "info", "state")
SPECIAL = ("garbage", "nan", "unknown session", "too long", "unread state", "nonce flood")
_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


@dataclass
class TrafficTally:
    outcomes: Counter = field(default_factory=Counter)  # outcome -> count
    by_kind: Counter = field(default_factory=Counter)  # (method or special kind, outcome) -> count
    untyped: list[str] = field(default_factory=list)  # the first few, described

    def add(self, kind: str, outcome: str, detail: str) -> None:
        self.outcomes[outcome] += 1
        self.by_kind[kind, outcome] += 1
        if outcome == "untyped" and len(self.untyped) < 10:
            self.untyped.append(f"{kind}: {detail[:300]}")


class BadTraffic:
    def __init__(self, fleet: Fleet, prefix: str, hidden_size: int, max_positions: int, seed: int):
        self.fleet, self.prefix, self.hidden_size, self.max_positions = fleet, prefix, hidden_size, max_positions
        self.rng = random.Random(seed)
        self.tally = TrafficTally()

    async def run(self, rate_per_s: float, deadline: float, stop) -> None:
        channels: dict[str, grpc.aio.Channel] = {}
        try:
            while time.monotonic() < deadline and not stop.is_set():
                targets = self.fleet.online()
                for endpoint in set(channels) - {t.endpoint for t in targets}:  # its peer was stopped
                    await channels.pop(endpoint).close(grace=None)
                if targets:
                    target = self.rng.choice(targets)
                    if target.endpoint not in channels:
                        channels[target.endpoint] = grpc.aio.insecure_channel(
                            target.endpoint, options=[("grpc.max_send_message_length", 1 << 26)]
                        )
                    await self.one(channels[target.endpoint], target)
                await asyncio.sleep(self.rng.expovariate(rate_per_s))
        finally:
            for channel in channels.values():
                await channel.close(grace=None)

    async def one(self, channel: grpc.aio.Channel, target: Incarnation) -> None:
        kind = self.rng.choice(METHOD_NAMES + SPECIAL)
        try:
            outcome, detail = await asyncio.wait_for(self._send(channel, target, kind), REQUEST_TIMEOUT_S)
        except asyncio.TimeoutError:
            outcome, detail = "timeout", f"no answer within {REQUEST_TIMEOUT_S:.0f}s"
        except grpc.RpcError as exc:
            outcome, detail = _rpc_outcome(exc)
        if target.ended is not None and outcome != "ok":
            outcome = "churned"
        self.tally.add(kind, outcome, detail)

    # --- requests ---

    def _span(self, target: Incarnation) -> pb.Span:
        return pb.Span(model=self.prefix, start=target.span[0], end=target.span[1])

    def _hidden(self, length: int) -> torch.Tensor:
        return torch.randn(
            1, length, self.hidden_size, generator=torch.Generator().manual_seed(self.rng.getrandbits(32))
        )

    def _stateless(self, method: str, target: Incarnation, hidden: torch.Tensor):
        packer, length = Packer(), hidden.shape[1]
        fields = dict(
            span=self._span(target),
            hidden_states=packer.tensor(hidden),
            position_ids=packer.tensor(torch.arange(length).unsqueeze(0)),
        )
        if method == "backward":
            return packer.pack(pb.BackwardRequest(**fields, grad_outputs=packer.tensor(self._hidden(length))))
        return packer.pack(pb.ForwardRequest(**fields))

    def _open(self, target: Incarnation, max_length: int = 32) -> pb.InferenceRequest:
        return pb.InferenceRequest(
            open=pb.OpenSession(
                span=self._span(target),
                session_id=f"bad-{self.rng.getrandbits(40)}",
                max_length=max_length,
                batch_size=1,
            )
        )

    def _step(self, session_id: str, length: int):
        packer = Packer()
        return packer.pack(
            pb.InferenceRequest(
                step=pb.InferenceStep(
                    session_id=session_id,
                    hidden_states=packer.tensor(self._hidden(length)),
                    position_ids=packer.tensor(torch.arange(length).unsqueeze(0)),
                    prefix_length=0,
                )
            )
        )

    async def _send(self, channel: grpc.aio.Channel, target: Incarnation, kind: str) -> tuple[str, str]:
        if kind in ("forward", "backward"):
            data, _ = mutate(self._stateless(kind, target, self._hidden(self.rng.choice([1, 3, 100]))), self.rng)
            return await _unary(channel, kind, data)
        if kind == "nan":
            hidden = self._hidden(4)
            hidden[0, self.rng.randrange(4), self.rng.randrange(self.hidden_size)] = math.nan
            return await _unary(channel, "forward", self._stateless("forward", target, hidden).SerializeToString())
        if kind == "garbage":
            method = self.rng.choice(["Forward", "Backward", "Info"])
            return await _unary(channel, method.lower(), self.rng.randbytes(self.rng.choice([1, 17, 300, 5000])))
        if kind == "info":
            data, _ = mutate(pb.InfoRequest(param_digest=False), self.rng)
            return await _unary(channel, "info", data)
        if kind == "unread state":
            return await _unread_states(channel, pb.StateRequest(span=self._span(target)).SerializeToString())
        if kind == "nonce flood":
            return await _nonce_flood(channel, self.rng)
        if kind == "state":
            data, _ = mutate(pb.StateRequest(span=self._span(target)), self.rng)
            call = channel.unary_stream(METHODS["State"].path)(data)
            parts = [part async for part in call]
            return "ok", f"{len(parts)} parts"
        if kind in ("open", "too long"):
            request = self._open(target, self.max_positions * 4 if kind == "too long" else 32)
            data = mutate(request, self.rng)[0] if kind == "open" else request.SerializeToString()
            return await _on_stream(channel, [data])
        if kind == "unknown session":
            return await _on_stream(channel, [self._step(f"nobody-{self.rng.getrandbits(32)}", 1).SerializeToString()])
        # a step: open a session for it, then send the mutated step
        opening = self._open(target)
        step, _ = mutate(self._step(opening.open.session_id, self.rng.choice([1, 3])), self.rng)
        return await _on_stream(channel, [opening.SerializeToString(), step])


async def _unread_states(channel: grpc.aio.Channel, data: bytes, count: int = 8) -> tuple[str, str]:
    """`count` State calls that nobody reads for a second, then cancelled: "typed" if the peer refused some of them
    as it should (OverloadedError), the first untyped failure otherwise."""
    calls = [channel.unary_stream(METHODS["State"].path)(data) for _ in range(count)]
    reads = [asyncio.ensure_future(call.read()) for call in calls]  # one read each: the first piece, or the refusal
    await asyncio.wait(reads, timeout=1.0)
    outcomes = Counter()
    for call, read in zip(calls, reads):
        if read.done() and read.exception() is not None:
            outcomes[_rpc_outcome(read.exception())[0]] += 1
        call.cancel()
        read.cancel()
    await asyncio.gather(*reads, return_exceptions=True)
    if outcomes["untyped"]:
        return "untyped", f"{outcomes['untyped']} of {count} unread State calls failed untyped"
    return ("typed" if outcomes["typed"] else "ok"), f"{dict(outcomes)}"


async def _nonce_flood(channel: grpc.aio.Channel, rng: random.Random, count: int = 60) -> tuple[str, str]:
    """`count` identity proofs asked at once: "typed" when the peer metered them (OverloadedError)."""
    call = channel.unary_unary(METHODS["Info"].path)
    asks = [call(pb.InfoRequest(nonce=rng.randbytes(16)).SerializeToString()) for _ in range(count)]
    results = await asyncio.gather(*asks, return_exceptions=True)
    failures = [_rpc_outcome(r) for r in results if isinstance(r, grpc.RpcError)]
    untyped = [detail for outcome, detail in failures if outcome == "untyped"]
    if untyped:
        return "untyped", untyped[0]
    return ("typed" if failures else "ok"), f"{len(failures)} of {count} refused"


async def _unary(channel: grpc.aio.Channel, method: str, data: bytes) -> tuple[str, str]:
    await channel.unary_unary(METHODS[method.capitalize()].path)(data)
    return "ok", ""


async def _on_stream(channel: grpc.aio.Channel, messages: list[bytes]) -> tuple[str, str]:
    """Send `messages` in turn on a fresh inference stream; the class of the last answer. The stream is cancelled."""
    call = channel.stream_stream(METHODS["Inference"].path)()
    try:
        for data in messages:
            await call.write(data)
            raw = await call.read()
            if raw is grpc.aio.EOF:
                return _ended(data, await call.code(), await call.details())
            response = pb.InferenceResponse.FromString(raw)
            if response.WhichOneof("kind") == "error":
                error = response.error
                return ("untyped" if error.code in ("", "internal") else "typed"), f"{error.code}: {error.message}"
        return "ok", ""
    finally:
        call.cancel()


def _ended(sent: bytes, code: grpc.StatusCode, details: str) -> tuple[str, str]:
    if code in _UNREACHABLE:
        return "churned", f"{code.name}: {details}"
    try:
        closing = pb.InferenceRequest.FromString(sent).WhichOneof("kind") == "close"
    except Exception:
        closing = False
    return ("ok", "closed") if closing else ("untyped", f"the stream ended without an answer ({code.name}: {details})")


def _rpc_outcome(exc: grpc.RpcError) -> tuple[str, str]:
    code = dict(exc.trailing_metadata() or ()).get(ERROR_CODE_KEY)
    detail = f"{exc.code().name}: {exc.details()}"
    if exc.code() in _UNREACHABLE and code is None:
        return "churned", detail
    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "timeout", detail
    if code is None and exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # gRPC's own message limit (see bench.fuzz)
        return "typed", detail
    if code is None or code == "internal" or exc.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
        return "untyped", f"{detail} (error code {code})"
    return "typed", detail
