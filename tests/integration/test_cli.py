"""The `swarmlm` command as users run it: real bootstrap and peer processes on 127.0.0.1."""

from __future__ import annotations

import signal

import pytest

from protocol.records import ServerState, prefix_for_model
from tests.helpers.processes import describe

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
QUIET = ("--update-period", "60")


def start_online_peer(swarm, model_path, blocks: str) -> tuple:
    """Start the bootstrap and one peer serving `blocks`; wait until it is ONLINE; the process and its peer id."""
    prefix = prefix_for_model(str(model_path))
    start, end = (int(part) for part in blocks.split(":"))
    swarm.start_bootstrap()
    peer = swarm.start_peer(model_path, "--blocks", blocks, *QUIET)
    snapshot = swarm.wait_online(prefix, [(start, end)])
    (peer_id,) = snapshot.online()
    return peer, peer_id


def require_offline(swarm, model_path, peer_id: str, timeout_s: float = 10.0) -> None:
    """Poll the DHT until the peer's record says OFFLINE; a record that is still ONLINE or gone fails the test."""
    prefix = prefix_for_model(str(model_path))

    def announced_offline():
        info = swarm.snapshot(prefix, 4).servers.get(peer_id)
        return info is not None and info.state == ServerState.OFFLINE

    swarm.wait_for(announced_offline, timeout_s, f"{peer_id} to be announced OFFLINE", watch=[])


def test_sigterm_stops_a_peer_cleanly_and_it_leaves_the_dht(swarm, tiny_llama_path):
    peer, peer_id = start_online_peer(swarm, tiny_llama_path, "1:3")
    members = peer.members()
    assert any("p2pd" in " ".join(p.cmdline()) for p in members), "expected the peer's p2pd in its session"

    # SIGTERM to the main process only, as `kill PID` does: it must take its DHT process and p2pd down itself
    assert swarm.terminate(peer, timeout_s=30) == 0, peer.logs()
    require_offline(swarm, tiny_llama_path, peer_id)


def test_sigint_stops_a_peer_cleanly(swarm, tiny_llama_path):
    peer, peer_id = start_online_peer(swarm, tiny_llama_path, "0:1")
    assert swarm.terminate(peer, timeout_s=30, sig=signal.SIGINT) == 0, peer.logs()
    require_offline(swarm, tiny_llama_path, peer_id)


def test_ctrl_c_in_a_terminal_stops_a_peer(swarm, tiny_llama_path):
    # Ctrl+C signals the whole foreground process group: the peer, and whatever of its children is in that group
    peer, peer_id = start_online_peer(swarm, tiny_llama_path, "0:1")
    swarm.signal_process_group(peer, signal.SIGINT)
    left = peer.wait_gone(20)
    assert not left and peer.returncode == 0, (peer.returncode, left, peer.logs())
    require_offline(swarm, tiny_llama_path, peer_id)


def test_sigterm_to_the_process_group_stops_a_peer(swarm, tiny_llama_path):
    # `kill -TERM -PGID`: as with Ctrl+C, the peer must still be able to announce OFFLINE through its DHT
    peer, peer_id = start_online_peer(swarm, tiny_llama_path, "0:1")
    swarm.signal_process_group(peer, signal.SIGTERM)
    left = peer.wait_gone(15)
    assert not left and peer.returncode == 0, (peer.returncode, left, peer.logs())
    require_offline(swarm, tiny_llama_path, peer_id)


def test_sigkill_of_a_peer_leaves_nothing_behind(swarm, tiny_llama_path):
    # what fault tests do to simulate a dying machine: the peer, its DHT process and p2pd all vanish at once
    swarm.start_bootstrap()
    peer = swarm.start_peer(tiny_llama_path, "--blocks", "0:1")
    swarm.wait_online(prefix_for_model(str(tiny_llama_path)), [(0, 1)])
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


BAD_ARGUMENTS = [
    # (command and arguments after the model, what the error must say); the training settings' own checks are
    # unit-tested (tests/client/test_train_config.py): here, that the commands turn them into clear exits
    (["peer", "--blocks", "5"], "expected START:END"),
    (["peer", "--blocks", "3:1"], "0 <= start < end"),
    (["peer", "--dtype", "float8"], "invalid choice: 'float8'"),
    (["peer", "--port", "70000"], "0..65535"),
    (["peer", "--announce-host", "a b"], "announce_host must be HOST or HOST:PORT"),
    (["peer", "--train"], "a training peer needs fixed blocks: pass --blocks"),
    (["peer", "--blocks", "0:2", "--train", "--matchmaking-time", "70"], "averaging_timeout_s (60.0) must exceed"),
    (["train"], "pass --initial-peers"),
    (["train", "--local", "--batch-size", "6", "--micro-batch-size", "4"], "multiple of micro_batch_size"),
    (["train", "--local", "--data", "/no/such/text"], "/no/such/text"),
]


def test_commands_reject_bad_arguments(swarm, tiny_llama_path):
    # every case is its own process, started all at once: each must exit with a clear error, no traceback
    runs = [(swarm.spawn(command, command, str(tiny_llama_path), *args), message)
            for (command, *args), message in BAD_ARGUMENTS]
    for proc, message in runs:
        left = proc.wait_gone(120)
        assert not left, f"{proc.name} is still running or left processes:\n{proc.logs()}"
        proc.expected_alive = False
        assert proc.returncode != 0, proc.logs()
        assert message in proc.stderr(), proc.logs()
        assert "Traceback" not in proc.stderr(), proc.logs()


def test_peer_rejects_a_missing_model_folder(swarm, tmp_path):
    missing = tmp_path / "no-such-model"
    result = swarm.run("peer", str(missing), timeout_s=60)
    assert result.returncode != 0
    assert str(missing) in result.stderr and "does not exist" in result.stderr, result.stderr


def test_peer_rejects_blocks_past_the_models_end(swarm, tiny_llama_path):
    # detected only after the peer joined the DHT: its DHT process and p2pd must still go away
    result = swarm.run("peer", str(tiny_llama_path), "--blocks", "2:9", timeout_s=90)
    assert result.returncode != 0
    assert "--blocks 2:9 is outside the model's 0:4" in result.stderr, result.stderr


@pytest.mark.parametrize("case", ["missing-model", "blocks-past-the-end"])
def test_peer_startup_errors_come_without_a_traceback(swarm, tiny_llama_path, tmp_path, case):
    args = [str(tmp_path / "no-such-model")] if case == "missing-model" else [str(tiny_llama_path), "--blocks", "2:9"]
    result = swarm.run("peer", *args, timeout_s=90)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr


def test_help(swarm):
    top = swarm.run("--help", timeout_s=30)
    assert top.returncode == 0, top.stderr
    for command in ("bootstrap", "peer", "status", "demo"):
        assert f"  {command}" in top.stdout, top.stdout

    peer = swarm.run("peer", "--help", timeout_s=60)
    assert peer.returncode == 0, peer.stderr
    for flag in ("--initial-peers", "--blocks", "--num-blocks", "--dtype", "--update-period", "--cache-dir"):
        assert flag in peer.stdout, peer.stdout

    unknown = swarm.run("frobnicate", timeout_s=30)
    assert unknown.returncode == 2 and "unknown command 'frobnicate'" in unknown.stderr, unknown
