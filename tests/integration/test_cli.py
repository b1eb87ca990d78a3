"""The `swarmlm` command as users run it: real bootstrap and peer processes on 127.0.0.1."""

from __future__ import annotations

import signal

import pytest

from protocol.records import ServerState, prefix_for_model
from tests.helpers.processes import Swarm, describe

pytestmark = pytest.mark.timeout(180)


def peer_id_of(maddr: str) -> str:
    assert "/p2p/" in maddr, maddr
    return maddr.rsplit("/p2p/", 1)[1]


def test_bootstrap_prints_maddrs_and_keeps_its_identity(swarm, tmp_path):
    identity = tmp_path / "bootstrap.key"
    maddrs = swarm.start_bootstrap("--identity", str(identity))
    assert identity.is_file(), "the identity file was not created"
    assert all(m.startswith("/ip4/127.0.0.1/tcp/") for m in maddrs), maddrs  # loopback unless told otherwise
    first_id = {peer_id_of(m) for m in maddrs}
    assert len(first_id) == 1, maddrs
    stdout = swarm.bootstrap.stdout()
    assert f"--initial-peers {' '.join(maddrs)}" in stdout.splitlines(), stdout

    first = swarm.bootstrap
    assert swarm.terminate(first, timeout_s=20) == 0, first.logs()
    key = identity.read_bytes()

    again = swarm.start_bootstrap("--identity", str(identity))
    assert {peer_id_of(m) for m in again} == first_id, (maddrs, again)
    assert identity.read_bytes() == key, "restarting rewrote the identity file"
    assert swarm.terminate(swarm.bootstrap, timeout_s=20) == 0, swarm.bootstrap.logs()


def test_bootstrap_without_identity_gets_a_fresh_peer_id_each_time(swarm):
    first = {peer_id_of(m) for m in swarm.start_bootstrap()}
    swarm.terminate(swarm.bootstrap, timeout_s=20)
    second = {peer_id_of(m) for m in swarm.start_bootstrap()}
    assert first.isdisjoint(second), (first, second)


def test_placement_picks_uncovered_blocks_and_status_shows_coverage(swarm, tiny_llama_path):
    prefix = prefix_for_model(str(tiny_llama_path))
    swarm.start_bootstrap()
    swarm.start_peer(tiny_llama_path, "--blocks", "0:2")
    swarm.wait_online(prefix, [(0, 2)])
    swarm.start_peer(tiny_llama_path, "--num-blocks", "2")  # no --blocks: placement chooses
    snapshot = swarm.wait_online(prefix, [(0, 2), (2, 4)])

    assert snapshot.num_blocks == 4
    spans = sorted((info.start_block, info.end_block) for info in snapshot.online().values())
    assert spans == [(0, 2), (2, 4)], snapshot
    assert snapshot.uncovered_blocks() == []
    for info in snapshot.online().values():
        assert info.throughput == 1000.0 and info.dtype == "float32" and info.endpoint.startswith("127.0.0.1:")

    status = swarm.run("status", "--initial-peers", *swarm.initial_peers, timeout_s=60)
    assert status.returncode == 0, status.stderr
    out = status.stdout
    assert f"model {prefix} ({tiny_llama_path}): 4 blocks" in out, out
    assert "all blocks covered" in out, out
    for peer_id, info in snapshot.online().items():
        line = next((line for line in out.splitlines() if peer_id in line), None)
        assert line is not None, f"{peer_id} missing from status:\n{out}"
        assert f"{info.start_block}:{info.end_block}" in line.replace(" ", "") and "ONLINE" in line, line

    only = swarm.run("status", "--initial-peers", *swarm.initial_peers, "--model", "no-such-model", timeout_s=60)
    assert only.returncode != 0 and "no models announced" in only.stdout, only


# A clean stop must announce OFFLINE. The peers below re-announce rarely, so that their ONLINE record outlives the
# test: a record that merely expired (what a crash leads to) cannot pass for a clean departure.
QUIET = ("--update-period-s", "60")
# one peer per way of stopping it, all started at once in one swarm (each on blocks of its own, to tell them apart)
STOPPED_BY = {"sigterm": (1, 3), "sigint": (0, 1), "ctrl-c": (1, 2), "group-sigterm": (2, 3), "sigkill": (3, 4)}


