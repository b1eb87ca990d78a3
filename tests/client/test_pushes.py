"""Inference steps pushed from peer to peer (peer/forwarding.py), on an in-memory swarm: the generation is the local
model's, the peers pushed exactly when the client asked them to, a push that fails turns the session to steps the
client sends that peer itself, and a peer of the chain that crashes is repaired, with identical outputs. tests/integration/test_forwarding.py does it with live processes.

Peers serve the tiny Llama as 0:2, 2:3 (twice: one is the spare) and 3:4: routes have three hops.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.fake_swarm import Fault
from tests.helpers.generation import assert_same_generation, generate_with_logits
from tests.helpers.models import VOCAB_SIZE


def _ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB_SIZE, (1, length), generator=torch.Generator().manual_seed(seed))


def _chain(swarm, faults: list[Fault] = ()):
    """Peers of 0:2, 2:3 (the one routed to, following `faults`), its spare, and 3:4."""
    return (
        swarm.add_peer(0, 2),
        swarm.add_peer(2, 3, throughput=10.0, faults=faults),
        swarm.add_peer(2, 3),
        swarm.add_peer(3, 4),
    )


@pytest.mark.parametrize(
    "forward_steps, options",
    # auto pushes towards peers at least forward_min_rtt_s away: with a minute none is, however busy the machine,
    # and with 0 all are
    [(True, {}), (False, {}), ("auto", {"forward_min_rtt_s": 60.0}), ("auto", {"forward_min_rtt_s": 0.0})],
    ids=["always", "never", "auto-all-near", "auto-all-far"],
)
def test_steps_travel_peer_to_peer_and_stay_exact(fake_swarm, tiny_llama_local, forward_steps, options):
    first, middle, spare, last = _chain(fake_swarm)
    ids = _ids(7, seed=1)
    expected = generate_with_logits(tiny_llama_local, ids, max_new_tokens=20, do_sample=False)
    remote = fake_swarm.client(forward_steps=forward_steps, **options)
    try:
        with remote.inference_session(max_length=40) as session:
            got = generate_with_logits(remote, ids, max_new_tokens=20, do_sample=False)
            route = [s.hop.peer_id for s in session.remote.spans]
        failovers = remote.sequence.failovers
    finally:
        remote.shutdown()
    assert_same_generation(got, expected)
    assert route == [first.peer_id, middle.peer_id, last.peer_id]
    pushed = [peer.forwarder.pushed for peer in (first, middle, last)]
    if forward_steps is True or options.get("forward_min_rtt_s") == 0.0:  # every step went 0:2 -> 2:3 -> 3:4
        assert pushed == [20, 20, 0]
    else:
        assert pushed == [0, 0, 0]
    assert "inference" not in spare.answered and failovers == 0


def test_a_push_the_next_peer_refuses_is_reported_and_the_session_sends_its_steps_itself(fake_swarm, tiny_llama_local):
    """The middle peer refuses pushed steps from its 11th on (it holds too many, say): the first peer reports the
    failed push on its own stream. On that report alone nobody is banned (a lying first peer would get an honest
    middle one banned so): the client sends that step, and every later one, to each span itself."""
    first, middle, spare, last = _chain(fake_swarm, [Fault("error", method="push", after=10, code="overloaded")])
    ids = _ids(5, seed=2)
    expected = generate_with_logits(tiny_llama_local, ids, max_new_tokens=30, do_sample=False)
    remote = fake_swarm.client(forward_steps=True)
    try:
        with remote.inference_session(max_length=40) as session:
            got = generate_with_logits(remote, ids, max_new_tokens=30, do_sample=False)
            assert [s.hop.peer_id for s in session.remote.spans] == [first.peer_id, middle.peer_id, last.peer_id]
            assert session.recoveries == 0 and session.remote.unpushed == {session.remote.spans[1].session_id}
        assert_same_generation(got, expected)
        assert middle.answered["push"] == 11, "refused only once"
        assert remote.sequence.bans.banned() == set() and remote.sequence.failovers == 0
        assert first.forwarder.pushed == 10 and spare.answered.get("inference", 0) == 0, "pushing stopped, no repair"
        assert middle.forwarder.pushed == 30, "the middle peer still pushes on to the last"
    finally:
        remote.shutdown()


def test_a_peer_a_push_was_refused_by_crashes_later_and_pushes_go_on_into_its_replacement(fake_swarm, tiny_llama_local):
    """The middle peer refuses one push, then crashes: the client sent it its steps itself in between, and the spare
    that replaces it is pushed into again (a crash seen first as a failed push, the usual order with real processes,
    does not turn pushing off for the rest of the session)."""
    faults = [Fault("error", method="push", after=10, times=1, code="overloaded"), Fault("crash", after=15)]
    first, middle, spare, last = _chain(fake_swarm, faults)
    ids = _ids(5, seed=2)
    expected = generate_with_logits(tiny_llama_local, ids, max_new_tokens=30, do_sample=False)
    remote = fake_swarm.client(forward_steps=True)
    try:
        with remote.inference_session(max_length=40) as session:
            got = generate_with_logits(remote, ids, max_new_tokens=30, do_sample=False)
            assert middle.server.down and session.recoveries >= 1
            assert [s.hop.peer_id for s in session.remote.spans] == [first.peer_id, spare.peer_id, last.peer_id]
        assert_same_generation(got, expected)
        assert first.forwarder.pushed > 10 and spare.forwarder.pushed > 0, (
            first.forwarder.pushed,
            spare.forwarder.pushed,
        )
    finally:
        remote.shutdown()


def test_the_middle_peer_of_a_forwarding_route_crashes_and_the_outputs_do_not_change(fake_swarm, tiny_llama_local):
    first, middle, spare, last = _chain(fake_swarm, [Fault("crash", after=12)])
    ids = _ids(5, seed=2)
    expected = generate_with_logits(tiny_llama_local, ids, max_new_tokens=30, do_sample=False)
    remote = fake_swarm.client(forward_steps=True)
    try:
        with remote.inference_session(max_length=40) as session:
            got = generate_with_logits(remote, ids, max_new_tokens=30, do_sample=False)
            assert middle.server.down and session.recoveries >= 1
            assert [s.hop.peer_id for s in session.remote.spans] == [first.peer_id, spare.peer_id, last.peer_id]
        assert_same_generation(got, expected)
    finally:
        remote.shutdown()
