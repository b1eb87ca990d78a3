"""Bad requests against a live peer get typed errors naming the problem, and the peer keeps serving others.

One peer serves the whole module, once reached directly (gRPC) and once through libp2p (`--transport p2p`, the
same gRPC through swarm/net/tunnel.py). Every bad request goes through `Guard.refused`: it must fail with exactly the
expected error class, with the expected words in its message; right after it the witness, an inference session
open on its own stream and channel for the whole module, takes its next step, whose output must match the local
span, and the peer process must still be running. Where the bad request had a session, stream or channel of its
own, the test then uses that too, to show that it survived. After each test the peer must be back to the witness
alone (`settled`): no session or cache left behind.

All client code runs on one event loop in a background thread (`Guard.run`), so the witness outlives each test.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from client.transport import ChannelPool, InferenceStream
from peer.blocks import BlockSpan, load_span
from protocol import swarmlm_pb2 as pb
from protocol.codec import decode_tensor, encode_tensor
from protocol.errors import (
    BadRequestError,
    CacheFullError,
    MessageTooLargeError,
    PeerUnavailableError,
    SequenceTooLongError,
    SwarmError,
    UnknownSessionError,
    WrongSpanError,
)
from protocol.packing import Packer
from protocol.records import prefix_for_model
from swarm.models.checkpoint import load_config
from swarm.net.tunnel import TunnelPool, tunnel_address
from tests.helpers.models import HIDDEN_SIZE, MAX_POSITIONS

NUM_LAYERS = 4
CACHE_TOKENS = 96  # the peer's --cache-tokens
WITNESS_LENGTH = 16  # cache tokens the witness holds for the whole module
MAX_MESSAGE_MB = 0.25  # the peer's --max-message-mb: 256 KiB, 1024 tokens of hidden size 64 in float32
TIMEOUT_S = 30.0
ATOL = 1e-5

# --- the local reference ---


def _hidden(*shape, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _local(fn):
    """Run `fn` on one torch thread, as the peer does (OMP_NUM_THREADS=1), so that both round alike."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


def _stepwise(span: BlockSpan, tokens: torch.Tensor) -> torch.Tensor:
    """What a session computes for `tokens`: one token per step, on a growing cache."""

    def run():
        cache = span.new_cache()
        with torch.inference_mode():
            return torch.cat(
                [span(tokens[:, i : i + 1], None, torch.tensor([[i]]), cache, i) for i in range(tokens.shape[1])], dim=1
            )

    return _local(run)


def _forward(span: BlockSpan, hidden: torch.Tensor) -> torch.Tensor:
    def run():
        with torch.inference_mode():
            return span(hidden)

    return _local(run)


def _gradient(span: BlockSpan, hidden: torch.Tensor, grad_outputs: torch.Tensor) -> torch.Tensor:
    def run():
        inputs = hidden.clone().requires_grad_(True)
        with torch.enable_grad():
            (grad,) = torch.autograd.grad(span(inputs), inputs, grad_outputs)
        return grad

    return _local(run)


# --- requests ---


def _span(prefix: str, spec: str | None = None) -> pb.Span:
    """The served span; `spec` "start:end" asks for other blocks, any other string for another model."""
    if spec is None:
        return pb.Span(model=prefix, start=0, end=NUM_LAYERS)
    if ":" in spec:
        start, end = map(int, spec.split(":"))
        return pb.Span(model=prefix, start=start, end=end)
    return pb.Span(model=spec, start=0, end=NUM_LAYERS)


def _tensors(fields: dict) -> dict:
    """Encode the tensors among request fields; pb.Tensor values (hand-made bad ones) pass, None ones go."""
    return {k: encode_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in fields.items() if v is not None}


def _open(prefix: str, session_id: str, max_length: int, span: str | None = None, **fields) -> pb.InferenceRequest:
    fields.setdefault("batch_size", 1)
    return pb.InferenceRequest(
        open=pb.OpenSession(span=_span(prefix, span), session_id=session_id, max_length=max_length, **fields)
    )


def _step(session_id: str, hidden: torch.Tensor | None, prefix_length: int, **fields) -> pb.InferenceRequest:
    if hidden is not None and hidden.ndim == 3 and "position_ids" not in fields:
        fields["position_ids"] = torch.arange(prefix_length, prefix_length + hidden.shape[1]).unsqueeze(0)
    return pb.InferenceRequest(
        step=pb.InferenceStep(
            session_id=session_id, prefix_length=prefix_length, **_tensors({"hidden_states": hidden, **fields})
        )
    )


