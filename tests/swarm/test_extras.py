"""Optional extras: a command that needs one says so at once with the install command; bench writes without plots."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.stats import Row, Summary
from swarm.extras import EXTRAS, missing_modules, require_extra

REPO = Path(__file__).resolve().parents[2]


def test_missing_modules_finds_what_is_not_installed():
    assert missing_modules(["json", "swarmlm_no_such_module", "no_such_parent.child"]) == [
        "swarmlm_no_such_module",
        "no_such_parent.child",
    ]
    assert missing_modules(["json", "swarm.extras"]) == []


def test_require_extra_names_the_modules_and_the_install_command():
    with pytest.raises(
        SystemExit,
        match=r"swarmlm api needs swarmlm_nope \(the 'api' extra\); install it with: "
        r"pip install 'swarmlm\[api\]'",
    ):
        require_extra("api", "swarmlm api", ["json", "swarmlm_nope"])
    require_extra("api", "swarmlm api", ["json"])  # all there: nothing said


def test_a_module_blocked_in_sys_modules_counts_as_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what `import matplotlib` fails on, as if not installed
    assert missing_modules(EXTRAS["bench"]) == ["matplotlib"]


@pytest.mark.parametrize(
    "command, args",
    [
        ("api", ["SmolLM2-135M-Instruct", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmNotAPeer", "--port", "0"]),
        ("monitor", ["--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmNotAPeer", "--port", "0"]),
    ],
)
def test_api_and_monitor_without_the_api_extra_fail_at_once(command, args):
    # the interpreter is told uvicorn is not there, the way `import uvicorn` fails when it is not installed
    code = (
        f"import sys; sys.modules['uvicorn'] = None; from swarm.cli import main; sys.exit(main({[command, *args]!r}))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert f"swarmlm {command} needs uvicorn" in done.stderr and "pip install 'swarmlm[api]'" in done.stderr, (
        done.stderr
    )
    assert "Traceback" not in done.stderr, done.stderr


def test_bench_results_without_matplotlib_keep_tables_and_json(tmp_path, monkeypatch):
    from bench import report
    from bench.cli import warn_missing_plots

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    rows = [Row("decode", "tiny", "3 peers", "decode step", "ms", Summary.of([12.0, 13.0]), Summary.of([10.0]))]
    header = {"mode": "quick", "started": "now", "summary": {"elapsed": "1 s"}}
    paths = report.write(tmp_path, rows, header)
    assert set(paths) == {"json", "markdown"}
    assert json.loads(paths["json"].read_text())["rows"][0]["scenario"] == "decode"
    assert "| tiny | 3 peers | decode step (ms) |" in paths["markdown"].read_text()
    assert not list(tmp_path.glob("*.png"))
    assert warn_missing_plots() is True
