"""A swarm in this process, for tests of client logic in milliseconds: scripted peers that answer, fail, stall or lie.

Each `FakePeer` is the peer's own request handling (peer/handler.py PeerServicer: its checks, KV cache, batching,
steps pushed on to the next peer) over real blocks of a tiny model (peer.blocks.load_span), reached through
in-memory gRPC channels (tests/helpers/memory_channel.py), and listed in the directory that clients read
(`FakeSwarm.directory`: a SwarmSnapshot of ServerInfo records with each peer's public key; a peer signs identity
challenges with its own RSA key, as client/dialing.py checks). A client's transport, checks, routing, retries, bans,
replays and spot checks all run for real; only sockets, processes and the DHT are left out.

A peer follows its `Fault`s: at a chosen answer it crashes (every call in flight fails, as when its process is
killed; its record stays in the directory, as a crashed peer's stays in the DHT until it expires), stalls (takes
requests, answers nothing), answers with an error, or lies (the lies of tests/helpers/liar.py).

    with FakeSwarm(tiny_llama_path) as swarm:
        swarm.add_peer(0, 2)
        swarm.add_peer(2, 4, throughput=10, faults=[Fault("crash", after=20)])  # fastest: routed to first
        swarm.add_peer(2, 4)
        model = swarm.client(forward_steps=True)  # a DistributedModelForCausalLM on these peers
        model.generate(ids, max_new_tokens=30)
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import itertools
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from client.config import ClientConfig
from client.loop import BackgroundLoop
from client.model import DistributedModelForCausalLM
from client.sequence import RemoteSequence
from client.transport import ChannelPool
from peer.adapters import ServedAdapters, adapter_records, read_adapter
from peer.blocks import load_span
from peer.cache import CacheBudget
from peer.config import ServingLimits
from peer.forwarding import Forwarder
from peer.handler import PeerServicer
from protocol import swarmlm_pb2 as pb
from protocol.codec import decode_tensor
from protocol.errors import error_from_code
from protocol.packing import Packer, unpack
from protocol.records import PROTOCOL_VERSION, ServerInfo, ServerState, prefix_for_model
from protocol.service import ERROR_CODE_KEY, METHODS, PeerStub, status_for
from swarm.dht.snapshot import SwarmSnapshot
from swarm.models.checkpoint import load_config
from swarm.trust.identity import NodeIdentity, peer_id_of, prove_identity
from tests.helpers.liar import TENSOR_FIELD, corrupt, replace_tensor
from tests.helpers.memory_channel import MemoryServer, Network, rpc_error

INITIAL_PEERS = ("/ip4/127.0.0.1/tcp/1",)  # a client needs some; nothing dials them here
LIES = ("shape", "dtype", "nan", "empty", "perturb", "scale", "no_router", "kind", "position", "step_id")
"""What a lying peer may do to its answers (tests/helpers/liar.py; "no_router": a Forward answer without the router
sums asked for, as a peer that predates them gives); the last three only to inference steps."""
ACTS = ("crash", "stall", "error", *LIES)


@dataclass(frozen=True)
class Fault:
    """What a peer does instead of answering `method` ("inference", "forward", "backward", "push", "info").

    It acts on the peer's answers to `method` after the first `after` of them (inference: step results; a unary
    method: calls, as they arrive, and a lie on their answers), `times` times (None: from then on).
    """

    act: str
    """crash, stall, error (answers `code`), or one of LIES."""
    method: str = "inference"
    after: int = 0
    times: int | None = None
    code: str = "internal"
    """The error code that act "error" answers (protocol/errors.py), e.g. "bad_request", "cache_full"."""
    scale: float = 1e-2
    """For "perturb": the noise, times the tensor's std; for "scale": how much larger the answer is made."""

    def __post_init__(self) -> None:
        if self.act not in ACTS:
            raise ValueError(f"act must be one of {ACTS}, got {self.act!r}")
        if self.method not in ("inference", "forward", "backward", "push", "info"):
            raise ValueError(f"no method {self.method!r}")


_KEYS: list = []  # RSA keys, made once per process (60 ms each): peer i of every swarm holds key i
_KEYS_LOCK = threading.Lock()