def _result(response) -> torch.Tensor:
    return decode_tensor(response.message.step.hidden_states, "hidden_states", response.payload)


class Session:
    """An inference session on its own stream that steps through a fixed sequence, checking every output.

    After its last token it starts again at prefix 0 (the peer then rewinds its cache), so it can step on
    forever within a small max_length.
    """

    def __init__(
        self, stream: InferenceStream, prefix: str, session_id: str, tokens: torch.Tensor, expected: torch.Tensor
    ):
        self.stream, self.prefix, self.session_id = stream, prefix, session_id
        self.tokens, self.expected = tokens, expected
        self.position = 0

    @property
    def length(self) -> int:
        return self.tokens.shape[1]

    async def request(self, request):
        return await self.stream.request(request, TIMEOUT_S)

    async def open(self) -> Session:
        await self.request(_open(self.prefix, self.session_id, max_length=self.length))
        return self

    async def step(self) -> None:
        """Send the next token; its output must match the local span."""
        p = self.position
        response = await self.request(_step(self.session_id, self.tokens[:, p : p + 1], p))
        assert response.message.step.position == p + 1
        torch.testing.assert_close(
            _result(response),
            self.expected[:, p : p + 1],
            atol=ATOL,
            rtol=0,
            msg=lambda m: f"session {self.session_id!r}, step at position {p}: {m}",
        )
        self.position = (p + 1) % self.length

    async def close(self) -> None:
        await _end(self.stream)


async def _end(stream: InferenceStream) -> None:
    """Close the stream's session and wait for the peer to end the stream (it has freed the cache by then)."""
    with contextlib.suppress(SwarmError):  # the answer to `close` is the end of the stream
        await stream.request(pb.InferenceRequest(close=pb.CloseSession()), TIMEOUT_S)
    await stream.close()


# --- the peer, the witness, and `refused` ---


@dataclass
class Peer:
    endpoint: str  # its gRPC "host:port", or its "p2p:<peer id>" address
    prefix: str
    span: BlockSpan  # the same blocks, loaded locally
    process: object  # its tests.helpers.processes.PeerProcess
    dht: object  # a client-mode DHT node of this process, for the libp2p path
    initial_peers: list[str]

    def pool(self) -> ChannelPool:
        """A client's channels to it (call on the loop that uses them)."""
        return ChannelPool(1 << 26, TunnelPool(self.dht.replicate_p2p))


@pytest.fixture(scope="module", params=["direct", "p2p"])
def peer(request, tmp_path_factory, tiny_llama_path) -> Peer:
    """One peer serving all 4 blocks, with small limits so that they can be hit, reached as `request.param`."""
    from tests.helpers.processes import Swarm

    with Swarm(tmp_path_factory.mktemp("swarm")) as swarm:
        swarm.start_bootstrap()
        process = swarm.start_peer(
            tiny_llama_path,
            "--blocks",
            f"0:{NUM_LAYERS}",
            "--max-message-mb",
            str(MAX_MESSAGE_MB),
            "--cache-tokens",
            str(CACHE_TOKENS),
            "--alloc-timeout-s",
            "0.5",
            "--transport",
            request.param,
            "--max-cache-share",
            "1",  # the cases here fill the whole budget; quotas are test_limits.py's
        )
        prefix = prefix_for_model(str(tiny_llama_path))
        ((peer_id, info),) = swarm.wait_online(prefix, [(0, NUM_LAYERS)]).online().items()
        assert info.transport == request.param, info
        span = load_span(
            Path(tiny_llama_path),
            load_config(Path(tiny_llama_path)),
            0,
            NUM_LAYERS,
            dtype=torch.float32,
            device=torch.device("cpu"),
        )
        endpoint = info.endpoint if request.param == "direct" else tunnel_address(peer_id)
        yield Peer(endpoint, prefix, span, process, swarm.dht, swarm.initial_peers)


