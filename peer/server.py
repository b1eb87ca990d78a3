"""The peer daemon's lifecycle: join the DHT, serve gRPC (directly or through libp2p), pick and load blocks,
announce, leave cleanly."""

from __future__ import annotations

import asyncio
import functools
import logging
import random
from pathlib import Path

import grpc
import torch
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from peer.adapters import ServedAdapters, adapter_records, read_adapter
from peer.blocks import load_span, resolve_dtype
from peer.cache import CacheBudget
from peer.capacity import capacity, choose_quantization, held_bytes, room
from peer.config import WILDCARD_HOSTS, PeerConfig, QuantizeChoice
from peer.experts import ExpertCaches
from peer.forwarding import Forwarder
from peer.handler import PeerServicer
from peer.offload import (
    DiskStore,
    HostStore,
    MemoryPlan,
    Store,
    kv_token_bytes,
    plan_memory,
)
from peer.placement_view import PlacementView
from peer.reach import Reach
from peer.throughput import measure_throughput
from protocol import swarmlm_pb2 as pb
from protocol.records import (
    MAX_CACHE_TOKENS,
    MAX_COUNT,
    MAX_THROUGHPUT,
    PROTOCOL_VERSION,
    ModelRecord,
    ServerInfo,
    ServerState,
    check_prefix,
    prefix_for_model,
    record_ttl_s,
)
from protocol.service import WINDOW_OPTIONS, make_generic_handler
from protocol.vocab import Offload, Quantization, Transport
from swarm.dht.directory import announce, fetch_snapshot, unstored
from swarm.dht.node import start_dht, stop_dht, visible_maddrs
from swarm.dht.snapshot import SwarmSnapshot
from swarm.models.checkpoint import load_config, resolve_model_path
from swarm.net.tunnel import TunnelPool
from swarm.paths import default_cache_dir
from swarm.placement import choose_span, should_move
from swarm.trust.identity import claim_identity, load_identity, prove_identity
from swarm.trust.rpcauth import RpcAuth, add_port, server_interceptors

logger = logging.getLogger(__name__)


def grpc_server(cfg: PeerConfig, auth: RpcAuth | None) -> grpc.aio.Server:
    """The peer's gRPC server, with no port and no handler yet: the config's caps on one message and on the calls
    served at once (beyond them, gRPC refuses a new call with RESOURCE_EXHAUSTED), and the swarm key's check."""
    options = [
        ("grpc.max_receive_message_length", cfg.max_message_bytes),
        ("grpc.max_send_message_length", cfg.max_message_bytes),
        ("grpc.so_reuseport", 0),
        *WINDOW_OPTIONS,
    ]
    return grpc.aio.server(
        options=options, interceptors=server_interceptors(auth), maximum_concurrent_rpcs=cfg.max_concurrent_rpcs
    )