def _identity(index: int) -> NodeIdentity:
    from hivemind.utils.crypto import RSAPrivateKey

    with _KEYS_LOCK:
        while len(_KEYS) <= index:
            _KEYS.append(RSAPrivateKey())
    key = _KEYS[index]
    return NodeIdentity(Path("in-memory.key"), key, peer_id_of(key.get_public_key().to_bytes()))


class _Forwarder(Forwarder):
    """Pushes steps to the next peer through the swarm's in-memory network: only the channel differs."""

    def __init__(self, network: Network, max_message_bytes: int, endpoints=None):
        super().__init__(None, max_message_bytes, endpoints)
        self._network = network

    def _stub(self, endpoint: str) -> PeerStub:
        if endpoint not in self._stubs:
            channel = self._network.connect(endpoint)
            self._stubs[endpoint] = (channel, PeerStub(channel))
        return self._stubs[endpoint][1]


class FakePeer:
    """One peer serving blocks [start, end): its servicer, its record, and the faults it follows."""

    def __init__(
        self,
        swarm: FakeSwarm,
        index: int,
        start: int,
        end: int,
        *,
        throughput: float,
        cache_tokens: int,
        limits: ServingLimits,
        faults: list[Fault],
        announce: str | None,
        key: int,
        adapters: dict[str, Path] | None = None,
    ):
        self.swarm, self.start, self.end, self.throughput = swarm, start, end, throughput
        self.work = limits.work  # its caps on one request, which its record announces
        self.key, self.identity = key, _identity(key)
        self.peer_id = self.identity.peer_id
        self.endpoint = announce or f"peer{index}.in-memory:{index + 1}"
        self.faults = list(faults)
        self.answered: dict[str, int] = {}  # method -> answers (inference: step results) or calls seen so far
        self.acted = 0  # answers its faults spoiled (or calls they refused)
        self.forwarder = _Forwarder(swarm.network, 64 * 1024 * 1024, swarm.announced_endpoints)
        self.budget = CacheBudget(cache_tokens)
        config = load_config(swarm.model_path)
        self.servicer = PeerServicer(
            config,
            swarm.prefix,
            self.budget,
            limits,
            self.info,
            prove=functools.partial(prove_identity, self.identity),
            forwarder=self.forwarder,
        )
        span = load_span(swarm.model_path, config, start, end, dtype=torch.float32, device=torch.device("cpu"))
        self.adapters = [read_adapter(name, folder) for name, folder in (adapters or {}).items()]
        if self.adapters:  # as `swarmlm peer --adapters NAME=DIR` serves them (peer/adapters.py)
            span.adapters = ServedAdapters(span.layers, span.start, self.adapters)
        self.servicer.set_span(span)
        self.server = MemoryServer(self.servicer, self)
        self.in_directory = True
        self.expiration = 0.0  # of its latest record: a crashed or stopped peer announces no more

    @property
    def alive(self) -> bool:
        return not self.server.down and not self.server.stalled

    def info(self) -> pb.InfoResponse:
        return pb.InfoResponse(
            peer_id=self.peer_id,
            model=self.swarm.prefix,
            start=self.start,
            end=self.end,
            version=PROTOCOL_VERSION,
            dtype="float32",
            cache_tokens_left=self.budget.tokens_left,
            throughput=self.throughput,
            open_sessions=len(self.servicer.streams.sessions),
            pushed_steps=self.forwarder.pushed,
        )

    def record(self) -> ServerInfo:
        return ServerInfo(
            state=ServerState.ONLINE,
            start_block=self.start,
            end_block=self.end,
            throughput=self.throughput,
            cache_tokens_left=self.budget.tokens_left,
            dtype="float32",
            version=PROTOCOL_VERSION,
            endpoint=self.endpoint,
            adapters=adapter_records(self.adapters),
            max_request_tokens=self.work.max_request_tokens,
            max_attention_cost=self.work.max_attention_cost,
        )

    def kill(self) -> None:
        """Crash now (its record stays in the directory)."""
        self.swarm.on_loop(self.server.kill)

    def stall(self) -> None:
        """Stop answering now (its record stays in the directory)."""
        self.swarm.on_loop(self.server.stall)

    # --- the script its in-memory server follows (tests/helpers/memory_channel.py) ---

    def _due(self, method: str) -> list[Fault]:
        """The faults that act on the latest answer (or call) of `method`."""
        seen = self.answered.get(method, 0)
        return [
            fault
            for fault in self.faults
            if fault.method == method
            and fault.after < seen
            and (fault.times is None or seen <= fault.after + fault.times)
        ]

    def took(self, server: MemoryServer, method: str) -> None:
        method = method.lower()
        self.answered[method] = self.answered.get(method, 0) + 1
        for fault in self._due(method):
            self.acted += 1
            if fault.act == "crash":
                server.kill()
            elif fault.act == "stall":
                server.stall()
            elif fault.act == "error":
                error = error_from_code(fault.code, f"scripted {fault.code} on {method}")
                raise rpc_error(status_for(error), str(error), ((ERROR_CODE_KEY, error.code),))
            # a lie is told on the answer

    def answer(self, server: MemoryServer, method: str, data: bytes) -> bytes:
        name, method = method, method.lower()
        if method == "inference":
            return self._answer_step(server, data)
        for fault in self._due(method):
            if fault.act in LIES:
                data = self._lie_unary(name, data, fault)
        return data

    def _answer_step(self, server: MemoryServer, data: bytes) -> bytes:
        if unpack(pb.InferenceResponse, data).message.WhichOneof("kind") != "step":
            return data  # opened, an error, a failed push: not counted
        self.answered["inference"] = self.answered.get("inference", 0) + 1
        for fault in self._due("inference"):
            self.acted += 1
            if fault.act == "crash":
                server.kill()
            elif fault.act == "stall":
                server.stall()
            elif fault.act == "error":
                message = f"scripted {fault.code} on inference"
                return pb.InferenceResponse(error=pb.Error(code=fault.code, message=message)).SerializeToString()
            else:
                data = self._lie_step(data, fault)
        return data

    def _lie_unary(self, name: str, data: bytes, fault: Fault) -> bytes:
        response_type, tensor_field = METHODS[name].response, TENSOR_FIELD[name]
        if fault.act == "empty":
            return response_type().SerializeToString()
        received = unpack(response_type, data)
        tensor = decode_tensor(getattr(received.message, tensor_field), tensor_field, received.payload)
        if fault.act == "no_router":
            received.message.ClearField("router")
        return replace_tensor(received, tensor_field, corrupt(tensor, fault.act, fault.scale))

    def _lie_step(self, data: bytes, fault: Fault) -> bytes:
        step = unpack(pb.InferenceResponse, data)
        result = step.message.step
        if fault.act == "kind":
            opened = pb.SessionOpened(session_id="lie", max_length=result.position)
            return pb.InferenceResponse(opened=opened).SerializeToString()
        if fault.act == "empty":
            return pb.InferenceResponse().SerializeToString()
        hidden = decode_tensor(result.hidden_states, "hidden_states", step.payload)
        packer = Packer()
        lie = pb.StepResult(
            hidden_states=packer.tensor(corrupt(hidden, fault.act, fault.scale)),
            step_id=result.step_id + (fault.act == "step_id"),
            position=result.position + (fault.act == "position"),
        )
        return packer.pack(pb.InferenceResponse(step=lie)).SerializeToString()