class Guard:
    """The module's event loop, the witness session, and `refused`, through which every bad request goes."""

    WITNESS_ID = "witness"

    def __init__(self, peer: Peer):
        self.peer = peer
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="bad-input-client", daemon=True)
        self._thread.start()
        self.pool: ChannelPool | None = None  # the bad client's channel
        self._witness_pool: ChannelPool | None = None  # the witness's, another connection
        self.witness: Session | None = None

    def run(self, coro, timeout_s: float = 120.0):
        """Run `coro` on the module's loop; its result, or its exception."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise

    def start(self) -> None:
        async def start():
            self.pool, self._witness_pool = self.peer.pool(), self.peer.pool()
            self.witness = await self.session(self.WITNESS_ID, WITNESS_LENGTH, seed=1, pool=self._witness_pool).open()
            await self.witness.step()

        self.run(start())

    def stop(self) -> None:
        async def stop():
            if self.witness is not None:
                await self.witness.close()
            for pool in (self.pool, self._witness_pool):
                if pool is not None:
                    await pool.close()
            if self.peer.endpoint.startswith("p2p:"):  # the replica's tasks live on this loop
                await (await self.peer.dht.replicate_p2p()).shutdown()

        try:
            self.run(stop(), 30.0)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()

    def session(self, session_id: str, length: int, *, seed: int = 2, pool: ChannelPool | None = None) -> Session:
        """A checked session (see `Session`) on a new stream of the bad client's channel; `await s.open()`."""
        tokens = _hidden(1, length, HIDDEN_SIZE, seed=seed)
        stream = InferenceStream(pool or self.pool, self.peer.endpoint)
        return Session(stream, self.peer.prefix, session_id, tokens, _stepwise(self.peer.span, tokens))

    async def unary(self, method: str, request):
        return await self.pool.unary(self.peer.endpoint, method, request, timeout_s=TIMEOUT_S)

    async def refused(self, sent, error: type[SwarmError], *words: str) -> SwarmError:
        """Await `sent`, a bad request: it must raise exactly `error`, with each of `words` in its message.

        Then the witness must step exactly and the peer process must still be running.
        """
        with pytest.raises(SwarmError) as caught:
            await sent
        assert type(caught.value) is error, f"expected {error.__name__}, got {caught.value!r}"
        for word in words:
            assert word in str(caught.value), f"{word!r} is not in the message: {caught.value}"
        await self.witness.step()
        assert self.peer.process.alive(), f"the peer exited with {self.peer.process.returncode}"
        return caught.value


@pytest.fixture(scope="module")
def guard(peer) -> Guard:
    guard = Guard(peer)
    try:
        guard.start()
        yield guard
        guard.run(guard.witness.step())  # it outlived the whole module
    finally:
        guard.stop()


@pytest.fixture(autouse=True)
def settled(guard):
    """After each test the peer holds the witness's session alone, and only its cache."""
    yield
    expected = (1, CACHE_TOKENS - WITNESS_LENGTH)

    async def state():
        info = await guard.unary("info", pb.InfoRequest())
        return info.open_sessions, info.cache_tokens_left

    deadline = time.monotonic() + 10.0  # a stream that a test merely cancelled ends on the peer a little later
    while (found := guard.run(state())) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    assert found == expected, f"(open sessions, cache tokens left) after the test: {found}, expected {expected}"


# --- forward and backward ---

_GOOD = {
    "forward": {"hidden_states": _hidden(1, 3, HIDDEN_SIZE, seed=4)},
    "backward": {
        "hidden_states": _hidden(1, 3, HIDDEN_SIZE, seed=4),
        "grad_outputs": _hidden(1, 3, HIDDEN_SIZE, seed=5),
    },
}


def _unary_request(method: str, prefix: str, fields: dict):
    """A good request of `method` with `fields` replacing its own (None removes one; "span" as in `_span`)."""
    fields = {**_GOOD[method], **fields}
    cls = pb.ForwardRequest if method == "forward" else pb.BackwardRequest
    return cls(span=_span(prefix, fields.pop("span", None)), **_tensors(fields))


async def _good_unary(guard: Guard, method: str) -> None:
    """A good request of `method` on the bad client's channel: its answer must match the local span."""
    response = await guard.unary(method, _unary_request(method, guard.peer.prefix, {}))
    good = _GOOD[method]
    if method == "forward":
        got, expected = response.message.hidden_states, _forward(guard.peer.span, good["hidden_states"])
    else:
        got = response.message.grad_inputs
        expected = _gradient(guard.peer.span, good["hidden_states"], good["grad_outputs"])
    torch.testing.assert_close(decode_tensor(got, "output", response.payload), expected, atol=ATOL, rtol=0)


