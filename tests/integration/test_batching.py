"""Concurrent sessions batched on live peers: each greedy generation, run together with others of different
prompt lengths, is the local Hugging Face model's, step logits included; the peers did batch them; a long prompt
is prefilled in chunks among them without starving anyone; a session that vanishes mid-batch costs only itself.

Two peer processes serve the tiny Llama (0:2, 2:4) with `--max-batch-tokens 16`: prompts longer than 16 tokens
are prefilled in chunks, and at most 16 decode steps share a forward.
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from client import AutoDistributedModelForCausalLM
from client.session import InferenceSession
from protocol import swarmlm_pb2 as pb
from protocol.records import prefix_for_model
from tests.helpers.generation import ATOL
from tests.helpers.models import VOCAB_SIZE
from tests.helpers.processes import Swarm

SPANS = [(0, 2), (2, 4)]
MAX_BATCH_TOKENS = 16
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_llama_path):
    with Swarm(tmp_path_factory.mktemp("swarm")) as swarm:
        swarm.start_bootstrap()
        for start, end in SPANS:
            swarm.start_peer(tiny_llama_path, "--blocks", f"{start}:{end}", "--max-batch-tokens", str(MAX_BATCH_TOKENS))
        snapshot = swarm.wait_online(prefix_for_model(str(tiny_llama_path)), SPANS)
        remote = AutoDistributedModelForCausalLM.from_pretrained(
            str(tiny_llama_path), initial_peers=swarm.initial_peers
        )
        local = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
        try:
            yield remote, local, [info.endpoint for info in snapshot.online().values()]
        finally:
            remote.shutdown()


def _prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB_SIZE, (1, length), generator=torch.Generator().manual_seed(seed))


async def _greedy(remote, prompt: torch.Tensor, new_tokens: int, progress: list | None = None):
    """Greedy decoding through an inference session of the client: (tokens, logits [new_tokens, vocab])."""
    session = InferenceSession(remote.sequence, prompt.shape[1] + new_tokens, batch_size=1)
    tokens, logits = prompt, []
    try:
        hidden_in = remote.get_input_embeddings()(prompt)
        positions = torch.arange(prompt.shape[1]).unsqueeze(0)
        for _ in range(new_tokens):
            with torch.inference_mode():
                hidden = await session.step(hidden_in, None, positions)
                step_logits = remote.lm_head(remote.model.norm(hidden[:, -1]))
            logits.append(step_logits[0])
            token = step_logits.argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, token], dim=1)
            with torch.inference_mode():
                hidden_in = remote.get_input_embeddings()(token)
            positions = torch.tensor([[tokens.shape[1] - 1]])
            if progress is not None:
                progress.append(prompt.shape[1])
    finally:
        await session.close()
    return tokens, torch.stack(logits)


def _assert_local_model_agrees(local, prompt: torch.Tensor, tokens: torch.Tensor, logits: torch.Tensor) -> None:
    """The local model's greedy generation of as many tokens (it may stop earlier, at EOS), logits included."""
    out = local.generate(
        prompt, max_new_tokens=logits.shape[0], do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    expected = torch.stack(out.logits, dim=1)[0]
    assert tokens[:, : out.sequences.shape[1]].tolist() == out.sequences.tolist()
    torch.testing.assert_close(logits[: expected.shape[0]], expected, atol=ATOL, rtol=0)


def _infos(remote, endpoints) -> list[pb.InfoResponse]:
    async def read():
        return [await remote.sequence.pool.unary(e, "info", pb.InfoRequest(), 10.0) for e in endpoints]

    return remote._run(read())


def test_concurrent_sessions_are_batched_and_each_stays_exact(served):
    remote, local, endpoints = served
    prompts = [_prompt(length, seed) for seed, length in enumerate([3, 9, 5, 14, 7, 11])]
    before = _infos(remote, endpoints)

    async def together():
        return await asyncio.gather(*(_greedy(remote, p, NEW_TOKENS) for p in prompts))

    results = remote._run(together())
    after = _infos(remote, endpoints)
    for prompt, (tokens, logits) in zip(prompts, results):
        _assert_local_model_agrees(local, prompt, tokens, logits)
    for then, now in zip(before, after):
        assert now.batched_steps - then.batched_steps > now.decode_batches - then.decode_batches, (
            "no peer ever computed two sessions' steps together"
        )
        timings = now.step_timings  # every step's phases were timed (peer/timings.py)
        assert timings.steps - then.step_timings.steps == len(prompts) * NEW_TOKENS
        phases = (timings.parse_s, timings.wait_s, timings.compute_s, timings.reply_s)
        assert all(math.isfinite(s) and s >= 0 for s in phases) and timings.compute_s > 0, phases


def test_a_long_prompt_among_short_sessions_is_chunked_and_nobody_starves(served):
    remote, local, _endpoints = served
    long_prompt = _prompt(10 * MAX_BATCH_TOKENS + 3, seed=50)  # 11 chunks on each peer
    shorts = [_prompt(4 + i, seed=60 + i) for i in range(5)]
    progress: list[int] = []

    async def together():
        return await asyncio.gather(
            _greedy(remote, long_prompt, 4, progress), *(_greedy(remote, p, 3 * NEW_TOKENS, progress) for p in shorts)
        )

    results = remote._run(together())
    for prompt, (tokens, logits) in zip([long_prompt, *shorts], results):
        _assert_local_model_agrees(local, prompt, tokens, logits)
    # the long session finished while the short ones were still decoding: it was not starved by them
    long_done = max(i for i, length in enumerate(progress) if length == long_prompt.shape[1])
    assert long_done < len(progress) - 5, "the long prompt's session finished only after every short session"


def test_a_session_that_vanishes_mid_batch_costs_only_itself(served):
    remote, local, endpoints = served
    prompts = [_prompt(length, seed) for seed, length in enumerate([6, 10, 4, 8], start=20)]

    async def with_one_cancelled():
        progress: list[int] = []
        tasks = [asyncio.ensure_future(_greedy(remote, p, NEW_TOKENS, progress)) for p in prompts]
        for _ in range(1000):  # bounded: let it get 3 steps in, then its client goes away mid-generation
            if progress.count(prompts[1].shape[1]) >= 3:
                break
            await asyncio.sleep(0.005)
        tasks[1].cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = remote._run(with_one_cancelled())
    assert isinstance(results[1], asyncio.CancelledError)
    for i in (0, 2, 3):
        _assert_local_model_agrees(local, prompts[i], *results[i])

    async def sessions_left():
        for _ in range(100):  # bounded: the vanished session's streams close on the peers a little later
            infos = [await remote.sequence.pool.unary(e, "info", pb.InfoRequest(), 10.0) for e in endpoints]
            if all(i.open_sessions == 0 for i in infos):
                return 0
            await asyncio.sleep(0.1)
        return sum(i.open_sessions for i in infos)

    assert remote._run(sessions_left()) == 0
