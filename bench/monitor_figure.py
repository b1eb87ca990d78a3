"""`python -m bench.monitor_figure`: a screenshot of `swarmlm monitor` watching the demo's swarm, for docs/monitor.md.

The demo's swarm (the built-in model, peers on blocks 0:10, 10:20 and 20:30) plus a training peer on 0:15 (LoRA,
run "demo"), with `swarmlm monitor` in front of it; once every peer answers, the 20:30 peer is killed (SIGKILL, as
a crash) and the page is photographed when it shows the gap. Needs Chromium and chromedriver (see docs/testing.md);
every process it starts is stopped on the way out.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
import urllib.request
from pathlib import Path

from client.demo.local_swarm import LocalSwarm
from swarm.models.default_model import resolve_default_model
from swarm.paths import default_cache_dir

SPANS = [(0, 10), (10, 20), (20, 30)]


def _wait(what: str, probe, timeout_s: float, poll_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if result := probe():
            return result
        time.sleep(poll_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def _state(url: str):
    try:
        with urllib.request.urlopen(url + "api/state", timeout=5) as response:
            return json.load(response)
    except OSError:
        return None


def _browser(profile: Path, width: int, height: int):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--window-size={width},{height}",
        f"--user-data-dir={profile}",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--hide-scrollbars",
    ):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(executable_path="/usr/bin/chromedriver"), options=options)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/figures/monitor.png", help="where to save the screenshot")
    p.add_argument("--width", type=int, default=1400)
    args = p.parse_args()
    model = str(resolve_default_model(default_cache_dir()))
    workdir = Path(tempfile.mkdtemp(prefix="swarmlm-monitor-figure-"))
    with LocalSwarm(workdir / "logs") as swarm:
        swarm.start_bootstrap()
        for i, (start, end) in enumerate(SPANS):
            swarm.start_peer(f"peer{i}", model, "--blocks", f"{start}:{end}", "--update-period-s", "5")
        swarm.start_peer(
            "trainer-peer",
            model,
            "--blocks",
            "0:15",
            "--train",
            "--run-id",
            "demo",
            "--train-mode",
            "lora",
            "--update-period-s",
            "5",
        )
        swarm.wait_online(model, 30, [*SPANS, (0, 15)], timeout_s=300)
        swarm.start("monitor", "monitor", "--initial-peers", *swarm.initial_peers, "--port", "0", "--refresh-s", "1")
        log = swarm.log("monitor")
        url = _wait(
            "the monitor's address",
            lambda: (m := re.search(r"monitor: (http://\S+)", log.read_text())) and m.group(1),
            60,
        )
        _wait(
            "every peer to answer the monitor",
            lambda: (
                (s := _state(url))
                and s["models"]
                and all(peer["ping"] == "answered" for peer in s["models"][0]["peers"])
                and len(s["models"][0]["peers"]) == 4
            ),
            60,
        )
        swarm.kill("peer2")
        _wait("the gap of the killed peer", lambda: (s := _state(url)) and s["models"][0]["gaps"] == [[20, 30]], 60)
        driver = _browser(workdir / "chromium", args.width, 800)
        try:
            driver.get(url)
            _wait(
                "the page to draw the gap",
                lambda: driver.execute_script("return document.querySelectorAll('.coverage .cell.gap').length") == 10,
                30,
                0.3,
            )
            # the whole page and no more: the window's height is its frame plus the page's
            frame, page = driver.execute_script(
                "return [window.outerHeight - window.innerHeight, "
                "Math.ceil(document.querySelector('footer').getBoundingClientRect().bottom)]"
            )
            driver.set_window_size(args.width, frame + page)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            driver.save_screenshot(args.out)
        finally:
            driver.quit()
    print(f"saved {args.out} (logs in {workdir})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