_INPUT_CASES = [  # bad in forward and backward alike: fields replacing the good request's, error, words
    pytest.param(
        {"hidden_states": _hidden(1, 3, HIDDEN_SIZE + 1)},
        BadRequestError,
        ["hidden_states has hidden size 65", "this model's is 64"],
        id="hidden-size",
    ),
    pytest.param(
        {"hidden_states": _hidden(1, 3, HIDDEN_SIZE, dtype=torch.float64)},
        BadRequestError,
        ["hidden_states has dtype torch.float64", "send torch.float32"],
        id="hidden-dtype",
    ),
    pytest.param(
        {"hidden_states": _hidden(3, HIDDEN_SIZE)},
        BadRequestError,
        ["hidden_states must be [batch, seq, hidden], got shape [3, 64]"],
        id="hidden-rank",
    ),
    pytest.param(
        {"hidden_states": _hidden(1, 0, HIDDEN_SIZE)},
        BadRequestError,
        ["at least one sequence and one token", "[1, 0, 64]"],
        id="hidden-empty",
    ),
    pytest.param(
        {"hidden_states": torch.full((1, 3, HIDDEN_SIZE), float("nan"))},
        BadRequestError,
        ["hidden_states contains NaN or inf"],
        id="hidden-nan",
    ),
    pytest.param(
        {"hidden_states": torch.full((1, 3, HIDDEN_SIZE), float("inf"))},
        BadRequestError,
        ["hidden_states contains NaN or inf"],
        id="hidden-inf",
    ),
    pytest.param({"hidden_states": None}, BadRequestError, ["hidden_states is missing"], id="hidden-missing"),
    pytest.param(
        {"hidden_states": pb.Tensor(shape=[1, 3, HIDDEN_SIZE], dtype="float8", data=bytes(192))},
        BadRequestError,
        ["unknown tensor dtype 'float8'"],
        id="unknown-dtype",
    ),
    pytest.param(
        {"hidden_states": pb.Tensor(shape=[1, 3, HIDDEN_SIZE], dtype="float32", data=bytes(10))},
        BadRequestError,
        ["hidden_states: shape [1, 3, 64] of float32 needs 768 bytes, got 10"],
        id="short-data",
    ),
    pytest.param(
        {"attention_mask": torch.ones(1, 4, dtype=torch.int64)},
        BadRequestError,
        ["attention_mask must have shape [1, 3], got [1, 4]"],
        id="mask-shape",
    ),
    pytest.param(
        {"attention_mask": torch.tensor([[1, 2, 1]])},
        BadRequestError,
        ["attention_mask values must be 0 or 1"],
        id="mask-values",
    ),
    pytest.param(
        {"attention_mask": torch.ones(1, 3)},
        BadRequestError,
        ["attention_mask must be an integer or bool tensor, got torch.float32"],
        id="mask-float",
    ),
    pytest.param(
        {"position_ids": torch.tensor([[0, 1, 9999]])},
        BadRequestError,
        [f"position_ids must lie in [0, {MAX_POSITIONS}), got 0..9999"],
        id="positions-range",
    ),
    pytest.param(
        {"position_ids": torch.tensor([[-1, 0, 1]])},
        BadRequestError,
        [f"position_ids must lie in [0, {MAX_POSITIONS}), got -1..1"],
        id="positions-negative",
    ),
    pytest.param(
        {"position_ids": torch.tensor([[0, 1]])},
        BadRequestError,
        ["position_ids must have shape [1 or 1, 3], got [1, 2]"],
        id="positions-shape",
    ),
    pytest.param(
        {"position_ids": torch.tensor([[0.0, 1.0, 2.0]])},
        BadRequestError,
        ["position_ids must be integers, got torch.float32"],
        id="positions-float",
    ),
    pytest.param(
        {"hidden_states": _hidden(4, 300, HIDDEN_SIZE), "grad_outputs": _hidden(4, 300, HIDDEN_SIZE)},
        MessageTooLargeError,
        ["larger than max"],
        id="too-large",
    ),
    pytest.param({"span": "2:6"}, WrongSpanError, ["this peer serves blocks 0:4, not 2:6"], id="wrong-span"),
    pytest.param({"span": "other-model"}, WrongSpanError, ["not 'other-model'"], id="wrong-model"),
]

