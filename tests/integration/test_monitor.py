"""`swarmlm monitor` and `swarmlm status --json` on a real private swarm serving two models, and the page in a browser.

One swarm for the module: a bootstrap node with a swarm key, two peers of a tiny Llama (blocks 0:2 and 2:4) and one
of a tiny Qwen3 (0:4) that trains (a run of its own), all under that key. Into its DHT the test also writes what a
dishonest member could: a model index entry whose repository is markup and script, and a block record that is not
a server's record. The
monitor (--refresh-s 1) must show both models, treat the markup as text, skip the bad record, and show a gap
within a few refreshes of a peer being killed.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import time
import urllib.request
from types import SimpleNamespace
from unittest.mock import ANY

import pytest

from protocol.records import MODEL_INDEX_KEY, ModelIndexEntry, block_key, prefix_for_model
from swarm.dht.node import dht_result
from swarm.trust.swarmkey import SwarmKey
from tests.helpers.browser import headless_chromium
from tests.helpers.processes import Swarm

pytestmark = pytest.mark.timeout(240)

REFRESH_S = 1.0
PING_TIMEOUT_S = 4.0  # generous: on a loaded machine a live peer must not look dead
# a peer killed: the next refresh pings it on its endpoint, then through libp2p (each up to PING_TIMEOUT_S), and
# the page polls once more; the rest is slack for a loaded machine
GAP_BOUND_S = 3 * REFRESH_S + 2 * PING_TIMEOUT_S + 20.0
LLAMA_SPANS = [(0, 2), (2, 4)]
RUN_ID = "monitor-run"
EVIL_PREFIX = "evil-model"
EVIL = '<script>window.__pwned = 1</script><img src="x" onerror="window.__pwned = 2"><b>bold</b>'


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


@pytest.fixture(scope="module")
def monitored(tmp_path_factory, tiny_llama_path, tiny_qwen3_path):
    workdir = tmp_path_factory.mktemp("monitor")
    key_file = workdir / "swarm.key"
    llama, qwen = prefix_for_model(str(tiny_llama_path)), prefix_for_model(str(tiny_qwen3_path))
    with Swarm(workdir) as swarm:
        swarm.start_bootstrap("--new-swarm-key", str(key_file))
        swarm.swarm_key = SwarmKey.load(key_file)
        key = ("--swarm-key", str(key_file))
        peers = {  # the first holds its weights as int8, which the page says
            span: swarm.start_peer(
                tiny_llama_path, "--blocks", f"{span[0]}:{span[1]}", *key, *(("--quantize", "int8") if not i else ())
            )
            for i, span in enumerate(LLAMA_SPANS)
        }
        swarm.start_peer(tiny_qwen3_path, "--blocks", "0:4", "--train", "--run-id", RUN_ID, *key)
        llama_ids = {
            (info.start_block, info.end_block): peer_id
            for peer_id, info in swarm.wait_online(llama, LLAMA_SPANS, timeout_s=120).online().items()
        }
        swarm.wait_online(qwen, [(0, 4)], timeout_s=120)

        dht = swarm.dht  # holds the key: it writes what a lying member would
        expires = time.time() + 120
        stored = dht_result(
            dht,
            dht.store(
                MODEL_INDEX_KEY,
                ModelIndexEntry(prefix=EVIL_PREFIX, num_blocks=2, repository=EVIL).to_wire(),
                expires,
                subkey=dht.identity.record_subkey(),
                return_future=True,
            ),
            "storing",
        )
        assert stored, "the DHT refused the model index entry"
        dht_result(
            dht,
            dht.store(
                block_key(llama, 0),
                {"state": "<b>ONLINE</b>", "start_block": -1},
                expires,
                subkey="no-owner-here",
                return_future=True,
            ),
            "storing",
        )

        monitor = swarm.spawn(
            "monitor",
            "monitor",
            "--initial-peers",
            *swarm.initial_peers,
            "--port",
            "0",
            "--refresh-s",
            str(REFRESH_S),
            "--ping-timeout-s",
            str(PING_TIMEOUT_S),
            *key,
        )
        url = swarm.wait_for(
            lambda: (m := re.search(r"monitor: (http://\S+)", monitor.stdout())) and m.group(1),
            60,
            "the monitor to print its address",
            watch=[monitor],
        )
        yield SimpleNamespace(
            swarm=swarm,
            key_file=key_file,
            url=url,
            monitor=monitor,
            llama=llama,
            qwen=qwen,
            llama_peers={llama_ids[span]: peers[span] for span in LLAMA_SPANS},
            llama_ids=llama_ids,
        )


def wait_for_state(monitored, ready, what: str, timeout_s: float = 30.0):
    """The first /api/state document that `ready` accepts (bounded)."""

    def probe():
        state = get_json(monitored.url + "api/state")
        return state if ready(state) else None

    return monitored.swarm.wait_for(probe, timeout_s, what, poll_s=0.5)


def models_of(state) -> dict:
    return {model["prefix"]: model for model in state["models"]}


def everyone_answered(state) -> bool:
    models = models_of(state)
    return (
        {EVIL_PREFIX} < set(models)
        and all(peer["ping"] == "answered" for model in models.values() for peer in model["peers"])
        and len([peer for model in models.values() for peer in model["peers"]]) == 3
    )


def test_api_state_shows_every_model_of_a_private_swarm(monitored):
    state = wait_for_state(monitored, everyone_answered, "every peer to answer the monitor", timeout_s=60)
    assert state["schema_version"] == 2 and state["rtt_measured"] is True and state["error"] is None
    models = models_of(state)
    assert set(models) == {monitored.llama, monitored.qwen, EVIL_PREFIX}
    llama, qwen, evil = models[monitored.llama], models[monitored.qwen], models[EVIL_PREFIX]
    assert llama["coverage"] == llama["answering"] == [1, 1, 1, 1] and llama["complete"], llama
    assert [(p["start_block"], p["end_block"]) for p in llama["peers"]] == LLAMA_SPANS  # the bad record is skipped
    assert {p["peer_id"] for p in llama["peers"]} == set(monitored.llama_peers)
    assert [p["quantization"] for p in llama["peers"]] == ["int8", "none"]  # as the peers hold their weights
    assert qwen["coverage"] == [1] * 4 and qwen["complete"] and qwen["peers"][0]["dtype"] == "float32"
    assert qwen["training"] == [
        {"run_id": RUN_ID, "peers": 1, "epoch_min": 0, "epoch_max": 0, "recipe": ANY, "other_recipes": 0}
    ]
    assert qwen["training"][0]["recipe"]["batch_size"] > 0  # the recipe the peer published
    assert qwen["peers"][0]["run_id"] == RUN_ID and llama["training"] == []
    for peer in llama["peers"] + qwen["peers"]:
        assert peer["state"] == "ONLINE" and peer["throughput"] == 1000.0 and peer["endpoint"].startswith("127.0.0.1:")
        assert 0 < peer["rtt_s"] < PING_TIMEOUT_S, peer
    assert evil["repository"] == EVIL and evil["gaps"] == [[0, 2]] and evil["peers"] == []
    with urllib.request.urlopen(monitored.url, timeout=10) as page:
        assert page.headers["Content-Type"].startswith("text/html")
        assert "script-src 'self'" in page.headers["Content-Security-Policy"]
        assert 'data-refresh-s="1"' in page.read().decode()


def test_status_json_prints_the_same_document(monitored):
    swarm = monitored.swarm
    result = swarm.run(
        "status",
        "--json",
        "--initial-peers",
        *swarm.initial_peers,
        "--swarm-key",
        str(monitored.key_file),
        timeout_s=90,
    )
    assert result.returncode == 0, result
    status = json.loads(result.stdout)
    served = get_json(monitored.url + "api/state")
    assert status["schema_version"] == served["schema_version"] == 2
    assert status["rtt_measured"] is False and served["rtt_measured"] is True
    assert set(status) == set(served)

    def without_pings(model):
        peers = [{k: v for k, v in p.items() if k not in ("ping", "rtt_s", "expires_at")} for p in model["peers"]]
        return {**{k: v for k, v in model.items() if k not in ("answering", "peers")}, "peers": peers}

    assert [without_pings(m) for m in status["models"]] == [without_pings(m) for m in served["models"]]
    for model in status["models"]:
        assert model["answering"] is None
        assert all(peer["ping"] is None and peer["rtt_s"] is None for peer in model["peers"])


PAGE_VIEW = """
const models = {};
for (const section of document.querySelectorAll('section.model')) {
  models[section.dataset.prefix] = {
    title: section.querySelector('h2').textContent,
    summary: section.querySelector('.summary').textContent,
    cells: [...section.querySelectorAll('.coverage .cell')].map(c => c.className.replace('cell ', '')),
    training: [...section.querySelectorAll('tr[data-run-id]')].map(row => [...row.cells].map(c => c.textContent)),
    peers: Object.fromEntries([...section.querySelectorAll('tr[data-peer-id]')].map(
      row => [row.dataset.peerId, [...row.cells].map(cell => cell.textContent)])),
  };
}
return {refreshes: Number(document.body.dataset.refreshes || 0), models: models,
        status: document.getElementById('status').textContent,
        injected: document.querySelectorAll('main script, main img, main b').length,
        pwned: window.__pwned === undefined ? null : window.__pwned,
        resources: performance.getEntriesByType('resource').map(r => r.name)};