class _SharedLoop(BackgroundLoop):
    """The swarm's loop, lent to each of its clients: a client's shutdown leaves it running for the others."""

    def close(self) -> None:
        pass

    def stop(self) -> None:
        super().close()


_connecting: contextvars.ContextVar[FakeSwarm] = contextvars.ContextVar("connecting")


class InMemoryModel(DistributedModelForCausalLM):
    """A client model whose blocks are a FakeSwarm's peers: made by `FakeSwarm.client`, used as any other."""

    def _connect(self, options: ClientConfig, prefix: str) -> None:
        swarm = _connecting.get()
        self._loop = swarm.loop
        self.sequence = swarm.sequence(
            options, hidden_size=self.config.hidden_size, max_positions=self.config.max_position_embeddings
        )


class FakeSwarm:
    """Peers of one model in this process, the directory that lists them, and clients that reach them."""

    def __init__(self, model_path: str | Path):
        self.model_path = Path(model_path)
        self.prefix = prefix_for_model(str(model_path))
        self.num_blocks = load_config(self.model_path).num_hidden_layers
        self.network = Network()
        self.peers: list[FakePeer] = []
        self._announcements = itertools.count(1)
        self._loop: _SharedLoop | None = None

    @property
    def loop(self) -> _SharedLoop:
        """The loop that the clients of `client()` and their peers run on (started at first use)."""
        if self._loop is None:
            self._loop = _SharedLoop("fake-swarm")
        return self._loop

    def on_loop(self, fn) -> None:
        """Call `fn()` on the clients' loop (at once when there is none yet, or when already on it)."""
        loop = self._loop.loop if self._loop is not None else None
        if loop is None or not loop.is_running() or threading.current_thread() is self._loop._thread:
            fn()
            return
        asyncio.run_coroutine_threadsafe(_call(fn), loop).result(10)

    def add_peer(
        self,
        start: int,
        end: int,
        *,
        throughput: float = 1.0,
        cache_tokens: int = 4096,
        limits: ServingLimits | None = None,
        faults: list[Fault] = (),
        announce: str | None = None,
        key_of: FakePeer | None = None,
        adapters: dict[str, Path] | None = None,
    ) -> FakePeer:
        """A peer serving blocks [start, end), ONLINE in the directory from now on.

        With `announce`, its record names that endpoint (another peer's, say) and its own server is reached by nobody.
        With `key_of`, it holds that peer's key: the same peer id (that peer should have left the directory).
        With `adapters` (name -> peft folder), it serves those LoRA adapters too, as `swarmlm peer --adapters` does.
        """
        peer = FakePeer(
            self,
            len(self.peers),
            start,
            end,
            throughput=throughput,
            cache_tokens=cache_tokens,
            limits=limits or ServingLimits(),
            faults=list(faults),
            announce=announce,
            key=key_of.key if key_of is not None else len(self.peers),
            adapters=adapters,
        )
        self.peers.append(peer)
        if announce is None:
            self.network.servers[peer.endpoint] = peer.server
        return peer

    def peer(self, peer_id: str) -> FakePeer:
        """The peer in the directory under `peer_id`."""
        (found,) = [p for p in self.peers if p.peer_id == peer_id and p.in_directory]
        return found

    def restart(self, peer: FakePeer) -> FakePeer:
        """`peer` crashes and comes back with its key (its peer id) at another endpoint; the new record replaces its."""
        peer.kill()
        peer.in_directory = False
        return self.add_peer(peer.start, peer.end, throughput=peer.throughput, key_of=peer)

    async def announced_endpoints(self) -> set[str]:
        """What a peer reads of the directory before it pushes a step: the endpoints of ONLINE records."""
        return {info.endpoint for info in self.directory(self.prefix, self.num_blocks).online().values()}

    def directory(self, prefix: str, num_blocks: int) -> SwarmSnapshot:
        """What a client reads from the DHT: a record of every peer in the directory; live ones announced anew."""
        assert (prefix, num_blocks) == (self.prefix, self.num_blocks), (prefix, num_blocks)
        listed = [p for p in self.peers if p.in_directory]
        for peer in listed:
            if peer.alive or not peer.expiration:
                peer.expiration = 1e9 + next(self._announcements)
        return SwarmSnapshot(
            num_blocks=self.num_blocks,
            servers={p.peer_id: p.record() for p in listed},
            expirations={p.peer_id: p.expiration for p in listed},
            public_keys={p.peer_id: p.identity.public_key for p in listed},
        )

    def sequence(self, config: ClientConfig | None = None, **options) -> RemoteSequence:
        """A RemoteSequence on these peers, for the running loop (`config` defaults to ClientConfig's own)."""
        config = config or ClientConfig(initial_peers=INITIAL_PEERS)
        pool = ChannelPool(config.max_message_bytes, max_channels=config.max_channels, connect=self.network.connect)
        return RemoteSequence(
            None, self.prefix, self.num_blocks, config, pool=pool, directory=self.directory, **options
        )

    def client(self, **options) -> InMemoryModel:
        """`from_pretrained` of the model, reaching these peers: `options` are ClientConfig's fields."""
        token = _connecting.set(self)
        try:
            return InMemoryModel.from_pretrained(str(self.model_path), initial_peers=INITIAL_PEERS, **options)
        finally:
            _connecting.reset(token)

    def close(self) -> None:
        """End every call and task still running on the clients' loop, then stop the loop and the peers."""
        if self._loop is not None:
            self._loop.run(_cancel_others())
            self._loop.stop()
        for peer in self.peers:
            peer.servicer.close()

    def __enter__(self) -> FakeSwarm:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


async def _call(fn) -> None:
    fn()


async def _cancel_others() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