_GRAD_CASES = [  # bad in backward only
    pytest.param(
        {"grad_outputs": _hidden(1, 2, HIDDEN_SIZE)},
        BadRequestError,
        ["grad_outputs has shape [1, 2, 64], hidden_states [1, 3, 64]"],
        id="grad-shape",
    ),
    pytest.param(
        {"grad_outputs": _hidden(1, 3, HIDDEN_SIZE, dtype=torch.float64)},
        BadRequestError,
        ["grad_outputs has dtype torch.float64, hidden_states torch.float32"],
        id="grad-dtype",
    ),
    pytest.param(
        {"grad_outputs": torch.full((1, 3, HIDDEN_SIZE), float("nan"))},
        BadRequestError,
        ["grad_outputs contains NaN or inf"],
        id="grad-nan",
    ),
    pytest.param(
        {"grad_outputs": torch.full((1, 3, HIDDEN_SIZE), float("-inf"))},
        BadRequestError,
        ["grad_outputs contains NaN or inf"],
        id="grad-inf",
    ),
    pytest.param({"grad_outputs": None}, BadRequestError, ["grad_outputs is missing"], id="grad-missing"),
]


def _refuse_unary(guard: Guard, method: str, fields: dict, error: type[SwarmError], words: list[str]) -> None:
    request = _unary_request(method, guard.peer.prefix, fields)

    async def go():
        await guard.refused(guard.unary(method, request), error, *words)
        await _good_unary(guard, method)  # the same channel still serves

    guard.run(go())


@pytest.mark.parametrize("method", ["forward", "backward"])
@pytest.mark.parametrize("fields, error, words", _INPUT_CASES)
def test_bad_input(guard, method, fields, error, words):
    if method == "forward":  # a forward has no gradient
        fields = {k: v for k, v in fields.items() if k != "grad_outputs"}
    _refuse_unary(guard, method, fields, error, words)


@pytest.mark.parametrize("fields, error, words", _GRAD_CASES)
def test_bad_gradient(guard, fields, error, words):
    _refuse_unary(guard, "backward", fields, error, words)


def test_forward_with_payload_matches_local_span(guard):
    """Hidden states large enough to travel in the payload (see protocol/packing.py) come back exact."""
    hidden = _hidden(2, 160, HIDDEN_SIZE)
    packer = Packer()
    request = packer.pack(pb.ForwardRequest(span=_span(guard.peer.prefix), hidden_states=packer.tensor(hidden)))
    assert request.message.hidden_states.in_payload
    received = guard.run(guard.unary("forward", request))
    assert received.message.hidden_states.in_payload
    got = decode_tensor(received.message.hidden_states, "hidden_states", received.payload)
    torch.testing.assert_close(got, _forward(guard.peer.span, hidden), atol=ATOL, rtol=0)


def test_payload_reference_past_the_payload_is_bad_request(guard):
    request = pb.ForwardRequest(
        span=_span(guard.peer.prefix),
        payload=bytes(64),
        hidden_states=pb.Tensor(shape=[1, 2, HIDDEN_SIZE], dtype="float32", in_payload=True, offset=32),
    )
    guard.run(
        guard.refused(
            guard.unary("forward", request),
            BadRequestError,
            "hidden_states: shape [1, 2, 64] of float32 needs 512 bytes at offset 32 of the payload, which has 64",
        )
    )


# --- opening an inference session ---

