"""Fixtures shared by all tests: tiny random models (built once per session) and a real-process swarm."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

# One compute thread in the test processes, as in the processes they start (tests/helpers/processes.py): tiny
# models gain nothing from a second thread, and on a loaded 2-core machine OpenMP's idle threads spin against
# the peers (test_generation alone: 62 CPU-s with two threads, 55 with one). Set before anything imports torch.
os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `pytest` run without `python -m` does not put the repo root on sys.path
    sys.path.insert(0, str(REPO))

from tests.helpers.models import make_tiny_llama, make_tiny_qwen3  # noqa: E402
from tests.helpers.processes import Swarm  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory) -> Path:
    """A 4-layer random Llama (GQA, untied head) saved as safetensors; its folder name is its DHT prefix."""
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama", num_layers=4, seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3_path(tmp_path_factory) -> Path:
    """A 4-layer random Qwen3 (GQA, q/k norms, tied head) saved as safetensors."""
    return make_tiny_qwen3(tmp_path_factory.mktemp("models") / "tiny-qwen3", num_layers=4, seed=0)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config):
    """A CI timeout sends SIGTERM: turn it into KeyboardInterrupt, so that fixtures still stop their processes.

    The processes the tests start (well over a hundred) also cache our modules' bytecode where the environment
    forbids it (PYTHONDONTWRITEBYTECODE): each would compile all of them again, about half a second apiece.
    """
    signal.signal(signal.SIGTERM, _interrupt)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


# Test files of 20 s or more (worker seconds, `--durations=0` on 2 cores, 2026-12-03), slowest first. xdist hands
# whole files to workers in collection order (`--no-loadscope-reorder` in pyproject.toml): started first, the long
# ones overlap everything else instead of running alone at the end.
SLOW_FILES = (
    "integration/test_training.py",
    "bench/test_bench_quick.py",
    "integration/test_demo.py",
    "integration/test_generation.py",
    "integration/test_nat.py",
    "integration/test_training_exact.py",
    "integration/test_cli.py",
    "integration/test_bad_input.py",
    "integration/test_training_faults.py",
    "bench/test_soak.py",
    "integration/test_private_swarm.py",
    "integration/test_monitor.py",
    "swarm/training/test_rounds.py",
    "integration/test_demo_api.py",
    "integration/test_placement.py",
    "integration/test_churn.py",
    "bench/test_fuzz.py",
    "swarm/net/test_tunnel.py",
    "integration/test_directory.py",
    "integration/test_lying_peer.py",
    "integration/test_failover.py",
    "integration/test_quantized.py",
)


def pytest_collection_modifyitems(config, items):
    """Slow files first (SLOW_FILES), the rest in their usual order; tests keep their order within a file."""
    rank = {REPO / "tests" / name: index for index, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path, len(SLOW_FILES)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Attach the swarm's process logs to the report of a test that failed while using the `swarm` fixture."""
    outcome = yield
    report = outcome.get_result()
    swarm = getattr(item, "funcargs", {}).get("swarm")
    if report.failed and isinstance(swarm, Swarm):
        report.sections.append(("swarm process logs", swarm.format_logs()))


@pytest.fixture
def swarm(tmp_path) -> Swarm:
    """A Swarm under this test's tmp_path; every process it started is reaped afterwards, whatever happened."""
    with Swarm(tmp_path / "swarm") as running:
        yield running