"""


def wait_for_page(driver, ready, what: str, timeout_s: float):
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    seen = {}

    def probe(driver):
        seen["view"] = driver.execute_script(PAGE_VIEW)
        return seen["view"] if ready(seen["view"]) else False

    try:
        return WebDriverWait(driver, timeout_s, poll_frequency=0.3).until(probe)
    except TimeoutException:
        raise AssertionError(
            f"the page did not show {what} within {timeout_s} s; it showed {seen.get('view')}"
        ) from None


def test_the_page_shows_peers_and_coverage_and_then_the_gap_of_a_killed_peer(monitored, tmp_path):
    llama = monitored.llama
    with headless_chromium(tmp_path / "chromium") as driver:
        driver.get(monitored.url)
        view = wait_for_page(
            driver,
            lambda v: (
                {llama, monitored.qwen, EVIL_PREFIX} <= set(v["models"])
                and len(v["models"][llama]["peers"]) == 2
                and len(v["models"][monitored.qwen]["peers"]) == 1
                and all("ms" in row[8] for row in v["models"][llama]["peers"].values())
            ),
            "both models with their peers and RTTs",
            timeout_s=60,
        )
        page = view["models"][llama]
        assert page["cells"] == ["one"] * 4 and page["summary"] == "all blocks covered", page
        assert view["models"][monitored.qwen]["cells"] == ["one"] * 4
        assert view["models"][monitored.qwen]["training"] == [[RUN_ID, "1", "0"]] and page["training"] == []
        (qwen_row,) = view["models"][monitored.qwen]["peers"].values()
        assert qwen_row[9] == f"{RUN_ID}: epoch 0, 0 samples", qwen_row
        quantized = monitored.llama_ids[LLAMA_SPANS[0]]
        for peer_id, row in page["peers"].items():
            assert row[1] == "ONLINE" and row[3] == "1000.0 tok/s", row
            assert row[5] == ("float32, int8" if peer_id == quantized else "float32"), row
            assert row[7].startswith("direct 127.0.0.1:"), row
        # a peer's announced text stays text: no element made of it, nothing of it run
        assert EVIL in view["models"][EVIL_PREFIX]["title"], view["models"][EVIL_PREFIX]
        assert view["models"][EVIL_PREFIX]["cells"] == ["gap", "gap"]
        assert view["injected"] == 0 and view["pwned"] is None, view
        assert all(name.startswith(monitored.url) for name in view["resources"]), view["resources"]
        driver.save_screenshot(str(tmp_path / "monitor.png"))

        dead = monitored.llama_ids[(2, 4)]
        monitored.swarm.kill(monitored.llama_peers[dead], signal.SIGKILL)  # a crash: its record stays ONLINE a while
        view = wait_for_page(
            driver,
            lambda v: (
                v["models"][llama]["cells"][2:] == ["gap", "gap"]
                and v["models"][llama]["peers"][dead][8] == "no answer"
            ),
            "blocks 2:4 as a gap",
            timeout_s=GAP_BOUND_S,
        )
        page = view["models"][llama]
        assert "2:4" in page["summary"] and page["summary"].startswith("gaps: blocks"), page
        assert len(page["peers"]) == 2, page  # its record is still there: the gap comes from the ping
        driver.save_screenshot(str(tmp_path / "monitor-gap.png"))
    assert (tmp_path / "monitor.png").stat().st_size > 10_000


def test_the_monitor_stops_cleanly_on_sigterm(monitored):
    assert monitored.monitor.alive(), monitored.monitor.logs()
    assert monitored.swarm.terminate(monitored.monitor, timeout_s=20) == 0, monitored.monitor.logs()
    assert "Traceback" not in monitored.monitor.stderr(), monitored.monitor.logs()


def test_wrong_arguments_and_an_unreachable_swarm_are_said_at_once(swarm):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    nobody = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDgePueAeYpCbyYXjMJ1HswJdSxNxyNVKaCENWUMyv9yG"
    try:
        runs = [
            (
                swarm.spawn("unreachable", "monitor", "--initial-peers", nobody, "--port", "0"),
                "could not join the swarm through --initial-peers",
            ),
            (
                swarm.spawn("port-taken", "monitor", "--initial-peers", nobody, "--port", str(taken.getsockname()[1])),
                "cannot listen on 127.0.0.1:",
            ),
            (
                swarm.spawn("bad-refresh", "monitor", "--initial-peers", nobody, "--refresh-s", "0"),
                "refresh_s must be between",
            ),
            (
                swarm.spawn("no-peer-id", "monitor", "--initial-peers", "/ip4/127.0.0.1/tcp/9"),
                "is not a multiaddr of a peer",
            ),
            (
                swarm.spawn("status-unreachable", "status", "--json", "--initial-peers", nobody),
                "could not join the swarm through --initial-peers",
            ),
        ]
        for proc, message in runs:
            left = proc.wait_gone(90)
            proc.expected_alive = False
            assert not left, f"{proc.name} is still running:\n{proc.logs()}"
            assert proc.returncode not in (0, None), proc.logs()
            assert message in proc.stderr() and "Traceback" not in proc.stderr(), proc.logs()
    finally:
        taken.close()
    help_ = swarm.run("monitor", "--help", timeout_s=60)
    assert help_.returncode == 0, help_
    for flag in ("--initial-peers", "--host", "--port", "--refresh-s", "--ping-timeout-s", "--swarm-key"):
        assert flag in help_.stdout, help_.stdout
    top = swarm.run("--help", timeout_s=60)
    assert "  monitor" in top.stdout, top.stdout
