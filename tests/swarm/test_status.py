"""`swarmlm status` output: one line per peer, training state where a peer trains, and each run's recipe."""

from __future__ import annotations

from protocol.records import ServerInfo, ServerState
from swarm.dht.snapshot import SwarmSnapshot
from swarm.status import format_snapshot
from swarm.training.recipe import RunRecipe


def info(start: int, end: int, **changes) -> ServerInfo:
    fields = dict(
        state=ServerState.ONLINE,
        start_block=start,
        end_block=end,
        throughput=100.0,
        cache_tokens_left=64,
        dtype="float32",
        version="1",
        endpoint="127.0.0.1:5000",
    )
    return ServerInfo(**(fields | changes))


def test_status_shows_training_peers_and_gaps():
    snapshot = SwarmSnapshot(
        num_blocks=6, servers={"frozen": info(0, 2), "trainer": info(2, 4, run_id="shakespeare", epoch=12, samples=6)}
    )
    lines = format_snapshot("m", "repo", snapshot).splitlines()
    assert lines[0] == "model m (repo): 6 blocks"
    assert "training" not in lines[1] and "frozen" in lines[1]
    assert lines[2].endswith("training 'shakespeare': update 12, 6 samples")
    assert lines[3] == "  uncovered blocks: 4:6"


def test_status_shows_how_each_peer_holds_its_weights():
    snapshot = SwarmSnapshot(
        num_blocks=3,
        servers={"full": info(0, 1), "int8": info(1, 2, quantization="int8"), "nf4": info(2, 3, quantization="nf4")},
    )
    full, int8, nf4 = format_snapshot("m", "repo", snapshot).splitlines()[1:4]
    assert "tok/s  float32  cache left" in full  # full precision says nothing more
    assert "tok/s  float32 int8  cache left" in int8 and "tok/s  float32 nf4  cache left" in nf4


RELAY = "12D3KooWDgePueAeYpCbyYXjMJ1HswJdSxNxyNVKaCENWUMyv9yG"


def test_status_shows_how_each_peer_is_reached():
    snapshot = SwarmSnapshot(
        num_blocks=4,
        servers={
            "direct": info(0, 1),
            "relaying": info(1, 2, relay=True),
            "home": info(2, 3, transport="p2p", relays=(RELAY,)),
            "p2p": info(3, 4, transport="p2p"),
        },
    )
    lines = format_snapshot("m", "repo", snapshot).splitlines()
    assert "direct 127.0.0.1:5000" in lines[1] and "relays" not in lines[1]
    assert "direct 127.0.0.1:5000  relays for others" in lines[2]
    assert f"behind NAT, via relay {RELAY[:16]}..." in lines[3] and "127.0.0.1:5000" not in lines[3]
    assert "libp2p only" in lines[4]


def test_status_shows_the_recipe_of_each_run_and_any_other_published():
    snapshot = SwarmSnapshot(
        num_blocks=2,
        servers={
            "a": info(0, 2, run_id="poems"),
            "b": info(0, 2, run_id="plays"),
            "c": info(0, 2, run_id="new"),
            "gone": info(0, 2, run_id="old", state=ServerState.OFFLINE),
        },
    )
    counts = RunRecipe(lr=3e-4, lr_schedule="cosine", total_steps=1000, warmup_steps=50, max_grad_norm=1.0)
    recipes = {"poems": [counts], "plays": [counts, RunRecipe(lr=1.0)], "old": [counts]}
    lines = format_snapshot("m", "repo", snapshot, recipes).splitlines()
    assert lines[-3:] == [
        "  run 'new': no recipe published",
        "  run 'plays': adamw lr 0.0003 (cosine to 1000, warmup 50), weight decay 0, clip 1, batch 8, full, float32 "
        "master (1 other recipes published; the first published counts)",
        "  run 'poems': adamw lr 0.0003 (cosine to 1000, warmup 50), weight decay 0, clip 1, batch 8, full, float32 "
        "master",
    ]
    assert "run 'old'" not in "\n".join(lines)  # only runs with ONLINE peers
    assert "run '" not in format_snapshot("m", "repo", snapshot)  # recipes not read
