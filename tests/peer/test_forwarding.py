"""Where a peer pushes steps (peer/forwarding.py): only to endpoints that ONLINE records of the model announce, the
directory read again at most every DIRECTORY_REFRESH_S for an endpoint not seen, and the client told why."""

from __future__ import annotations

import asyncio

import pytest
import torch

from peer.forwarding import DIRECTORY_REFRESH_S, Forwarder, NotAnnounced, failure_report
from protocol import swarmlm_pb2 as pb


class Directory:
    def __init__(self, endpoints: set[str]):
        self.endpoints, self.reads = endpoints, 0

    async def __call__(self) -> set[str]:
        self.reads += 1
        return set(self.endpoints)


class Recording(Forwarder):
    """Pushes nowhere: records the endpoints it would have opened a channel to."""

    def __init__(self, directory: Directory):
        super().__init__(None, 1 << 20, directory)
        self.dialed: list[str] = []

    def _stub(self, endpoint: str):
        self.dialed.append(endpoint)

        class Stub:
            async def push(self, request, timeout, metadata):
                return pb.PushResponse()

        return Stub()


def _push(forwarder: Forwarder, endpoint: str) -> None:
    hop = pb.NextHop(endpoint=endpoint, session_id="s", push_token=b"t", step_id=1)
    asyncio.run(forwarder.push([hop], torch.zeros(1, 1, 4), None, None, pb.InferenceStep()))


def test_a_push_goes_only_to_an_announced_endpoint():
    directory = Directory({"10.0.0.1:31330"})
    forwarder = Recording(directory)
    _push(forwarder, "10.0.0.1:31330")
    assert forwarder.dialed == ["10.0.0.1:31330"] and forwarder.pushed == 1

    for _ in range(5):  # a client names any host:port: no channel is opened, nor the directory read again so soon
        with pytest.raises(NotAnnounced) as caught:
            _push(forwarder, "192.168.1.1:22")
    assert forwarder.dialed == ["10.0.0.1:31330"] and directory.reads == 1
    assert "no ONLINE peer of this model announces" in failure_report(caught.value)

    directory.endpoints.add("10.0.0.2:31330")  # a peer joins: seen at the next read, DIRECTORY_REFRESH_S later
    forwarder._read_at -= DIRECTORY_REFRESH_S
    _push(forwarder, "10.0.0.2:31330")
    assert forwarder.dialed[-1] == "10.0.0.2:31330" and directory.reads == 2
