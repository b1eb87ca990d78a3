"""Wire overhead: one hop of our RPC with no model compute, vs a bare gRPC echo of the same bytes.

All in one fresh process (see `measure`), on one event loop (the client library's kind), over loopback TCP:
  bare    grpc.aio unary echo of the raw tensor bytes (generic handler, no protobuf)
  ours    the client's request building (packing.Packer, protobuf), a real PeerServicer (decode, validation,
          compute thread hop, encode) over a span that returns its input unchanged, and the client's decode;
          decode-step and prefill payloads go over the inference stream, the training payload over Forward
  p2p     hivemind's P2P unary call echoing the same tensor message (libp2p through the p2pd daemons)
  libp2p  ours, through the peer's libp2p tunnel (swarm/net/tunnel.py): how clients reach a peer they cannot
          connect to; the same gRPC calls, over a local listener, a libp2p stream and the peer's tunnel
  relay   ours through a relay (swarm/net/relay.py) between client and peer, as for a peer behind NAT
The ratio is ours / bare per call; the target is at most 1.5x. A relayed decode step may add at most 2 ms to
ours direct. All three libp2p nodes are in this process's machine, so loopback hides the relay's own link.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import grpc
import torch

from bench.stats import Row, Summary, Target
from client.loop import BackgroundLoop
from client.transport import ChannelPool, InferenceStream
from peer.cache import CacheBudget
from peer.config import ServingLimits
from peer.handler import PeerServicer
from protocol import swarmlm_pb2 as pb
from protocol.codec import decode_tensor
from protocol.packing import Packer
from protocol.service import make_generic_handler
from swarm.net.relay import RelayService, register
from swarm.net.tunnel import TunnelPool, TunnelServer, tunnel_address

WIRE_TARGET = Target("ratio", "<=", 1.5, "<= 1.5x bare echo")
RELAY_TARGET = Target("excess", "<=", 2.0, "<= 2 ms over gRPC direct")
_MAX_BYTES = 256 * 1024 * 1024
_PREFIX = "bench-echo"


class _Config:
    def __init__(self, hidden_size: int):
        self.hidden_size, self.max_position_embeddings = hidden_size, 1 << 20
        self.num_hidden_layers = 1 << 10  # pushes it takes may name any number of hops


class _NoCache:
    layers: ClassVar[list] = []  # nothing to rewind when a step starts over at position 0


class EchoSpan:
    """Stands in for a BlockSpan: no compute, the output is the input."""

    def __init__(self, hidden_size: int, dtype: torch.dtype):
        self.config, self.dtype, self.start, self.end = _Config(hidden_size), dtype, 0, 1
        self.streamer = None  # it holds no blocks to stream in
        self.adapters = None  # nor adapters

    def new_cache(self) -> _NoCache:
        return _NoCache()

    def __call__(
        self,
        hidden,
        mask=None,
        positions=None,
        cache=None,
        prefix_length=0,
        blocks=None,
        between_layers=None,
        adapter=None,
        routers=None,
    ):
        return hidden


def echo_servicer(span: EchoSpan) -> PeerServicer:
    """The peer's real servicer over the echo span."""
    limits = ServingLimits(session_timeout_s=600, alloc_timeout_s=5, activation_cache_bytes=0)
    budget = CacheBudget(1 << 30)
    servicer = PeerServicer(span.config, _PREFIX, budget, limits, pb.InfoResponse)
    servicer.set_span(span)
    return servicer


@dataclass(frozen=True)
class Payload:
    name: str
    shape: tuple[int, int, int]
    stream: bool  # inference stream (decode, prefill) or unary Forward (training)


async def _bare_server(servicer: PeerServicer) -> tuple[grpc.aio.Server, int]:
    async def unary(request: bytes, context) -> bytes:
        return request

    echo = grpc.method_handlers_generic_handler("bench.Echo", {"Unary": grpc.unary_unary_rpc_method_handler(unary)})
    options = [("grpc.max_receive_message_length", _MAX_BYTES), ("grpc.max_send_message_length", _MAX_BYTES)]
    server = grpc.aio.server(options=options)
    server.add_generic_rpc_handlers((echo, make_generic_handler(servicer)))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def _p2p_pair():
    from hivemind.p2p import P2P

    common = dict(host_maddrs=["/ip4/127.0.0.1/tcp/0"], auto_nat=False, nat_port_map=False, use_relay=False)
    server = await P2P.create(**common)
    try:
        client = await P2P.create(initial_peers=await server.get_visible_maddrs(), **common)
    except BaseException:
        await server.shutdown()
        raise

    async def echo(request: pb.Tensor, context) -> pb.Tensor:
        return request

    await server.add_protobuf_handler("echo", echo, pb.Tensor)
    return server, client


