"""Verified generation (client/inference_checks.py), on an in-memory swarm: a peer that adds noise to its inference
answers (finite, of the right shape and dtype: nothing but another peer's recomputation tells) is caught by a check,
banned (three honest peers outvote it) or, with only two to outvote it, set aside for the session, and generate()
redoes the tokens after what was verified, so the text and every step's logits are the local model's; a checker
that lies gets nobody honest banned.

Peers serve the tiny Llama as 0:2 and 2:4; the liar of 2:4 announces a far higher throughput than the honest peers
of 2:4, so that routes go to it. Checks run after every step (`verify_inference=1`), one at a time.
"""

from __future__ import annotations

import asyncio
import random
import types

import pytest
import torch

from client.config import ClientConfig
from client.decoding import decode_tokens, lm_head_batcher
from client.hop_checks import Verdict
from client.inference_checks import InferenceChecks
from protocol.errors import OutputRewoundError
from tests.helpers.fake_swarm import Fault
from tests.helpers.generation import assert_same_generation, generate_with_logits
from tests.helpers.models import VOCAB_SIZE

LIE_FROM_STEP = 4  # the liar answers the prompt and three steps honestly: a check then has verified positions
CHECKED = dict(verify_inference=1.0, verify_seed=0, verify_fraction=0.0)


def _ids(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB_SIZE, (batch, length), generator=torch.Generator().manual_seed(seed))


def _options(ids: torch.Tensor, padded: bool = True) -> dict:
    options = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)
    if ids.shape[0] > 1:
        options["attention_mask"] = torch.ones_like(ids)
        if padded:  # the second row left-padded: the checks carry the session's mask
            options["attention_mask"][1, :3] = 0
            ids[1, :3] = 0
    return options


def _swarm(fake_swarm, route_faults: list[Fault], checker_faults: list[Fault] = (), spares: int = 2):
    """The peer of 0:2, the routed peer of 2:4, a checker of 2:4 (with `checker_faults`), and `spares` more of 2:4."""
    first = fake_swarm.add_peer(0, 2)
    routed = fake_swarm.add_peer(2, 4, throughput=1e6, faults=route_faults)
    checker = fake_swarm.add_peer(2, 4, faults=list(checker_faults))
    return first, routed, checker, *(fake_swarm.add_peer(2, 4) for _ in range(spares))


@pytest.mark.parametrize(
    "batch, padded", [(1, False), (2, True), (2, False)], ids=["one-row", "left-padded-batch", "unpadded-batch"]
)
def test_a_peer_lying_on_inference_steps_is_caught_and_the_text_is_the_local_models(
    fake_swarm, tiny_llama_local, batch, padded
):
    first, liar, *honest = _swarm(fake_swarm, [Fault("perturb", method="inference", after=LIE_FROM_STEP)])
    ids = _ids(batch, 6, seed=31)
    options = _options(ids, padded)
    expected = generate_with_logits(tiny_llama_local, ids, **options)

    unchecked = fake_swarm.client(verify_inference=0.0, verify_fraction=0.0)
    try:  # the lie matters: without the checks it changes the logits
        lied = generate_with_logits(unchecked, ids, **options)
        assert not torch.allclose(lied[1], expected[1], atol=1e-3), "the liar's noise changed nothing"
    finally:
        unchecked.shutdown()

    remote = fake_swarm.client(**CHECKED)
    try:
        with remote.inference_session(max_length=64) as session:
            got = generate_with_logits(remote, ids, **options)
            assert session.remote.checks.caught == 1
            assert liar.peer_id not in {s.hop.peer_id for s in session.remote.spans}
        assert_same_generation(got, expected)
        assert remote.sequence.spot_checks.stats.caught == [liar.peer_id]
        banned = remote.sequence.bans.banned()
        assert liar.peer_id in banned and not banned & {first.peer_id, *(peer.peer_id for peer in honest)}
    finally:
        remote.shutdown()


def test_with_two_honest_peers_the_liar_is_only_set_aside_and_the_text_is_still_the_local_models(
    fake_swarm, tiny_llama_local
):
    """Two against one bans nobody (two colluders could be the two): the session routes around the outvoted peer,
    the text is the local model's, and a later session may use it again (its checks then catch it again)."""
    _, liar, *_ = _swarm(fake_swarm, [Fault("perturb", method="inference", after=LIE_FROM_STEP)], spares=1)
    ids = _ids(1, 6, seed=35)
    options = _options(ids)
    expected = generate_with_logits(tiny_llama_local, ids, **options)
    remote = fake_swarm.client(**CHECKED)
    try:
        with remote.inference_session(max_length=64) as session:
            got = generate_with_logits(remote, ids, **options)
            assert session.remote.checks.caught == 1 and session.remote.set_aside == {liar.peer_id}
            assert liar.peer_id not in {s.hop.peer_id for s in session.remote.spans}
        assert_same_generation(got, expected)
        stats = remote.sequence.spot_checks.stats
        assert stats.outvoted == [liar.peer_id] and stats.caught == []
        assert remote.sequence.bans.banned() == set()
    finally:
        remote.shutdown()


