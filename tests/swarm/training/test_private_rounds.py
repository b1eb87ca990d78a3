"""Training groups of a private swarm: a stranger that reaches a member's libp2p daemon can neither join its rounds
nor download its state, and a key holder gets the state only once its signed progress is in the group. Real
hivemind DHT nodes and averager processes; the stranger is a bare libp2p daemon without the key."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer

from protocol.records import TrainingProgress
from swarm.dht.node import dht_result, start_dht, stop_dht, visible_maddrs
from swarm.training.group import group_key
from swarm.training.members import GroupProgress, progress_key
from swarm.training.rounds import RoundAverager, RoundSettings
from swarm.training.settings import AveragingSettings
from swarm.trust.swarmkey import SwarmKey

SETTINGS = AveragingSettings(matchmaking_time_s=1.0, averaging_timeout_s=8.0, load_state_timeout_s=15.0)
KEY = SwarmKey(bytes(range(32)))


@pytest.fixture
def keyed_dhts():
    started = []

    def start(count: int):
        for _ in range(count):
            started.append(start_dht(visible_maddrs(started[0]) if started else (), swarm_key=KEY))
        return started

    yield start
    for dht in started:
        stop_dht(dht)


class Stranger:
    """A libp2p daemon without the swarm key, connected to a member's daemon, calling its averager directly."""

    def __init__(self, maddrs: list[str]):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.p2p = self.run(P2P.create(initial_peers=maddrs))

    def run(self, coro, timeout_s: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stub(self, averager):
        return type(averager).get_stub(self.p2p, PeerID(averager.dht.peer_id.to_bytes()), namespace=averager.prefix)

    def first_answer_to_join(self, averager) -> int:
        async def join():
            request = averaging_pb2.JoinRequest(
                schema_hash=averager.schema_hash,
                expiration=get_dht_time() + 30,
                client_mode=False,
                gather=MSGPackSerializer.dumps([1.0, 0, MSGPackSerializer.dumps({"epoch": 0})]),
                group_key=f"{averager.prefix}.0b",
            )
            async for message in await self.stub(averager).rpc_join_group(request):
                return message.code

        return self.run(join())

    def downloaded_parts(self, averager) -> int:
        async def download():
            return len(
                [part async for part in await self.stub(averager).rpc_download_state(averaging_pb2.DownloadRequest())]
            )

        return self.run(download())

    def close(self) -> None:
        try:
            self.run(self.p2p.shutdown(), timeout_s=10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)


def test_known_rounds_of_a_private_swarm_give_the_state_only_to_members_with_signed_progress(keyed_dhts):
    holder_dht, member_dht, keyed_dht = keyed_dhts(3)
    key = group_key("test-model", "run", "2-4")
    state = [torch.arange(6, dtype=torch.float32)]
    averagers = [
        RoundAverager(
            [torch.zeros(3)],
            dht,
            prefix="test_gate_rounds",
            settings=RoundSettings(sender_timeout_s=4.0),
            state=lambda: (2, state),
            private=True,
            progress_key=progress_key(key),
        )
        for dht in (holder_dht, member_dht, keyed_dht)
    ]
    holder, member, keyed = averagers
    stranger = Stranger(visible_maddrs(holder_dht))
    try:
        holder.serve_state()
        # no matchmaking at all: nobody joins a round, whatever tag it brings
        assert stranger.first_answer_to_join(holder) == averaging_pb2.PROTOCOL_VIOLATION
        assert stranger.downloaded_parts(holder) == 0
        # a key holder that published no progress in the group is no member of it either
        with pytest.raises(RuntimeError, match="sent no state"):
            keyed.download_state(holder.member_id, timeout_s=10, max_bytes=1 << 20)
        progress = GroupProgress(member_dht, key, ttl_s=60)
        dht_result(member_dht, progress.publish(TrainingProgress(epoch=0, samples=0)), "publishing")
        [got] = member.download_state(holder.member_id, timeout_s=10, max_bytes=1 << 20)
        assert torch.equal(got, state[0])
    finally:
        stranger.close()
        for averager in averagers:
            averager.shutdown()
