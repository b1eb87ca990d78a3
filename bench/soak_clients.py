"""The clients of a soak run: threads generating back to back, each result compared with the local model's.

The references are computed before any peer starts (the local model then has the CPU to itself): greedy
generations, and seeded sampled ones (`torch.manual_seed(seed)` then `generate(do_sample=True)`). Sampling
draws from torch's global generator, which every thread of a process shares: so at most one client samples
(greedy decoding draws nothing from it). Each client is a model of its own (its own DHT node, event loop and
channel pool), built in the main thread, then used by one thread until the deadline.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from client.model import AutoDistributedModelForCausalLM

logger = logging.getLogger(__name__)

SAMPLING = dict(do_sample=True, temperature=1.0, top_k=20)
MAX_EXAMPLES = 5


@dataclass(frozen=True)
class Case:
    """A prompt, how to continue it (greedy when `seed` is None) and what the local model generated."""

    prompt: tuple[int, ...]
    seed: int | None
    expected: tuple[int, ...]


def generate(model, case: Case, max_new_tokens: int) -> tuple[int, ...]:
    ids = torch.tensor([case.prompt])
    options = dict(max_new_tokens=max_new_tokens, pad_token_id=model.config.pad_token_id or 0)
    if case.seed is None:
        out = model.generate(ids, do_sample=False, **options)
    else:
        torch.manual_seed(case.seed)
        out = model.generate(ids, **SAMPLING, **options)
    return tuple(out[0].tolist())


def make_cases(local, count: int, *, sampled: bool, max_new_tokens: int, seed: int) -> list[Case]:
    """`count` random prompts (3-8 tokens) and the local model's continuations."""
    rng = torch.Generator().manual_seed(seed)
    high = min(local.config.vocab_size, 1000)
    cases = []
    for i in range(count):
        length = int(torch.randint(3, 9, (), generator=rng))
        prompt = tuple(torch.randint(3, high, (length,), generator=rng).tolist())
        draft = Case(prompt, seed * 1000 + i if sampled else None, ())
        cases.append(Case(prompt, draft.seed, generate(local, draft, max_new_tokens)))
    return cases


@dataclass
class ClientTally:
    name: str
    sampling: bool
    completed: int = 0
    wrong: int = 0
    errors: list[tuple[float, float, str]] = field(default_factory=list)  # (began, ended, what), monotonic
    mismatches: list[str] = field(default_factory=list)  # the first few
    failovers: int = 0
    recoveries: int = 0
    channels_after_close: int | None = None  # channels the client's pool still had open after shutdown()
    hung: bool = False  # still generating when it should have finished


AT_LEAST_GRACE_S = 60.0
"""How long past the deadline a client may go on to complete its `at_least` generations (a loaded machine)."""


class Client(threading.Thread):
    """Generates `cases` in turn until `deadline` (monotonic, set before `start()`) or `stop`, then shuts down; past
    the deadline, until it completed `at_least` generations (at most AT_LEAST_GRACE_S more)."""

    def __init__(
        self,
        name: str,
        model_path: str,
        initial_peers: list[str],
        cases: list[Case],
        *,
        max_new_tokens: int,
        stop: threading.Event,
        options: dict,
    ):
        super().__init__(name=name, daemon=True)  # daemon: a hung client must not keep the run from ending
        self.cases, self.max_new_tokens, self.stop = cases, max_new_tokens, stop
        self.deadline = float("inf")
        self.at_least = 0  # generations to complete, past the deadline if need be (for at most AT_LEAST_GRACE_S)
        self.tally = ClientTally(name, sampling=cases[0].seed is not None)
        self.model = AutoDistributedModelForCausalLM.from_pretrained(
            model_path, initial_peers=initial_peers, dtype=torch.float32, **options
        )

    def run(self) -> None:
        tally, turn = self.tally, 0
        try:
            while not self.stop.is_set():
                now = time.monotonic()
                if now >= self.deadline and (
                    tally.completed >= self.at_least or now >= self.deadline + AT_LEAST_GRACE_S
                ):
                    break
                case = self.cases[turn % len(self.cases)]
                turn += 1
                began = time.monotonic()
                try:
                    got = generate(self.model, case, self.max_new_tokens)
                except Exception as exc:
                    tally.errors.append((began, time.monotonic(), f"{type(exc).__name__}: {exc}"[:500]))
                    logger.warning("%s: generation failed: %s", self.name, exc)
                    continue
                tally.completed += 1
                if got != case.expected:
                    tally.wrong += 1
                    if len(tally.mismatches) < MAX_EXAMPLES:
                        tally.mismatches.append(
                            f"prompt {list(case.prompt)} seed {case.seed}: got {list(got)}, "
                            f"expected {list(case.expected)}"
                        )
        finally:
            self.close()

    def close(self) -> None:
        sequence = self.model.sequence
        if sequence is None:  # closed already
            return
        pool = sequence.pool
        self.tally.failovers, self.tally.recoveries = sequence.failovers, sequence.recoveries
        self.model.shutdown()
        self.tally.channels_after_close = len(pool.endpoints)
