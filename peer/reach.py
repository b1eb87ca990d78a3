"""How clients reach a peer: direct gRPC, or gRPC through libp2p streams, through a relay from behind NAT.

`--transport auto` asks DHT neighbours (the initial peers) to connect back to the gRPC endpoint
(swarm/net/reachability.py). A peer they reach announces its endpoint; one they cannot reach leaves the DHT as a
full node (others could not reach it there either), rejoins as a DHT client, registers with relays among its
initial peers or among the peers that announce `--relay` (swarm/net/relay.py), and announces "p2p" with those
relays. Every peer also serves its gRPC server through libp2p streams (swarm/net/tunnel.py), the fallback of
clients that cannot connect to the endpoint; peers others can reach answer probes, and relay with `--relay`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

import hivemind
from hivemind.p2p import PeerID

from peer.config import PeerConfig, TransportMode
from protocol.errors import PeerUnavailableError
from protocol.vocab import Transport
from swarm.dht.node import peer_ids_of, start_dht, stop_dht
from swarm.net.reachability import ProbeService, probe
from swarm.net.relay import RelayRegistrar, RelayService
from swarm.net.tunnel import TunnelServer
from swarm.trust.rpcauth import RpcAuth

logger = logging.getLogger(__name__)

Discover = Callable[[hivemind.DHT], Awaitable[Sequence[PeerID]]]  # relays the directory knows of, through a DHT node


class Reach:
    """The transport a peer announces, and the libp2p services behind it. `dht` may be replaced by `decide`."""

    def __init__(self, config: PeerConfig, auth: RpcAuth | None = None):
        self.config, self.auth = config, auth
        self.transport = Transport.DIRECT
        self.registrar: RelayRegistrar | None = None
        self._services: list = []
        self._renewing: asyncio.Task | None = None
        self._p2p: hivemind.P2P | None = None

    @property
    def relays(self) -> tuple[str, ...]:
        return tuple(relay.to_base58() for relay in self.registrar.relays) if self.registrar else ()

    async def decide(self, dht: hivemind.DHT, endpoint: str, discover: Discover | None = None) -> hivemind.DHT:
        """Probe (unless told the transport), rejoin as a DHT client behind NAT; the DHT node to go on with.

        Behind NAT, the relays tried are the initial peers, then those `discover` finds.

        Raises:
            PeerUnavailableError: nobody can reach this peer and no relay took it.
        """
        cfg = self.config
        reachable = True
        if cfg.transport != TransportMode.DIRECT:
            neighbours = peer_ids_of(cfg.initial_peers)
            result = await probe(await dht.replicate_p2p(), neighbours, endpoint) if neighbours else None
            if result is None or result.reachable is None:
                logger.info(
                    "no neighbour could check whether %s is reachable (%s); taking it as reachable",
                    endpoint,
                    "no initial peers" if result is None else "; ".join(result.details),
                )
            else:
                reachable = result.reachable
                logger.info(
                    "%s is %sreachable from the swarm: %s",
                    endpoint,
                    "" if reachable else "not ",
                    "; ".join(result.details),
                )
        if not reachable:
            identity = getattr(dht, "identity", None)  # the same key: clients know the peer by it
            await (await dht.replicate_p2p()).shutdown()  # its tasks live on this loop
            await asyncio.to_thread(stop_dht, dht)
            dht = await asyncio.to_thread(
                start_dht, cfg.initial_peers, client_mode=True, identity=identity, swarm_key=cfg.swarm_key
            )
            logger.info("rejoined the DHT as a client, %s, to serve through a relay", dht.peer_id.to_base58())
            self.registrar = RelayRegistrar(
                await dht.replicate_p2p(),
                peer_ids_of(cfg.initial_peers),
                discover=None if discover is None else lambda: discover(dht),
            )
            if not await self.registrar.register():
                raise PeerUnavailableError(
                    f"this peer cannot be reached at {endpoint}, and no relay among its --initial-peers took it: "
                    f"pass the address of a bootstrap node or of a peer started with --relay, or forward a port "
                    f"to it and pass --announce-host HOST:PORT with --transport direct"
                )
            logger.info("registered with relay(s) %s", ", ".join(self.relays))
        direct = cfg.transport == TransportMode.DIRECT or (cfg.transport == TransportMode.AUTO and reachable)
        self.transport = Transport.DIRECT if direct else Transport.P2P
        if cfg.relay and not reachable:
            logger.warning("--relay is ignored: a peer that others cannot connect to cannot relay for them")
        return dht

    async def start(self, dht: hivemind.DHT, grpc_endpoint: str, on_relays_changed) -> None:
        """Serve the tunnel (and, where others can connect, probes and maybe relaying); renew relays."""
        self._p2p = p2p = await dht.replicate_p2p()
        self._services = [TunnelServer(p2p, grpc_endpoint)]
        if self.registrar is None:
            self._services.append(ProbeService(p2p, auth=self.auth))
            if self.config.relay:
                self._services.append(RelayService(p2p))
        for service in self._services:
            await service.start()
        if self.registrar is not None:
            self._renewing = asyncio.create_task(self.registrar.run_forever(on_relays_changed))

    def describe(self, endpoint: str, peer_id: str) -> str:
        if self.transport == Transport.DIRECT:
            return endpoint
        return f"libp2p as {peer_id}" + (f" through relay(s) {', '.join(self.relays)}" if self.relays else "")

    async def stop(self) -> None:
        if self._renewing is not None:
            self._renewing.cancel()
        for service in self._services:
            await service.stop()
        if self._p2p is not None:  # its tasks live on this loop: end them before the loop does
            await self._p2p.shutdown()
