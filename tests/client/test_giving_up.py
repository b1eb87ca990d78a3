"""How long a client keeps trying, and whom it avoids meanwhile: the retry budget and the bans, on an in-memory swarm.

tests/client/test_retry.py and test_bans.py hold the rules on plain data; here the same rules run inside a real
client (routing, dialing, directory reads) against peers that fail (tests/helpers/fake_swarm.py).
"""

from __future__ import annotations

import time

import pytest
import torch

from protocol.errors import SwarmError
from tests.helpers.fake_swarm import Fault
from tests.helpers.generation import assert_same_generation, generate_with_logits
from tests.helpers.models import VOCAB_SIZE


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB_SIZE, (1, 5), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("max_retries", [0, 2])
def test_a_request_tries_max_retries_other_peers_then_raises(fake_swarm, tiny_llama_local, max_retries):
    """Every peer fails every answer: a generation step and a forward each try max_retries + 1 peers, banning all
    but the last, and raise that one's error."""
    peers = [
        fake_swarm.add_peer(0, 4, throughput=10 - i, faults=[Fault("error"), Fault("error", method="forward")])
        for i in range(2 * max_retries + 2)  # enough for both requests without waiting for a ban to run out
    ]
    remote = fake_swarm.client(max_retries=max_retries, retry_delay_s=0.01, verify_fraction=0.0)
    try:
        with pytest.raises(SwarmError, match="scripted internal on inference"):
            remote.generate(_ids(1), max_new_tokens=2, do_sample=False)
        asked = [peer for peer in peers if peer.answered.get("inference")]
        assert asked == peers[: max_retries + 1] and remote.sequence.failovers == max_retries
        assert remote.sequence.bans.banned() == {peer.peer_id for peer in asked[:-1]}

        with pytest.raises(SwarmError, match="scripted internal on forward"):
            with torch.no_grad():
                remote(_ids(2))
        asked = [peer for peer in peers if peer.answered.get("forward")]
        assert len(asked) == max_retries + 1 and remote.sequence.failovers == 2 * max_retries
    finally:
        remote.shutdown()


class Clock:
    def __init__(self):
        # behind the clock the directory reads are timed with: every read counts as one after the failures
        self.now = time.monotonic() - 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_failed_peer_is_banned_longer_each_time_and_used_again_once_it_announced(fake_swarm, tiny_llama_local):
    """The preferred peer fails a step: banned for 1 s, then 2 s, then 4 s (client/bans.py), routed around while
    banned and used again afterwards, as long as it announced itself since; a crashed one stays banned after."""
    faults = [Fault("error", after=2, times=1), Fault("error", after=5, times=1), Fault("crash", after=7)]
    faulty = fake_swarm.add_peer(0, 4, throughput=10, faults=faults)
    other = fake_swarm.add_peer(0, 4)
    remote = fake_swarm.client(retry_delay_s=0.0, directory_refresh_s=1e-3)  # bans start at 1 s
    bans, clock, lengths = remote.sequence.bans, Clock(), []
    bans.clock, ban = clock, bans.ban
    bans.ban = lambda peer_id, at_least_s=0.0: lengths.append(ban(peer_id, at_least_s)) or lengths[-1]
    routes = []

    def generate(seed: int) -> None:
        ids = _ids(seed)
        expected = generate_with_logits(tiny_llama_local, ids, max_new_tokens=4, do_sample=False)
        with remote.inference_session(max_length=16) as session:
            assert_same_generation(generate_with_logits(remote, ids, max_new_tokens=4, do_sample=False), expected)
            routes.append([s.hop.peer_id for s in session.remote.spans])

    try:
        generate(3)  # its third step fails: replayed on the other peer
        assert lengths == [1.0] and routes[-1] == [other.peer_id]
        generate(4)
        assert faulty.answered["inference"] == 3, "a banned peer was used"
        clock.now += 1.01
        generate(5)  # unbanned (it announced since), and its sixth step fails
        assert lengths == [1.0, 2.0] and faulty.answered["inference"] == 6 and routes[-1] == [other.peer_id]
        clock.now += 2.01
        generate(6)  # unbanned again, and it crashes at its eighth step
        assert lengths == [1.0, 2.0, 4.0] and faulty.server.down and routes[-1] == [other.peer_id]
        clock.now += 4.01
        assert faulty.peer_id not in bans.banned(), "the ban did not run out"
        generate(7)
        snapshot = remote._run(remote.sequence.snapshot())
        assert faulty.peer_id in bans.banned(snapshot.expirations), "a peer silent since it failed is not banned"
        assert bans.strikes(faulty.peer_id) == 3 and bans.strikes(other.peer_id) == 0
    finally:
        remote.shutdown()