@pytest.fixture(scope="module")
def stoppable(tmp_path_factory, tiny_llama_path):
    """(swarm, {way of stopping: (peer process, peer id)}), every peer ONLINE."""
    prefix = prefix_for_model(str(tiny_llama_path))
    with Swarm(tmp_path_factory.mktemp("stops")) as swarm:
        swarm.start_bootstrap()
        procs = {
            way: swarm.start_peer(tiny_llama_path, "--blocks", f"{a}:{b}", *QUIET) for way, (a, b) in STOPPED_BY.items()
        }
        snapshot = swarm.wait_online(prefix, list(STOPPED_BY.values()))
        ids = {(info.start_block, info.end_block): peer_id for peer_id, info in snapshot.online().items()}
        yield swarm, {way: (procs[way], ids[span]) for way, span in STOPPED_BY.items()}


def require_offline(swarm, model_path, peer_id: str, timeout_s: float = 10.0) -> None:
    """Poll the DHT until the peer's record says OFFLINE; a record that is still ONLINE or gone fails the test."""
    prefix = prefix_for_model(str(model_path))

    def announced_offline():
        info = swarm.snapshot(prefix, 4).servers.get(peer_id)
        return info is not None and info.state == ServerState.OFFLINE

    swarm.wait_for(announced_offline, timeout_s, f"{peer_id} to be announced OFFLINE", watch=[])


def test_sigterm_stops_a_peer_cleanly_and_it_leaves_the_dht(stoppable, tiny_llama_path):
    swarm, peers = stoppable
    peer, peer_id = peers["sigterm"]
    members = peer.members()
    assert any("p2pd" in " ".join(p.cmdline()) for p in members), "expected the peer's p2pd in its session"

    # SIGTERM to the main process only, as `kill PID` does: it must take its DHT process and p2pd down itself
    assert swarm.terminate(peer, timeout_s=30) == 0, peer.logs()
    require_offline(swarm, tiny_llama_path, peer_id)


def test_sigint_stops_a_peer_cleanly(stoppable, tiny_llama_path):
    swarm, peers = stoppable
    peer, peer_id = peers["sigint"]
    assert swarm.terminate(peer, timeout_s=30, sig=signal.SIGINT) == 0, peer.logs()
    require_offline(swarm, tiny_llama_path, peer_id)


def test_ctrl_c_in_a_terminal_stops_a_peer(stoppable, tiny_llama_path):
    # Ctrl+C signals the whole foreground process group: the peer, and whatever of its children is in that group
    swarm, peers = stoppable
    peer, peer_id = peers["ctrl-c"]
    swarm.signal_process_group(peer, signal.SIGINT)
    left = peer.wait_gone(20)
    assert not left and peer.returncode == 0, (peer.returncode, left, peer.logs())
    require_offline(swarm, tiny_llama_path, peer_id)


def test_sigterm_to_the_process_group_stops_a_peer(stoppable, tiny_llama_path):
    # `kill -TERM -PGID`: as with Ctrl+C, the peer must still be able to announce OFFLINE through its DHT
    swarm, peers = stoppable
    peer, peer_id = peers["group-sigterm"]
    swarm.signal_process_group(peer, signal.SIGTERM)
    left = peer.wait_gone(15)
    assert not left and peer.returncode == 0, (peer.returncode, left, peer.logs())
    require_offline(swarm, tiny_llama_path, peer_id)


def test_sigkill_of_a_peer_leaves_nothing_behind(stoppable):
    # what fault tests do to simulate a dying machine: the peer, its DHT process and p2pd all vanish at once
    swarm, peers = stoppable
    peer, _ = peers["sigkill"]
    members = peer.members()
    assert len(members) >= 3, members  # the peer, its hivemind DHT process, p2pd
    swarm.kill(peer)
    assert not peer.wait_gone(10), peer.logs()
    assert peer.returncode == -signal.SIGKILL


def test_a_process_killed_alone_takes_its_dht_process_and_p2pd_along(swarm):
    # SIGKILL to the main process only (the OOM killer, a crash): its DHT process and p2pd, which live in a process
    # group of their own so that a signal to the main group leaves them to announce OFFLINE, must stop by themselves
    swarm.start_bootstrap()
    main = swarm.bootstrap
    assert any("p2pd" in " ".join(p.cmdline()) for p in main.members()), "expected the bootstrap's p2pd in its session"
    swarm.kill(main, signal.SIGKILL, group=False)
    left = main.wait_gone(10)
    assert not left, f"still running 10 s after the main process was killed:\n{describe(left)}"


