"""Which peers of a run sit an update out, and why: the step's log names each (client/training/stages.py)."""

import asyncio

from client.training.stages import Member, Stages
from protocol import swarmlm_pb2 as pb
from protocol.records import ServerInfo, ServerState
from swarm.dht.snapshot import SwarmSnapshot


class Directory:
    """The part of a RemoteSequence that Stages reads for this: the latest directory snapshot."""

    def __init__(self, online: list[str]):
        self.online = online

    async def snapshot(self, *, refresh: bool = False) -> SwarmSnapshot:
        servers = {
            pid: ServerInfo(
                state=ServerState.ONLINE,
                start_block=0,
                end_block=2,
                throughput=1.0,
                cache_tokens_left=0,
                dtype="float32",
                version="1",
                endpoint="127.0.0.1:1",
                run_id="r",
            )
            for pid in self.online
        }
        return SwarmSnapshot(num_blocks=2, servers=servers)


def member(pid: str, epoch: int) -> Member:
    return Member(pid, (0, 2), "127.0.0.1:1", epoch, pb.RoundStatus(epoch=epoch))


def test_every_peer_of_the_run_outside_the_update_is_named_with_why():
    directory = Directory(["a", "b", "c", "d", "e", "f"])
    stages = Stages(directory, "r")
    stages.refused.add("f")  # killed: its port refuses, its record has not lapsed
    stages.answered = {"a": member("a", 5), "b": member("b", 5), "c": member("c", 4), "e": member("e", 5)}
    first = asyncio.run(stages.left_out({(0, 2): {"a": member("a", 5), "b": member("b", 5)}}, 5))
    assert first == {
        "c": "at update 4",
        "d": "no Info answer within 5s",
        "e": "joined after the stages were read",
        "f": "refuses connections: gone, its directory record not lapsed yet",
    }
    # the next update: b took part in the last one, d and e sat it out (still behind), and this directory read
    # misses all three (their DHT nodes were stopped, or too busy to renew their records)
    directory.online = ["a", "c"]
    stages.answered = {"a": member("a", 6), "c": member("c", 6)}
    second = asyncio.run(stages.left_out({(0, 2): {"a": member("a", 6), "c": member("c", 6)}}, 6))
    assert second == dict.fromkeys("bdef", "not in the directory just now")
    # named once: peers gone for good do not fill every step's faults
    assert asyncio.run(stages.left_out({(0, 2): {"a": member("a", 7), "c": member("c", 7)}}, 7)) == {}