_OPEN_CASES = [  # session id, OpenSession fields replacing good ones, error, words
    pytest.param(
        Guard.WITNESS_ID, {}, BadRequestError, ["session 'witness' is already open on this peer"], id="duplicate-id"
    ),
    pytest.param("s", {"span": "2:6"}, WrongSpanError, ["this peer serves blocks 0:4, not 2:6"], id="wrong-span"),
    pytest.param("s", {"span": "other-model"}, WrongSpanError, ["not 'other-model'"], id="wrong-model"),
    pytest.param("", {}, BadRequestError, ["session_id is empty"], id="empty-id"),
    pytest.param(
        "s", {"max_length": 0}, BadRequestError, ["max_length and batch_size must be >= 1, got 0, 1"], id="zero-length"
    ),
    pytest.param(
        "s", {"batch_size": 0}, BadRequestError, ["max_length and batch_size must be >= 1, got 8, 0"], id="zero-batch"
    ),
    pytest.param(
        "s",
        {"max_length": MAX_POSITIONS + 1},
        BadRequestError,
        [f"max_length {MAX_POSITIONS + 1} exceeds the model's {MAX_POSITIONS} positions"],
        id="past-positions",
    ),
    pytest.param(
        "s",
        {"max_length": 50, "batch_size": 2},
        CacheFullError,
        [f"needs 100 cache tokens but this peer's whole budget is {CACHE_TOKENS}"],
        id="over-budget",
    ),
    pytest.param(
        "s", {"alloc_timeout_s": -1.0}, BadRequestError, ["alloc_timeout_s", "got -1.0"], id="negative-alloc-timeout"
    ),
    pytest.param(
        "s", {"alloc_timeout_s": float("nan")}, BadRequestError, ["alloc_timeout_s", "got nan"], id="nan-alloc-timeout"
    ),
]


@pytest.mark.parametrize("session_id, fields, error, words", _OPEN_CASES)
def test_bad_open(guard, request, session_id, fields, error, words):
    """Each bad open comes first on its stream, which then opens a good session."""
    bad = _open(guard.peer.prefix, session_id, **{"max_length": 8, **fields})

    async def go():
        session = guard.session(f"good-after-{request.node.name}", 4)
        try:
            await guard.refused(session.request(bad), error, *words)
            await session.open()
            for _ in range(session.length):
                await session.step()
        finally:
            await session.close()

    guard.run(go())


def test_one_session_id_opened_twice_at_once(guard):
    """Two opens of one session id while the cache is full: the second is refused at once, the first waits."""
    prefix = guard.peer.prefix
    twin = _open(prefix, "twin", max_length=8, alloc_timeout_s=20.0)

    async def go():
        hog, first, second = (InferenceStream(guard.pool, guard.peer.endpoint) for _ in range(3))
        opens = []
        try:
            await hog.request(_open(prefix, "hog", max_length=CACHE_TOKENS - WITNESS_LENGTH), TIMEOUT_S)
            opens += [asyncio.create_task(stream.request(twin, TIMEOUT_S)) for stream in (first, second)]
            # a deadline, not a pause: the refusal ends it; a peer that lets both wait runs it out
            await asyncio.wait(opens, timeout=5.0, return_when=asyncio.FIRST_COMPLETED)
            await _end(hog)  # now the one waiting gets the cache

            async def the_refused_one():
                outcomes = await asyncio.gather(*opens, return_exceptions=True)
                errors = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
                assert len(errors) == 1, f"exactly one open of 'twin' should fail: {outcomes}"
                raise errors[0]

            await guard.refused(the_refused_one(), BadRequestError, "session 'twin' is already open on this peer")
        finally:
            for task in opens:
                task.cancel()
            for stream in (hog, first, second):
                await _end(stream)

    guard.run(go())


# --- inference steps ---

_AT = 2  # tokens in the session's cache when the bad step comes
_X = _hidden(1, 1, HIDDEN_SIZE, seed=6)  # one good new token