def test_a_checker_that_lies_gets_nobody_honest_banned_and_nothing_is_redone(fake_swarm, tiny_llama_local):
    """The routed peer is honest; one of the two others lies to checks (forward calls). Drawn as the checker, it
    disagrees with the routed peer, and the third peer outvotes it: it is banned, nobody else, and no token redone."""
    first, routed, liar, *spares = _swarm(fake_swarm, [], [Fault("perturb", method="forward")])
    ids = _ids(1, 6, seed=32)
    options = _options(ids)
    expected = generate_with_logits(tiny_llama_local, ids, **options)
    remote = fake_swarm.client(**CHECKED)
    try:
        with remote.inference_session(max_length=64) as session:
            got = generate_with_logits(remote, ids, **options)
            assert session.remote.checks.caught == 0 and session.remote.checks.started > 0
        assert_same_generation(got, expected)
        banned = remote.sequence.bans.banned()
        assert not banned & {first.peer_id, routed.peer_id, *(spare.peer_id for spare in spares)}
        assert (liar.peer_id in banned) == (liar.acted > 0), "a checker that lied is banned, and only then"
    finally:
        remote.shutdown()


def test_a_liar_caught_in_a_second_generate_of_the_session_is_redone_from_its_prompt(fake_swarm, tiny_llama_local):
    """A conversation: the second generate() passes the whole sequence so far; the liar starts lying in it."""
    _, liar, *_ = _swarm(fake_swarm, [Fault("perturb", method="inference", after=12)])
    ids = _ids(1, 6, seed=33)
    first_turn = generate_with_logits(tiny_llama_local, ids, max_new_tokens=8, do_sample=False)[0]
    second_ids = torch.cat([first_turn, _ids(1, 3, seed=34)], dim=1)
    expected = generate_with_logits(tiny_llama_local, second_ids, max_new_tokens=12, do_sample=False)
    remote = fake_swarm.client(**CHECKED)
    try:
        with remote.inference_session(max_length=64) as session:
            assert generate_with_logits(remote, ids, max_new_tokens=8, do_sample=False)[0].tolist() == (
                first_turn.tolist()
            )
            got = generate_with_logits(remote, second_ids, max_new_tokens=12, do_sample=False)
            assert session.remote.checks.caught == 1
        assert_same_generation(got, expected)
        assert liar.peer_id in remote.sequence.bans.banned()
    finally:
        remote.shutdown()


def test_a_lie_its_colluder_confirmed_is_caught_later_and_redone_from_where_it_began(fake_swarm, tiny_llama_local):
    """Two colluders tell the same lie (the answer times 1.01): the routed peer of 0:2 on its inference steps, the
    other whenever it is asked to check. While no honest peer of 0:2 is in the directory, the colluder confirms the
    first turn's answers, and the peer of 2:4 builds its cache on them. Then honest peers of 0:2 take the colluder's
    place in the directory (with it there, a check would draw it as often as not): a check of the second turn
    outvotes the liar and finds its answers wrong from position 0, inside what the colluder confirmed.
    The session goes back there, not to where the colluder's confirmation ended (which kept the cache of 2:4 built
    on the lie), sets both aside, and the second turn is the local model's. Nobody honest is banned."""
    liar = fake_swarm.add_peer(0, 2, throughput=1e6, faults=[Fault("scale", method="inference")])
    colluder = fake_swarm.add_peer(0, 2, faults=[Fault("scale", method="forward")])
    honest = [fake_swarm.add_peer(0, 2) for _ in range(3)]  # three to one: the liar is banned
    last = [fake_swarm.add_peer(2, 4) for _ in range(2)]
    for peer in honest:
        peer.in_directory = False
    ids = _ids(1, 6, seed=36)
    remote = fake_swarm.client(**CHECKED, directory_refresh_s=0.01)
    try:
        with remote.inference_session(max_length=64) as session:
            # 12 steps however soon the tiny model would end: each draws which span to check
            first_turn = generate_with_logits(remote, ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)[0]
            checks, (lied, _) = session.remote.checks, session.remote.spans
            assert lied.hop.peer_id == liar.peer_id and checks.caught == 0
            assert lied.verified > 0 and {peers for _, peers in lied.confirmed} == {(colluder.peer_id,)}
            for peer in honest:
                peer.in_directory = True
            colluder.in_directory = False
            second_ids = torch.cat([first_turn, _ids(1, 3, seed=37)], dim=1)  # the reply as the client got it
            second = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False)
            got = generate_with_logits(remote, second_ids, **second)
            assert checks.caught >= 1 and checks.colluders == {colluder.peer_id}
            assert {liar.peer_id, colluder.peer_id} <= session.remote.set_aside
        assert_same_generation(got, generate_with_logits(tiny_llama_local, second_ids, **second))
        assert not remote.sequence.bans.banned() & {peer.peer_id for peer in [*honest, *last]}
    finally:
        remote.shutdown()