MODEL = "{model}"  # stands for the test model's folder
BAD_ARGUMENTS = [
    # (command line, what the error must say); the training settings' own checks are unit-tested
    # (tests/client/training/test_train_config.py): here, that the commands turn them into clear exits
    (["peer", MODEL, "--blocks", "5"], "expected START:END"),
    (["peer", MODEL, "--blocks", "3:1"], "0 <= start < end"),
    # detected only after the peer joined the DHT: its DHT process and p2pd must still go away
    (["peer", MODEL, "--blocks", "2:9"], "--blocks 2:9 is outside the model's 0:4"),
    (["peer", "/no/such/model-folder"], "model folder '/no/such/model-folder' does not exist"),
    (["peer", MODEL, "--dtype", "float8"], "invalid choice: 'float8'"),
    (["peer", MODEL, "--transport", "carrier-pigeon"], "invalid choice: 'carrier-pigeon'"),
    (["peer", MODEL, "--port", "70000"], "0..65535"),
    (["peer", MODEL, "--announce-host", "a b"], "announce_host must be HOST or HOST:PORT"),
    (["peer", MODEL, "--train"], "a training peer needs fixed blocks: pass --blocks"),
    (
        ["peer", MODEL, "--blocks", "0:2", "--train", "--matchmaking-time-s", "70"],
        "averaging_timeout_s (60.0) must exceed",
    ),
    (["peer", MODEL, "--memory-budget", "3XB"], "'3XB' is not a size"),
    (["peer", MODEL, "--blocks", "0:4", "--offload", "disk"], "give --memory-budget too"),
    (["peer", MODEL, "--offload", "disk", "--memory-budget", "1MB"], "give --blocks START:END or --num-blocks N"),
    (["peer", MODEL, "--blocks", "0:4", "--offload", "host", "--memory-budget", "1MB"], "use --offload disk"),
    (
        ["peer", MODEL, "--blocks", "0:2", "--train", "--offload", "disk", "--memory-budget", "1MB"],
        "drop --offload disk or --train",
    ),
    # detected once the blocks are known: the budget holds not even the two blocks that stream
    (
        ["peer", MODEL, "--blocks", "0:4", "--offload", "disk", "--memory-budget", "10KB"],
        "give --memory-budget at least",
    ),
    (["train", MODEL], "pass --initial-peers"),
    (["train", MODEL, "--local", "--batch-size", "6", "--micro-batch-size", "4"], "multiple of micro_batch_size"),
    (["train", MODEL, "--local", "--data", "/no/such/text"], "/no/such/text"),
]


def test_commands_reject_bad_arguments(swarm, tiny_llama_path):
    # every case is its own process, started all at once: each must exit with a clear error, no traceback, and
    # leave nothing running
    runs = [
        (swarm.spawn(command[0], *(arg.replace(MODEL, str(tiny_llama_path)) for arg in command)), message)
        for command, message in BAD_ARGUMENTS
    ]
    for proc, message in runs:
        left = proc.wait_gone(120)
        assert not left, f"{proc.name} is still running or left processes:\n{proc.logs()}"
        proc.expected_alive = False
        assert proc.returncode != 0, proc.logs()
        assert message in proc.stderr(), proc.logs()
        assert "Traceback" not in proc.stderr(), proc.logs()


def test_help(swarm):
    top, peer, unknown = (
        swarm.spawn(name, *args)
        for name, args in [("help", ["--help"]), ("peer-help", ["peer", "--help"]), ("unknown", ["frobnicate"])]
    )
    for proc in (top, peer, unknown):
        assert not proc.wait_gone(60), proc.logs()
    assert top.returncode == 0, top.stderr()
    for command in ("bootstrap", "peer", "status", "demo", "train", "export"):
        assert f"  {command}" in top.stdout(), top.stdout()
    assert peer.returncode == 0, peer.stderr()
    for flag in (
        "--initial-peers",
        "--blocks",
        "--num-blocks",
        "--dtype",
        "--update-period-s",
        "--cache-dir",
        "--train",
    ):
        assert flag in peer.stdout(), peer.stdout()
    assert unknown.returncode == 2 and "unknown command 'frobnicate'" in unknown.stderr(), unknown.logs()