_STEP_CASES = [  # a bad request on the stream of Session `s`, error, words
    pytest.param(
        lambda s: _step(s.session_id, _hidden(1, 1, HIDDEN_SIZE + 1), _AT),
        BadRequestError,
        ["hidden_states has hidden size 65"],
        id="hidden-size",
    ),
    pytest.param(
        lambda s: _step(s.session_id, _X.double(), _AT),
        BadRequestError,
        ["hidden_states has dtype torch.float64"],
        id="hidden-dtype",
    ),
    pytest.param(
        lambda s: _step(s.session_id, _hidden(1, HIDDEN_SIZE), _AT),
        BadRequestError,
        ["hidden_states must be [batch, seq, hidden]"],
        id="hidden-rank",
    ),
    pytest.param(
        lambda s: _step(s.session_id, _hidden(1, 0, HIDDEN_SIZE), _AT),
        BadRequestError,
        ["at least one sequence and one token"],
        id="hidden-empty",
    ),
    pytest.param(
        lambda s: _step(s.session_id, torch.full((1, 1, HIDDEN_SIZE), float("nan")), _AT),
        BadRequestError,
        ["hidden_states contains NaN or inf"],
        id="hidden-nan",
    ),
    pytest.param(
        lambda s: _step(s.session_id, torch.full((1, 1, HIDDEN_SIZE), float("inf")), _AT),
        BadRequestError,
        ["hidden_states contains NaN or inf"],
        id="hidden-inf",
    ),
    pytest.param(
        lambda s: _step(s.session_id, None, _AT), BadRequestError, ["hidden_states is missing"], id="hidden-missing"
    ),
    pytest.param(
        lambda s: _step(s.session_id, _X, _AT, attention_mask=torch.ones(1, 1, dtype=torch.int64)),
        BadRequestError,
        [f"attention_mask must have shape [1, {_AT + 1}], got [1, 1]"],
        id="mask-shape",
    ),
    pytest.param(
        lambda s: _step(s.session_id, _X, _AT, attention_mask=torch.tensor([[1, 1, 3]])),
        BadRequestError,
        ["attention_mask values must be 0 or 1"],
        id="mask-values",
    ),
    pytest.param(
        lambda s: _step(s.session_id, _X, _AT, attention_mask=torch.ones(1, _AT + 1)),
        BadRequestError,
        ["attention_mask must be an integer or bool tensor, got torch.float32"],
        id="mask-float",
    ),
    pytest.param(
        lambda s: _step(s.session_id, _X, _AT, position_ids=torch.tensor([[MAX_POSITIONS + 5]])),
        BadRequestError,
        [f"position_ids must lie in [0, {MAX_POSITIONS}), got {MAX_POSITIONS + 5}"],
        id="positions-range",
    ),
    pytest.param(
        lambda s: _step(s.session_id, _X, _AT, position_ids=torch.tensor([[2, 3]])),
        BadRequestError,
        ["position_ids must have shape [1 or 1, 1], got [1, 2]"],
        id="positions-shape",
    ),
    pytest.param(
        lambda s: _step(s.session_id, _X, _AT, position_ids=torch.tensor([[2.0]])),
        BadRequestError,
        ["position_ids must be integers, got torch.float32"],
        id="positions-float",
    ),
    pytest.param(
        lambda s: _step(s.session_id, _hidden(1, 7, HIDDEN_SIZE), _AT),
        SequenceTooLongError,
        [f"{_AT} cached + 7 new tokens exceed the session's max_length 8"],
        id="too-long",
    ),
    pytest.param(
        lambda s: _step(s.session_id, _hidden(2, 1, HIDDEN_SIZE), _AT),
        BadRequestError,
        ["the session was opened for batch 1, got batch 2"],
        id="batch",
    ),
    pytest.param(
        lambda s: _step(s.session_id, _X, _AT + 3),
        BadRequestError,
        [f"step builds on {_AT + 3} tokens but the session's cache holds {_AT}"],
        id="ahead-of-cache",
    ),
    pytest.param(
        lambda s: _step("no-such-session", _X, _AT),
        UnknownSessionError,
        ["unknown session 'no-such-session' on this stream"],
        id="unknown-session",
    ),
    pytest.param(
        lambda s: pb.InferenceRequest(), BadRequestError, ["must be one of open, step or close"], id="no-kind"
    ),
    pytest.param(
        lambda s: _open(s.prefix, "another", max_length=4),
        BadRequestError,
        ["is already open on this stream"],
        id="second-open",
    ),
    pytest.param(
        lambda s: _step(s.session_id, _hidden(1, 1100, HIDDEN_SIZE), _AT),
        MessageTooLargeError,
        ["larger than max"],
        id="too-large",
    ),
]


@pytest.mark.parametrize("make_request, error, words", _STEP_CASES)
def test_bad_step(guard, request, make_request, error, words):
    """A bad step fails alone: its session, on the same stream, then goes on exactly where it was."""

    async def go():
        session = await guard.session(f"bad-{request.node.name}", 8).open()
        try:
            for _ in range(_AT):
                await session.step()
            await guard.refused(session.request(make_request(session)), error, *words)
            if error is MessageTooLargeError:
                # gRPC refuses a message over its limit by ending the call, and the session with it (`settled`
                # checks that the peer freed it)
                with pytest.raises(PeerUnavailableError):
                    await session.step()
                return
            for _ in range(session.length - _AT + 1):  # to its end, and on at prefix 0
                await session.step()
        finally:
            await session.close()

    guard.run(go())