def test_verify_inference_is_a_probability():
    peers = ("/ip4/127.0.0.1/tcp/1",)
    assert ClientConfig(initial_peers=peers).verify_inference == 0.05
    for wrong in (-0.1, 1.5):
        with pytest.raises(ValueError, match="verify_inference must lie in"):
            ClientConfig(initial_peers=peers, verify_inference=wrong)


def test_the_apis_decoding_is_told_of_a_liar_and_its_next_generation_gives_the_local_models_tokens(
    fake_swarm, tiny_llama_local
):
    """What `swarmlm api` runs (client/decoding.py): a generation whose check caught the liar raises
    OutputRewoundError (at a step, or at settle() after the last one), and the generation the API starts again
    gives the local model's greedy tokens (client/api/jobs.py retries; tests/client/test_api_app.py)."""
    _, liar, *honest = _swarm(fake_swarm, [Fault("perturb", method="inference", after=LIE_FROM_STEP)])
    prompt = _ids(1, 6, seed=32)
    expected = tiny_llama_local.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)[0, 6:].tolist()

    def greedy(ids, logits):
        return logits.argmax(-1)

    remote = fake_swarm.client(**CHECKED)
    heads = lm_head_batcher(remote)
    try:
        tokens = decode_tokens(remote, heads, prompt[0].tolist(), 12, greedy)
        with pytest.raises(OutputRewoundError, match="wrong results"):
            for _ in tokens:
                pass
            tokens.settle()
        tokens.close()
        assert liar.peer_id in remote.sequence.bans.banned()
        again = decode_tokens(remote, heads, prompt[0].tolist(), 12, greedy)
        try:
            assert list(again) == expected
            again.settle()
        finally:
            again.close()
        assert not remote.sequence.bans.banned() & {peer.peer_id for peer in honest}
    finally:
        remote.shutdown()


def test_a_lie_in_the_last_step_is_caught_by_settle_after_the_tokens_ran_out(fake_swarm, tiny_llama_local):
    """A caller that takes every token (the iterator runs out) and then settles: the check of the last steps, still
    running or owed when the last token came, is made, and catches the liar. Ending the iteration must not end the
    session, nor cancel its check: only close() does."""
    _, liar, *_ = _swarm(fake_swarm, [Fault("perturb", method="inference", after=11)])  # the 12th answer
    prompt = _ids(1, 6, seed=36)

    def greedy(ids, logits):
        return logits.argmax(-1)

    remote = fake_swarm.client(**CHECKED)
    tokens = decode_tokens(remote, lm_head_batcher(remote), prompt[0].tolist(), 12, greedy)
    try:
        assert len(list(tokens)) == 12 and not tokens.session.closed
        with pytest.raises(OutputRewoundError, match="wrong results"):
            tokens.settle()
        tokens.close()
        assert tokens.session.closed and liar.peer_id in remote.sequence.bans.banned()
    finally:
        tokens.close()
        remote.shutdown()


def test_answers_no_other_peer_can_recompute_are_never_taken_as_verified(fake_swarm):
    fake_swarm.add_peer(0, 2)
    fake_swarm.add_peer(2, 4)
    remote = fake_swarm.client(**CHECKED)
    try:
        with remote.inference_session(max_length=32) as session:
            remote.generate(_ids(1, 6, seed=37), max_new_tokens=4, do_sample=False, pad_token_id=0)
            checks = session.remote.checks
            assert checks.started > 0 and checks.caught == 0
            assert [span.verified for span in session.remote.spans] == [0, 0]
        assert remote.sequence.spot_checks.stats.unverifiable >= checks.started
    finally:
        remote.shutdown()