async def _libp2p_paths(endpoint: str):
    """(nodes to shut down, client pool, {"libp2p": address, "relay": address}) for a peer serving `endpoint`:
    its tunnel on one libp2p node, a relay on a second, the client on a third."""
    from hivemind.p2p import P2P

    common = dict(host_maddrs=["/ip4/127.0.0.1/tcp/0"], auto_nat=False, nat_port_map=False)
    nodes = [await P2P.create(**common)]
    try:
        maddrs = await nodes[0].get_visible_maddrs()
        nodes += [await P2P.create(initial_peers=maddrs, **common) for _ in range(2)]
        relay, peer, client = nodes
        await RelayService(relay).start()
        await TunnelServer(peer, endpoint).start()
        await register(peer, relay.peer_id)
    except BaseException:
        for node in nodes:
            await node.shutdown()
        raise

    async def get_client():
        return client

    peer_id = peer.peer_id.to_base58()
    addresses = {"libp2p": tunnel_address(peer_id), "relay": tunnel_address(peer_id, relay.peer_id.to_base58())}
    return nodes, ChannelPool(_MAX_BYTES, TunnelPool(get_client)), addresses


async def _measure(hidden_size: int, dtype: torch.dtype, payloads: list[Payload], calls: int, repeats: int) -> dict:
    servicer = echo_servicer(EchoSpan(hidden_size, dtype))
    server, port = await _bare_server(servicer)
    endpoint = f"127.0.0.1:{port}"
    pool = ChannelPool(_MAX_BYTES)
    channel = grpc.aio.insecure_channel(
        endpoint,
        options=[("grpc.max_receive_message_length", _MAX_BYTES), ("grpc.max_send_message_length", _MAX_BYTES)],
    )
    bare_call = channel.unary_unary("/bench.Echo/Unary")
    p2p_server = p2p_client = None
    libp2p_nodes, libp2p_pool, libp2p_addresses = [], None, {}
    results: dict = {"payloads": {}}
    try:
        try:
            p2p_server, p2p_client = await _p2p_pair()
        except Exception as exc:  # reported as not measured, with the reason
            results["p2p_error"] = f"{type(exc).__name__}: {exc}"
        try:
            libp2p_nodes, libp2p_pool, libp2p_addresses = await _libp2p_paths(endpoint)
        except Exception as exc:
            results["libp2p_error"] = f"{type(exc).__name__}: {exc}"
        paths = {
            "ours": (pool, endpoint),
            **{name: (libp2p_pool, address) for name, address in libp2p_addresses.items()},
        }
        for payload in payloads:
            tensor = torch.randn(payload.shape).to(dtype)
            raw = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            seq = payload.shape[1]
            positions = torch.arange(seq).unsqueeze(0)
            streams = {}

            def ours_over(path_pool: ChannelPool, address: str):
                """One of our calls with this payload to the echo peer at `address` (a session of its own)."""
                session_id = uuid.uuid4().hex
                stream = InferenceStream(path_pool, address) if payload.stream else None

                async def call():
                    packer = Packer()
                    if stream is not None:
                        if session_id not in streams:
                            streams[session_id] = stream
                            await stream.request(
                                pb.InferenceRequest(
                                    open=pb.OpenSession(
                                        span=pb.Span(model=_PREFIX, start=0, end=1),
                                        session_id=session_id,
                                        max_length=seq,
                                        batch_size=payload.shape[0],
                                    )
                                ),
                                30,
                            )
                        request = packer.pack(
                            pb.InferenceRequest(
                                step=pb.InferenceStep(
                                    session_id=session_id,
                                    hidden_states=packer.tensor(tensor.to(dtype)),
                                    position_ids=packer.tensor(positions),
                                    prefix_length=0,
                                )
                            )
                        )
                        response = await stream.request(request, 60)
                        return decode_tensor(response.message.step.hidden_states, "hidden_states", response.payload).to(
                            tensor.dtype
                        )
                    request = packer.pack(
                        pb.ForwardRequest(
                            span=pb.Span(model=_PREFIX, start=0, end=1),
                            hidden_states=packer.tensor(tensor.to(dtype)),
                            position_ids=packer.tensor(positions),
                        )
                    )
                    response = await path_pool.unary(address, "forward", request, 60)
                    return decode_tensor(response.message.hidden_states, "hidden_states", response.payload).to(
                        tensor.dtype
                    )

                return call

            async def bare():
                return await bare_call(raw, timeout=60)

            message = pb.Tensor(shape=list(payload.shape), dtype=str(dtype).removeprefix("torch."), data=raw)

            async def p2p():
                return await p2p_client.call_protobuf_handler(p2p_server.peer_id, "echo", message, pb.Tensor)

            methods = {"bare": bare, **{name: ours_over(*path) for name, path in paths.items()}}
            if p2p_client is not None:
                methods["p2p"] = p2p
            samples = {name: [] for name in methods}
            errors = {}
            for name, fn in methods.items():  # warm-up; a transport that refuses the payload is reported so
                try:
                    for _ in range(10):
                        await fn()
                except Exception as exc:
                    errors[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
            working = {name: fn for name, fn in methods.items() if name not in errors}
            for _ in range(repeats * calls):  # interleaved call by call: load on the machine hits all alike
                for name, fn in working.items():
                    began = time.perf_counter()
                    await fn()
                    samples[name].append(time.perf_counter() - began)
            for stream in streams.values():
                await stream.close()
            results["payloads"][payload.name] = {
                "samples": samples,
                "errors": errors,
                "bytes": len(raw),
                "path": "inference stream step" if payload.stream else "Forward unary",
            }
    finally:
        await channel.close(grace=None)
        await pool.close()
        if libp2p_pool is not None:
            await libp2p_pool.close()
        for node in libp2p_nodes:
            await node.shutdown()
        await server.stop(grace=None)
        servicer.close()
        for p2p_node in (p2p_client, p2p_server):
            if p2p_node is not None:
                await p2p_node.shutdown()
    return results


def payloads_for(hidden_size: int, train_batch: int, train_seq: int) -> list[Payload]:
    return [
        Payload("decode step", (1, 1, hidden_size), True),
        Payload("prefill 128", (1, 128, hidden_size), True),
        Payload(f"train {train_batch}x{train_seq}", (train_batch, train_seq, hidden_size), False),
    ]


def measure(
    hidden_size: int,
    dtype: str,
    *,
    train_batch: int,
    train_seq: int,
    calls: int,
    repeats: int,
    threads: int,
    omp_passive: bool = True,
) -> dict:
    """Run the measurement in a fresh process and return its samples (seconds per call) and errors.

    A fresh process because a gRPC server leaves threads behind, and hivemind forks its DHT process: a fork
    after gRPC was used in-process can hang. It also gets the peers' torch threads and OpenMP wait policy.
    """
    command = [
        sys.executable,
        "-m",
        "bench.scenarios.wire",
        "--hidden",
        str(hidden_size),
        "--dtype",
        dtype,
        "--train-batch",
        str(train_batch),
        "--train-seq",
        str(train_seq),
        "--calls",
        str(calls),
        "--repeats",
        str(repeats),
        "--threads",
        str(threads),
    ]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"} if omp_passive else None
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=900, cwd=Path(__file__).resolve().parents[2], env=env
    )
    if done.returncode != 0:
        raise RuntimeError(f"the wire measurement failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def rows_from(config_name: str, hidden_size: int, dtype: str, results: dict) -> list[Row]:
    rows = []
    for name, found in results["payloads"].items():
        samples, errors = found["samples"], found["errors"]
        if not samples.get("bare") or not samples.get("ours"):
            raise RuntimeError(f"wire {name}: {errors}")
        bare = Summary.of(samples["bare"]).scaled(1e3)
        variant = f"{name}, {found['bytes'] / 1024:.0f} KiB"
        p2p = samples.get("p2p") or []
        extra = {"hidden_size": hidden_size, "dtype": dtype, "bytes": found["bytes"], "path": found["path"]}
        if not p2p:
            extra["p2p"] = "not measured: " + (errors.get("p2p") or results.get("p2p_error") or "unknown")
        rows.append(
            Row(
                scenario="wire",
                config=config_name,
                variant=variant,
                metric="ours per hop",
                unit="ms",
                ours=Summary.of(samples["ours"]).scaled(1e3),
                reference=bare,
                reference_name="bare gRPC echo",
                target=WIRE_TARGET,
                extra=extra,
            )
        )
        if p2p:
            rows.append(
                Row(
                    scenario="wire",
                    config=config_name,
                    variant=variant,
                    metric="hivemind P2P unary",
                    unit="ms",
                    ours=Summary.of(p2p).scaled(1e3),
                    reference=bare,
                    reference_name="bare gRPC echo",
                    extra={"bytes": found["bytes"]},
                )
            )
        else:
            rows[-1].extra["p2p"] = extra.get("p2p")
        ours = Summary.of(samples["ours"]).scaled(1e3)
        for name, metric in (("libp2p", "ours over libp2p"), ("relay", "ours through a relay")):
            if not samples.get(name):
                extra[name] = "not measured: " + (errors.get(name) or results.get("libp2p_error") or "unknown")
                continue
            target = RELAY_TARGET if name == "relay" and variant.startswith("decode step") else None
            rows.append(
                Row(
                    scenario="wire",
                    config=config_name,
                    variant=variant,
                    metric=metric,
                    unit="ms",
                    ours=Summary.of(samples[name]).scaled(1e3),
                    reference=ours,
                    reference_name="ours, gRPC direct",
                    target=target,
                    extra={"bytes": found["bytes"], "path": found["path"]},
                )
            )
    return rows


def _main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.scenarios.wire")
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--train-batch", type=int, default=4)
    p.add_argument("--train-seq", type=int, default=256)
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    payloads = payloads_for(args.hidden, args.train_batch, args.train_seq)
    loop = BackgroundLoop(name="bench-wire")
    try:
        results = loop.run(_measure(args.hidden, getattr(torch, args.dtype), payloads, args.calls, args.repeats))
    finally:
        loop.close()
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