def test_step_that_rewinds_the_cache_matches_local(guard):
    """A step at a prefix shorter than the cache (a retried step, or a branch) forgets what followed it."""
    tokens, branch = _hidden(1, 8, HIDDEN_SIZE), _hidden(1, 2, HIDDEN_SIZE, seed=7)
    expected = _stepwise(guard.peer.span, torch.cat([tokens[:, :5], branch], dim=1))[:, 5:]

    async def go():
        session = await guard.session("rewinds", 16).open()
        try:
            for i in range(8):
                await session.request(_step("rewinds", tokens[:, i : i + 1], i))
            first = await session.request(_step("rewinds", branch[:, :1], 5))
            second = await session.request(_step("rewinds", branch[:, 1:], 6))
            return first.message.step.position, torch.cat([_result(first), _result(second)], dim=1)
        finally:
            await session.close()

    position, got = guard.run(go())
    assert position == 6
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


# --- the cache budget ---


def test_cache_budget_is_enforced_with_a_timeout(guard):
    free = CACHE_TOKENS - WITNESS_LENGTH
    prefix = guard.peer.prefix

    async def go():
        streams = [InferenceStream(guard.pool, guard.peer.endpoint) for _ in range(4)]
        first, second, third, fourth = streams
        try:
            await guard.refused(
                first.request(_open(prefix, "huge", max_length=200), TIMEOUT_S),
                CacheFullError,
                f"a session needs 200 cache tokens but this peer's whole budget is {CACHE_TOKENS}",
            )
            await second.request(_open(prefix, "holds-64", max_length=64), TIMEOUT_S)
            await guard.refused(
                third.request(_open(prefix, "waits", max_length=64), TIMEOUT_S),
                CacheFullError,
                f"no room for 64 cache tokens after waiting 0.5s ({free - 64} of {CACHE_TOKENS} left)",
            )
            await second.close()  # frees its 64 tokens, though the peer may see that a moment later
            # waits for them, bounded: a CacheFullError if closing the stream did not free them
            await fourth.request(_open(prefix, "fits-now", max_length=64, alloc_timeout_s=10.0), TIMEOUT_S)
        finally:
            for stream in streams:
                await _end(stream)

    guard.run(go())


def test_cache_of_a_killed_client_is_freed(guard, tmp_path):
    """A client process that dies (SIGKILL) mid-session: its stream breaks and the peer frees its cache."""
    endpoint, prefix = guard.peer.endpoint, guard.peer.prefix
    script = tmp_path / "doomed_client.py"
    script.write_text(f"""
import asyncio, sys
from client.transport import ChannelPool, InferenceStream
from protocol import swarmlm_pb2 as pb
from swarm.dht.node import start_dht
from swarm.net.tunnel import TunnelPool

async def main():
    tunnels = TunnelPool(start_dht({guard.peer.initial_peers!r}, client_mode=True).replicate_p2p)
    stream = InferenceStream(ChannelPool(1 << 26, tunnels), {endpoint!r})
    await stream.request(pb.InferenceRequest(open=pb.OpenSession(
        span=pb.Span(model={prefix!r}, start=0, end={NUM_LAYERS}), session_id="doomed", max_length=64,
        batch_size=1)), 30)
    print("opened", flush=True)
    await asyncio.sleep(300)

asyncio.run(main())
""")
    child = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "opened"

        async def open_64(session_id: str, timeout_s: float):
            stream = InferenceStream(guard.pool, endpoint)
            try:
                await stream.request(_open(prefix, session_id, max_length=64, alloc_timeout_s=timeout_s), TIMEOUT_S)
            finally:
                await _end(stream)

        # the live client holds 64 of the 96 tokens, the witness 16
        guard.run(guard.refused(open_64("while-alive", 0.5), CacheFullError, "no room for 64 cache tokens"))
        child.kill()
        child.wait(10)
        guard.run(open_64("after-death", 10.0))  # waits (bounded) until the dead client's cache is freed
    finally:
        child.kill()
        child.wait(10)
