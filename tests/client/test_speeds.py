"""Announced throughput capped by what the client measured (client/speeds.py): on a hand-built snapshot, and on an
in-memory swarm where a peer announcing 1e7 tokens/s computes as fast as its honest neighbours."""

from __future__ import annotations

import pytest
import torch

from client.speeds import CAP, Speeds
from protocol.records import ServerInfo, ServerState
from swarm.dht.snapshot import SwarmSnapshot
from tests.helpers.models import VOCAB_SIZE


def _info(throughput: float, port: int) -> ServerInfo:
    return ServerInfo(
        state=ServerState.ONLINE,
        start_block=0,
        end_block=4,
        throughput=throughput,
        cache_tokens_left=64,
        dtype="float32",
        version="2",
        endpoint=f"127.0.0.1:{port}",
    )


def test_announced_figures_count_for_at_most_cap_times_what_was_measured():
    snapshot = SwarmSnapshot(
        num_blocks=4,
        servers={"liar": _info(1e7, 1), "honest": _info(1000.0, 2), "slow": _info(50.0, 3), "new": _info(1e7, 4)},
    )
    speeds = Speeds()
    assert speeds.capped(snapshot) is snapshot, "with nothing measured, the announced figures stand"
    speeds.record("liar", tokens=800, seconds=1.0)
    speeds.record("liar", tokens=100, seconds=1.0)  # a slower call later: the best one counts
    speeds.record("honest", tokens=900, seconds=1.0)
    capped = speeds.capped(snapshot).servers
    assert capped["liar"].throughput == CAP * 800
    assert capped["honest"].throughput == 1000.0 and capped["slow"].throughput == 50.0  # below their caps
    assert capped["new"].throughput == CAP * 900, "a peer not measured yet: at most CAP x the best measured"
    assert snapshot.servers["liar"].throughput == 1e7, "the directory itself is not changed"
    speeds.forget("liar")
    assert speeds.capped(snapshot).servers["liar"].throughput == CAP * 900


def test_a_peer_announcing_1e7_draws_no_more_than_its_measured_share(fake_swarm, tiny_llama_local):
    """Three honest peers announce about what they do (1e4 tokens/s here); the liar, as fast, announces 1e7. Capped at
    CAP x its measured speed, it draws about CAP / (CAP + 3) of the routes (34 of 60, sd 4); uncapped, it would draw
    all but one in a thousand."""
    honest = [fake_swarm.add_peer(0, 4, throughput=1e4) for _ in range(3)]
    liar = fake_swarm.add_peer(0, 4, throughput=1e7)
    remote = fake_swarm.client(verify_fraction=0.0)
    embeds = tiny_llama_local.get_input_embeddings()(torch.randint(3, VOCAB_SIZE, (2, 8))).detach()
    try:
        with torch.no_grad():
            for _ in range(60):
                remote(inputs_embeds=embeds)
        counts = {peer.peer_id: peer.answered.get("forward", 0) for peer in [*honest, liar]}
        assert sum(counts.values()) == 60
        measured = remote.sequence.speeds.best
        assert liar.peer_id in measured
        assert counts[liar.peer_id] <= 50, (counts, measured)
    finally:
        remote.shutdown()


def test_a_client_that_only_generates_caps_a_liar_by_what_its_sessions_measured(fake_swarm, tiny_llama_local):
    """No forward call at all: the liar announcing 1e7 serves the first session (alone then: which peer an
    inference route picks also depends on measured latency, which a busy machine blurs), whose steps are timed per
    span; from then on this client counts it for at most CAP x what it measured, and the peers it has not measured
    (two honest ones that joined since) for no more."""
    liar = fake_swarm.add_peer(0, 4, throughput=1e7)
    remote = fake_swarm.client(verify_fraction=0.0)
    ids = torch.randint(3, VOCAB_SIZE, (1, 8), generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad(), remote.inference_session(max_length=16) as session:
            remote.generate(ids, max_new_tokens=2, do_sample=False)
            (span,) = session.remote.spans
        assert span.hop.peer_id == liar.peer_id and "forward" not in liar.answered
        measured = remote.sequence.speeds.best[liar.peer_id]
        honest = [fake_swarm.add_peer(0, 4, throughput=1e3) for _ in range(2)]
        snapshot = remote._run(remote.sequence.snapshot(refresh=True))
        assert all(peer.peer_id in snapshot.servers for peer in honest)
        capped = remote.sequence.speeds.capped(snapshot).servers
        assert capped[liar.peer_id].throughput == pytest.approx(CAP * measured) and CAP * measured < 1e6
        assert all(capped[peer.peer_id].throughput == 1e3 for peer in honest)  # under the ceiling: as announced
    finally:
        remote.shutdown()
