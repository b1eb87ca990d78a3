"""Training groups of a private swarm: a stranger that reaches a member's libp2p daemon can neither join its
averaging rounds nor download its state, while members average and copy state as before. Real hivemind DHT
nodes and averager processes; the stranger is a bare libp2p daemon without the key."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer

from protocol.records import TrainingProgress
from swarm.dht.node import dht_result, start_dht, stop_dht, visible_maddrs
from swarm.training.averaging import TrainingGroup, group_key
from swarm.training.members import GroupProgress, progress_key
from swarm.training.optim import make_optimizer
from swarm.training.recipe import RunRecipe
from swarm.training.rounds import RoundAverager, RoundSettings
from swarm.training.settings import AveragingSettings
from swarm.trust.groupgate import GroupGate
from swarm.trust.swarmkey import SwarmKey

SETTINGS = AveragingSettings(matchmaking_time_s=1.0, averaging_timeout_s=8.0, load_state_timeout_s=15.0)
KEY = SwarmKey(bytes(range(32)))


def test_a_tag_admits_only_its_own_peer_id_under_its_own_key():
    gate, other = GroupGate(KEY), GroupGate(SwarmKey(bytes(32)))
    alice, bob = b"\x12\x20" + b"a" * 32, b"\x12\x20" + b"b" * 32

    def gather(tag) -> bytes:
        return MSGPackSerializer.dumps([1.0, 0, MSGPackSerializer.dumps({"epoch": 3, "member": tag})])

    assert gate.admits(gather(gate.tag(alice)), alice)
    assert not gate.admits(gather(gate.tag(alice)), bob)  # a tag seen in a round is no use to another peer
    assert not gate.admits(gather(other.tag(alice)), alice)
    assert not gate.admits(gather(None), alice)
    for garbage in (
        b"",
        b"\xc1",
        MSGPackSerializer.dumps([1.0, 0]),
        MSGPackSerializer.dumps([1, 0, b"\x90"]),
        b"\x00" * (1 << 17),
    ):
        assert not gate.admits(garbage, alice)


def make_group(dht, value: float) -> TrainingGroup:
    params = [torch.nn.Parameter(torch.full((3, 2), value))]
    return TrainingGroup(
        dht,
        group_key("test-model", "run", "0-2"),
        params,
        make_optimizer(RunRecipe(optimizer="sgd", lr=0.1), params),
        settings=SETTINGS,
        swarm_key=KEY,
    )


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


def test_a_stranger_cannot_join_a_round_or_download_the_state_and_members_can(keyed_dhts):
    first_dht, second_dht = keyed_dhts(2)
    first = make_group(first_dht, 1.0)
    stranger = Stranger(visible_maddrs(first_dht))
    second = None
    try:
        # the first member looks for a group (a round of two); the stranger asks to join it, as a follower would
        rounds: list = []
        looking = threading.Thread(
            target=lambda: rounds.append(first.average([torch.ones(3, 2)], 1, members=2)), daemon=True
        )
        looking.start()
        time.sleep(0.5)
        assert stranger.first_answer_to_join(first.averager) == averaging_pb2.PROTOCOL_VIOLATION
        looking.join(SETTINGS.averaging_timeout_s + 15)
        assert rounds and rounds[0][1] is None, "the round without a second member should have failed"

        first.share_state()
        assert stranger.downloaded_parts(first.averager) == 0

        second = make_group(second_dht, 5.0)
        assert second.load_state() == first.epoch  # a member copies the state
        assert torch.equal(second.params[0].data, first.params[0].data)

        results: dict[str, tuple] = {}
        threads = [
            threading.Thread(
                target=lambda g=g, name=name, v=v: results.__setitem__(
                    name, g.average([torch.full((3, 2), v)], 1, members=2)
                ),
                daemon=True,
            )
            for name, g, v in (("first", first, 1.0), ("second", second, 3.0))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(SETTINGS.averaging_timeout_s + 15)
        for name in ("first", "second"):
            grads, state, _ = results[name]
            assert state is not None, f"{name}: the members' round failed"
            assert torch.allclose(grads[0], torch.full((3, 2), 2.0)), name
    finally:
        stranger.close()
        first.shutdown()
        if second is not None:
            second.shutdown()


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