class PeerServer:
    """One peer: `await start()`, serve until told to stop, then `await shutdown()` (idempotent)."""

    def __init__(self, config: PeerConfig):
        self.config = config
        self.dht = None
        self.span = None
        self.servicer: PeerServicer | None = None
        self.forwarder: Forwarder | None = None  # pushes inference steps on to the next peer of a route
        self.placement: PlacementView | None = None  # what placement decisions count (set once the peer id is final)
        self.grpc_server: grpc.aio.Server | None = None
        self.endpoint: str | None = None
        self.auth = RpcAuth(config.swarm_key) if config.swarm_key is not None else None
        self.reach = Reach(config, self.auth)
        self.throughput = 0.0
        self.budget = CacheBudget(config.cache_tokens, config.max_cache_share)
        self.ready = asyncio.Event()
        self._announcer: asyncio.Task | None = None
        self._rebalancer: asyncio.Task | None = None
        self.blocks: tuple[int, int] | None = None
        self.state = ServerState.JOINING
        self.joined_at = 0.0  # DHT time when it began joining its current blocks
        self.identity = None
        self.training = None  # peer.training.SpanTraining with --train
        self._trainer: asyncio.Task | None = None
        self._shut_down = False
        self.adapters = [read_adapter(name, folder) for name, folder in config.adapters.items()]
        # how the blocks hold their linear weights; --quantize auto is decided once the blocks are known
        auto = config.quantization == QuantizeChoice.AUTO
        self.quantization = Quantization.NONE if auto else Quantization(config.quantization)

    @property
    def peer_id(self) -> str:
        return self.dht.peer_id.to_base58()

    async def join_swarm(self) -> None:
        """Read the model's config and join the DHT (idempotent; `start()` calls it if needed)."""
        if self.dht is not None:
            return
        cfg = self.config
        self.path = resolve_model_path(cfg.model)
        self.model_config = load_config(self.path)
        self.prefix = check_prefix(cfg.dht_prefix or prefix_for_model(cfg.model))
        self.num_layers = self.model_config.num_hidden_layers
        self.dtype = resolve_dtype(self.model_config, cfg.dtype)
        self.model_record = ModelRecord(num_blocks=self.num_layers, repository=cfg.model)
        if cfg.blocks is not None and cfg.blocks[1] > self.num_layers:
            raise ValueError(f"--blocks {cfg.blocks[0]}:{cfg.blocks[1]} is outside the model's 0:{self.num_layers}")
        cache_dir = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()
        self.identity = (
            load_identity(cfg.identity_path) if cfg.identity_path else claim_identity(cache_dir / "identity")
        )
        try:
            # with a fixed DHT port, the announced host is where others dial the DHT node too
            announce = cfg.announce_host.partition(":")[0] if cfg.announce_host and cfg.dht_port else None
            self.dht = start_dht(
                cfg.initial_peers,
                host=cfg.host,
                port=cfg.dht_port,
                identity=self.identity,
                swarm_key=cfg.swarm_key,
                announce_host=announce,
            )
        except BaseException:
            self.identity.release()
            raise
        logger.info(
            "joined the DHT as %s (%s)%s",
            self.peer_id,
            " ".join(visible_maddrs(self.dht)),
            f", a private swarm with {cfg.swarm_key.describe()}" if cfg.swarm_key else "",
        )

    async def _announced_endpoints(self) -> set[str]:
        """The gRPC endpoints that ONLINE records of this model announce: where this peer may push steps."""
        snapshot = await asyncio.to_thread(fetch_snapshot, self.dht, self.prefix, self.num_layers)
        return {info.endpoint for info in snapshot.online().values()}

    async def start(self) -> None:
        await self.join_swarm()
        cfg = self.config
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        # serve first (the endpoint goes into every record), with no blocks until they are loaded
        self.forwarder = Forwarder(self.auth, cfg.max_message_bytes, endpoints=self._announced_endpoints)
        self.servicer = PeerServicer(
            self.model_config,
            self.prefix,
            self.budget,
            cfg.serving,
            self._info,
            prove=functools.partial(prove_identity, self.identity),
            forwarder=self.forwarder,
        )
        self.grpc_server = grpc_server(cfg, self.auth)
        self.grpc_server.add_generic_rpc_handlers((make_generic_handler(self.servicer),))
        port = add_port(self.grpc_server, f"{cfg.host}:{cfg.port}", self.auth)
        if port == 0:
            raise OSError(f"cannot listen on {cfg.host}:{cfg.port}; choose another --port")
        self.endpoint = f"{cfg.host}:{port}"
        if cfg.announce_host:  # reached through another address: announce that one
            host, _, announced_port = cfg.announce_host.partition(":")
            self.endpoint = f"{host}:{announced_port or port}"
        await self.grpc_server.start()
        # where others connect, or else through libp2p (which may replace the DHT node: see peer/reach.py)
        self.dht = await self.reach.decide(self.dht, self.endpoint, self._relays_in_directory)
        local_host = "127.0.0.1" if cfg.host in WILDCARD_HOSTS else cfg.host
        await self.reach.start(self.dht, f"{local_host}:{port}", self._relays_changed)
        self.forwarder.tunnels = TunnelPool(self.dht.replicate_p2p)  # placement asks libp2p-only peers through it
        self.placement = PlacementView(self.peer_id, self.forwarder.prove)

        await self._serve_blocks(await self._choose_blocks())
        self._announcer = asyncio.create_task(self._announce_forever())
        if cfg.blocks is None:  # blocks the operator chose stay put
            self._rebalancer = asyncio.create_task(self._rebalance_forever())
        self.ready.set()

    async def _serve_blocks(self, blocks: tuple[int, int]) -> None:
        """Announce JOINING for `blocks`, load them, then serve them and announce ONLINE."""
        cfg = self.config
        self.quantization = self._quantization(blocks)
        self.blocks, self.state, self.joined_at = blocks, ServerState.JOINING, get_dht_time()
        if not self.throughput:  # until measured: nonzero, so newcomers see these blocks as taken
            self.throughput = cfg.throughput or 1.0
        await self._announce(self.state)
        held = f", {self.quantization} weights" if self.quantization != Quantization.NONE else ""
        logger.info("loading blocks %d:%d of %s (%s%s) on %s", *blocks, cfg.model, self.dtype, held, cfg.device)
        stream = None
        if cfg.memory_budget is not None:
            plan = self._memory_plan(blocks)
            logger.info("memory: %s", plan.describe())
            self.budget.resize(plan.cache_tokens)
            if plan.streamed:
                stream = (plan.resident, self._offload_store())
        experts = None
        if cfg.expert_cache:
            store = (
                DiskStore(torch.device("cpu"), self._cache_dir() / "experts") if cfg.expert_store == "disk" else None
            )
            experts = ExpertCaches(
                cfg.expert_cache, torch.device(cfg.device), prefetch=cfg.expert_prefetch, store=store
            )
        self.span = await asyncio.to_thread(
            load_span,
            self.path,
            self.model_config,
            *blocks,
            dtype=self.dtype,
            device=torch.device(cfg.device),
            quantization=self.quantization,
            stream=stream,
            experts=experts,
        )
        if experts is not None:
            where = f"on disk in {experts.store.folder}" if experts.store is not None else "in host memory"
            logger.info("experts: %d a layer on %s, the rest %s", cfg.expert_cache, cfg.device, where)
        if self.adapters:
            self.span.adapters = await asyncio.to_thread(
                ServedAdapters, self.span.layers, self.span.start, self.adapters
            )
            logger.info("serving adapters %s", ", ".join(f"{a.name} ({a.digest})" for a in self.adapters))
        cache_file = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()
        self.throughput = cfg.throughput or await asyncio.to_thread(
            measure_throughput, self.span, cache_file / "throughput.json"
        )
        if cfg.training is not None:
            await self._start_training()
        self.servicer.set_span(self.span)
        self.state = ServerState.ONLINE
        await self._announce(self.state)
        logger.info(
            "ONLINE: serving blocks %d:%d of %s at %s",
            *blocks,
            self.prefix,
            self.reach.describe(self.endpoint, self.peer_id),
        )

    async def _start_training(self) -> None:
        """Join the span's training group: copy its state if it is ahead, then update with it in the background."""
        from peer.training.span import SpanTraining
        from swarm.training.recipe import adopt_recipe

        cfg = self.config.training
        recipe = await asyncio.to_thread(
            adopt_recipe, self.dht, self.prefix, cfg.run_id, cfg.recipe_overrides(), cfg.recipe()
        )
        self.training = SpanTraining(self.span, cfg, recipe, self.prefix)
        # on this (main) thread: hivemind's averager touches signal handlers when it starts its process
        self.training.start_group(self.dht, swarm_key=self.config.swarm_key)
        await asyncio.to_thread(self.training.join)
        self.servicer.set_training(self.training)
        logger.info("training run %r (%s), at update %d", self.training.run_id, recipe.describe(), self.training.epoch)
        self._trainer = asyncio.create_task(self.training.run(self._compute, self.servicer.activations.clear))

    async def _compute(self, fn):
        return await self.servicer.served.run(fn, tokens=1 << 20)

    async def _rebalance_forever(self) -> None:
        """Every ~rebalance period (randomised, so peers do not all decide at once) move if the swarm gains enough."""
        while True:
            await asyncio.sleep(self.config.rebalance_period_s * random.uniform(0.5, 1.5))
            try:
                snapshot = await self._placement_snapshot()
                target = should_move(snapshot, self.peer_id, balance_margin=self.config.balance_margin)
                if target is not None:
                    await self._move(target)
            except Exception as exc:  # a failed check or move is retried next period
                logger.warning("rebalancing failed: %r", exc)

    async def _move(self, blocks: tuple[int, int]) -> None:
        """Leave the current blocks (their sessions fail over to other peers) and serve `blocks` instead."""
        logger.info("moving from blocks %d:%d to %d:%d to balance the swarm", *self.blocks, *blocks)
        self.state = ServerState.OFFLINE
        await self._announce(self.state)
        self.servicer.set_span(None)
        self.span.close()
        self.span = None  # free the old blocks before loading the new ones
        await self._serve_blocks(blocks)

    async def _choose_blocks(self) -> tuple[int, int]:
        cfg = self.config
        if cfg.blocks is not None:
            return cfg.blocks
        count = cfg.num_blocks or self._blocks_that_fit()
        return choose_span(await self._placement_snapshot(), min(count, self.num_layers))

    async def _placement_snapshot(self) -> SwarmSnapshot:
        """The directory as placement counts it: records proven by their endpoints (peer/placement_view.py)."""
        return await self.placement.trusted(
            await asyncio.to_thread(fetch_snapshot, self.dht, self.prefix, self.num_layers)
        )

    def _quantization(self, blocks: tuple[int, int]) -> Quantization:
        """How `blocks` hold their weights: as --quantize says, or with auto the least rounding at which they fit
        (peer/capacity.py); says how many blocks fit at each first."""
        cfg = self.config
        found = capacity(self.path, self.model_config, self.dtype, room(cfg.device, cfg.memory_budget), range(*blocks))
        logger.info("%s", found.describe(self.num_layers))
        if cfg.quantization != QuantizeChoice.AUTO:
            return Quantization(cfg.quantization)
        if cfg.training is not None or cfg.adapters:  # full precision: they train or adapt the weights as they are
            return Quantization.NONE
        asked = cfg.blocks is not None or cfg.num_blocks is not None
        chosen = choose_quantization(found, blocks[1] - blocks[0] if asked else None)
        logger.info("--quantize auto: %s for blocks %d:%d", chosen, *blocks)
        return chosen

    def _memory_plan(self, blocks: tuple[int, int]) -> MemoryPlan:
        """How `--memory-budget` holds `blocks` (block sizes from the checkpoint's headers, as quantized)."""
        cfg = self.config
        sizes = [held_bytes(self.path, self.model_config, i, self.dtype, self.quantization) for i in range(*blocks)]
        token_bytes = kv_token_bytes(self.model_config, *blocks, self.dtype)
        return plan_memory(sizes, token_bytes, cfg.cache_tokens, cfg.memory_budget, cfg.offload)

    def _offload_store(self) -> Store:
        device = torch.device(self.config.device)
        if self.config.offload == Offload.HOST:
            return HostStore(device)
        return DiskStore(device, self._cache_dir() / "offload")

    def _cache_dir(self) -> Path:
        return Path(self.config.cache_dir) if self.config.cache_dir else default_cache_dir()

    def _blocks_that_fit(self) -> int:
        """As many blocks as fit at this peer's quantization, each beside its share of a least KV cache, in
        `--memory-budget` or half the free memory (peer/capacity.py)."""
        cfg = self.config
        found = capacity(self.path, self.model_config, self.dtype, room(cfg.device, cfg.memory_budget))
        return max(1, min(self.num_layers, found.blocks(self.quantization)))

    def _server_info(self, state: ServerState) -> ServerInfo:
        return ServerInfo(
            state=state,
            start_block=self.blocks[0],
            end_block=self.blocks[1],
            throughput=min(float(self.throughput), MAX_THROUGHPUT),  # a tiny span on a big GPU can measure more
            cache_tokens_left=self.budget.tokens_left,
            dtype=str(self.dtype).removeprefix("torch."),
            version=PROTOCOL_VERSION,
            endpoint=self.endpoint or f"{self.config.host}:0",
            transport=self.reach.transport,
            relays=self.reach.relays,
            relay=self.config.relay and self.reach.registrar is None,
            run_id=self.training.run_id if self.training else "",
            epoch=self.training.epoch if self.training else 0,
            samples=self.training.samples if self.training else 0,
            joined_at=self.joined_at,
            quantization=str(self.quantization),
            adapters=adapter_records(self.adapters),
            # a cap beyond what a record holds is no cap a client could meet anyway
            max_request_tokens=min(self.config.serving.work.max_request_tokens, MAX_CACHE_TOKENS),
            max_attention_cost=min(self.config.serving.work.max_attention_cost, MAX_COUNT),
        )

    async def _announce(self, state: ServerState, timeout_s: float = 30.0) -> None:
        info = self._server_info(state)
        stored = announce(
            self.dht,
            self.prefix,
            info,
            self.model_record,
            expiration_s=record_ttl_s(self.config.update_period_s),
            wait=False,
        )
        # awaited as a future, not in a thread: a DHT that died must not keep the process from exiting
        unstored(
            await asyncio.wait_for(asyncio.wrap_future(stored), timeout_s),
            f"announcing {state.name} for blocks {info.start_block}:{info.end_block}",
        )

    async def _relays_in_directory(self, dht) -> list:
        """Peers of this model that others can connect to and that relay (`--relay`)."""
        snapshot = await asyncio.to_thread(fetch_snapshot, dht, self.prefix, self.num_layers)
        return [
            PeerID.from_base58(pid)
            for pid, info in snapshot.online().items()
            if info.relay and info.transport == Transport.DIRECT
        ]

    def _relays_changed(self) -> None:
        """Tell clients the relays through which this peer is reached now, without waiting for the next period."""
        if self.blocks is not None:
            task = asyncio.create_task(self._announce(self.state))
            task.add_done_callback(
                lambda t: (
                    t.cancelled()
                    or t.exception() is None
                    or logger.warning("announcing the new relays failed: %r", t.exception())
                )
            )

    async def _announce_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.update_period_s)
            try:
                await self._announce(self.state)
            except Exception as exc:  # the DHT may be briefly unreachable; try again next period
                logger.warning("re-announcing failed: %s", exc)

    def _info(self) -> pb.InfoResponse:
        return pb.InfoResponse(
            peer_id=self.peer_id,
            model=self.prefix,
            start=self.blocks[0] if self.blocks else 0,
            end=self.blocks[1] if self.blocks else 0,
            version=PROTOCOL_VERSION,
            dtype=str(self.dtype).removeprefix("torch."),
            cache_tokens_left=self.budget.tokens_left,
            throughput=self.throughput,
            max_message_bytes=self.config.max_message_bytes,
            open_sessions=len(self.servicer.streams.sessions),
            queued_work=self.servicer.served.compute.queued,
            abandoned_work=self.servicer.served.compute.abandoned,
            decode_batches=self.servicer.streams.batcher.batches,
            batched_steps=self.servicer.streams.batcher.batched_steps,
            pushed_steps=self.forwarder.pushed if self.forwarder is not None else 0,
            step_timings=self.servicer.streams.step_timings.message(),
            **self._expert_counts(),
        )

    def _expert_counts(self) -> dict[str, int]:
        caches = getattr(self.span, "expert_caches", None)
        if caches is None:
            return {}
        stats = caches.stats
        return dict(
            expert_hits=stats.hits,
            expert_misses=stats.misses,
            expert_prefetched=stats.prefetched,
            expert_prefetch_used=stats.prefetch_used,
        )

    async def shutdown(self) -> None:
        """Announce OFFLINE, stop serving, leave the DHT. Safe to call more than once."""
        if self._shut_down:
            return
        self._shut_down = True
        if getattr(self.span, "expert_caches", None) is not None:
            logger.info("%s", self.span.expert_caches.stats.describe())
        if self.dht is None:
            return  # it never got as far as joining: nothing to stop
        for task in (self._announcer, self._rebalancer, self._trainer):
            if task is not None:
                task.cancel()
        if self.blocks is not None and self.dht.is_alive():
            try:
                await self._announce(ServerState.OFFLINE, timeout_s=3)
            except Exception as exc:
                logger.warning("could not announce OFFLINE: %r", exc)
        await self.reach.stop()
        if self.grpc_server is not None:
            await self.grpc_server.stop(grace=1.0)
        if self.servicer is not None:
            self.servicer.close()
        if self.span is not None:
            self.span.close()  # a streaming span's block files go
        if self.forwarder is not None:
            await self.forwarder.close()
        if self.training is not None:
            await asyncio.to_thread(self.training.shutdown)
        stop_dht(self.dht)
        if self.identity is not None:
            self.identity.release()
        logger.info("peer stopped")