class _ScriptedSession:
    """What InferenceChecks reads of a session: one span's history, and a check_inference answered by `verdicts`
    (True: stands, False: caught, None: nothing verified, an exception: the check could not be made), each once
    `release` is set."""

    def __init__(self, verdicts: list):
        self.verdicts, self.release, self.checked_to = list(verdicts), asyncio.Event(), []
        self.position, self.mask = 0, None
        hop = types.SimpleNamespace(start=2, end=4)
        self.spans = [types.SimpleNamespace(hop=hop, verified=0, confirmed=[], inputs=[], outputs=[], positions=[])]
        self.sequence = types.SimpleNamespace(check_inference=self._check)

    def step(self) -> None:
        span = self.spans[0]
        span.inputs.append(torch.zeros(1, 1, 4))
        span.outputs.append(torch.zeros(1, 1, 4))
        span.positions.append(torch.tensor([[self.position]]))
        self.position += 1

    async def _check(self, hop, inputs, outputs, mask, positions) -> Verdict:
        self.checked_to.append(inputs.shape[1])
        await self.release.wait()
        verdict = self.verdicts.pop(0)
        if isinstance(verdict, Exception):
            raise verdict
        if isinstance(verdict, Verdict):
            return verdict
        return Verdict(verdict, peers=("checker",) if verdict else (), first_wrong=0 if verdict is False else None)


@pytest.mark.parametrize(
    "first", [True, None, TimeoutError("the checker did not answer")], ids=["stood", "unverified", "failed"]
)
def test_steps_decoded_while_a_check_ran_are_checked_before_generate_returns(first):
    """Checks slower than steps (a loaded machine): the last steps of a generation drew no check of their own, and a
    failed check verified nothing; settle() makes the check they are owed, which catches a liar there."""

    async def run():
        session = _ScriptedSession([first, False])
        checks = InferenceChecks(1.0, random.Random(0))
        session.step()
        checks.after_step(session)  # a check of position 1 starts, and is slow
        for _ in range(3):
            session.step()
            checks.after_step(session)  # none of these steps starts one
        session.release.set()
        liar = await checks.settle(session)
        assert session.checked_to == [1, 4]  # the owed check covers every step
        assert liar is session.spans[0] and checks.caught == 1
        await checks.close()

    asyncio.run(run())


def test_a_check_that_verified_nothing_leaves_its_positions_to_verify():
    """No other route answered (or none formed a majority): the span's answers are not verified by it, and settle()
    checks them again."""

    async def run():
        session = _ScriptedSession([None, True])
        checks = InferenceChecks(1.0, random.Random(0))
        session.step()
        checks.after_step(session)
        session.release.set()
        await asyncio.sleep(0)
        assert await checks.settle(session) is None
        assert session.checked_to == [1, 1] and session.spans[0].verified == 1 and checks.caught == 0

    asyncio.run(run())


def test_a_generation_whose_checks_kept_up_owes_none():
    async def run():
        session = _ScriptedSession([True])
        checks = InferenceChecks(1.0, random.Random(0))
        session.step()
        checks.after_step(session)
        session.release.set()
        assert await checks.settle(session) is None
        assert session.checked_to == [1] and not checks.owed

    asyncio.run(run())


def test_a_lie_a_colluder_confirmed_is_rewound_to_where_it_began_and_the_colluder_set_aside():
    """A liar's colluder drawn to check it confirms its answers up to position 4; a later check, by honest peers,
    outvotes them and finds them wrong from position 2 on: the session goes back to 2, not to the 4 the colluder
    confirmed (the text would keep its lie), and the colluder is set aside with the liar."""

    async def run():
        session = _ScriptedSession([Verdict(True, peers=("colluder",)), Verdict(False, first_wrong=2)])
        checks = InferenceChecks(1.0, random.Random(0))
        for _ in range(4):
            session.step()
        checks.after_step(session)
        session.release.set()
        await checks._wait()
        assert session.spans[0].verified == 4 and checks.liar() is None
        for _ in range(2):
            session.step()
        checks.after_step(session)
        liar = await checks.settle(session)
        assert liar is session.spans[0] and liar.verified == 2 and checks.colluders == {"colluder"}
        assert session.checked_to == [4, 6]

    asyncio.run(run())


def test_the_first_position_two_results_differ_at():
    from client.verify import first_disagreement

    honest = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(0))
    lied = honest.clone()
    assert first_disagreement(honest, lied, 1e-4) is None
    lied[1, 3:] *= 1.01  # from position 3 on, one row only
    lied[0, 5, 0] += 1e-7  # within the tolerance
    assert first_disagreement(honest, lied, 1e-4) == 3
    with pytest.raises(ValueError, match="positions"):
        first_disagreement(honest, lied[:, :4], 1e-4)
