"""Mutation check: break the client or peer code on purpose, one small bug at a time, and see whether tests notice.

    .venv/bin/python -m tests.mutations                   # every mutation (19 minutes on 2 busy cores)
    .venv/bin/python -m tests.mutations --list            # the mutations, their tests, whether they still apply
    .venv/bin/python -m tests.mutations --only stuck-decode-positions replay-drops-last-token
    .venv/bin/python -m tests.mutations --only peer-span-one-block-short --tests tests/integration/test_generation.py

For each mutation it replaces one exact snippet of one file (it must occur exactly once, or the check stops
before running anything: a refactor that invalidates a mutation is noticed, fix the snippet here), runs that
mutation's pytest selection, and prints a table of what each mutation breaks, how many tests ran, and which
test failed, or NOT CAUGHT. A selection runs with `-x` (one failing test is enough) unless `--every-test`.
At the end the tests that caught something run once more without any mutation: a test that fails anyway
catches nothing, and its mutation is reported as not caught. Exit status: 0 if every mutation was caught,
1 if one survived (or timed out, or could not be confirmed), 2 if a mutation no longer applies, 130 on Ctrl+C.
Not part of CI; add a mutation to MUTATIONS when a change adds behaviour that tests must guard.

The working tree is never written to: other people edit and test it meanwhile. The files git knows of
(tracked, plus untracked ones not ignored) are copied into a temporary directory; each mutation is written
there and undone after its run. pytest runs with this interpreter, cwd = the copy, and PYTHONPATH = the copy,
PYTHONDONTWRITEBYTECODE=1 (no stale .pyc when a file is restored within the same second).

Why the peer processes that integration tests spawn run the mutated copy, not /work/main: the project is an
editable install, whose `__editable___swarmlm_*_finder` is *appended* to `sys.meta_path` by a .pth file. The
standard PathFinder comes before it and searches `sys.path`, where PYTHONPATH entries come before
site-packages, so `import peer` finds the copy's package; the editable finder (which maps the names to the
original checkout) is only asked about names the copy lacks, and it has them all. `.venv/bin/swarmlm` is the
same interpreter running `from swarm.cli import main`, and tests/helpers/processes.py hands `os.environ`,
PYTHONPATH included, to every process it starts (hivemind's DHT child and p2pd inherit it too). The check
verifies this before running anything (the packages resolve under the copy from a process started outside
it); it was also shown end to end: `peer-span-one-block-short` run against only
test_generation.py::test_logits_match_local_model[llama] (the pytest process never imports peer code there)
fails in the copy, passes in the copy without PYTHONPATH and passes unmutated.

Every pytest run is bounded by `--timeout-s` (its tests by half of that, through pytest-timeout). On a timeout
or Ctrl+C, pytest gets SIGTERM first (tests/conftest.py turns it into KeyboardInterrupt, so fixtures stop their
swarms), then SIGKILL; any process still carrying this run's marker in its environment is then killed by pid,
and the temporary directory is removed.

This module is also the pytest plugin (`-p tests.mutations`) that records each test's outcome for the table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUTCOMES_ENV = "SWARMLM_MUTATION_OUTCOMES"  # where the plugin appends one JSON line per test phase
MARKER_ENV = "SWARMLM_MUTATION_RUN"  # every process of a run inherits it; leftovers are found by it

GEN = "tests/integration/test_generation.py"
FAIL = "tests/integration/test_failover.py"
TRAIN = "tests/integration/test_training.py"
EXACT = "tests/integration/test_training_exact.py"
API = "tests/integration/test_api.py"
# the client's logic on in-memory peers (tests/helpers/fake_swarm.py): milliseconds, so they run first
FAST_FAIL = "tests/client/test_failover.py"
FAST_CRASH = f"{FAST_FAIL}::test_generation_survives_a_crash"
FAST_PADDED_CRASH = f"{FAST_CRASH}[first-span-padded-batch]"
FAST_PUSHES = "tests/client/test_pushes.py::test_steps_travel_peer_to_peer_and_stay_exact"
FAST_LIES = "tests/client/test_lying_peers.py"


@dataclass(frozen=True)
class Mutation:
    """One deliberate bug: `find` (exactly once in `path`) becomes `replace`; `tests` should then fail."""

    name: str
    path: str
    find: str
    replace: str
    breaks: str
    tests: tuple[str, ...]
    """pytest arguments (files, node ids), run in this order: cheap unit tests first."""
    keyword: str | None = None
    """A `-k` expression narrowing `tests`, for tests whose node ids are not known yet."""


MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "stuck-decode-positions",
        "client/model.py",
        "        position_ids = position_ids[:, -new:]\n",
        "        position_ids = position_ids[:, -new:]\n"
        "        if session.remote is not None and session.remote.spans and session.remote.spans[0].inputs:\n"
        "            prompt = session.remote.spans[0].inputs[0].shape[1]  # MUTATION\n"
        "            position_ids = torch.full_like(position_ids, prompt)\n",
        "every decode step gets the position where the prompt ended",
        (f"{FAST_PUSHES}[never]", f"{GEN}::test_greedy_generation_is_identical[llama]"),
    ),
    Mutation(
        "peer-cache-does-not-grow",
        "peer/steps.py",
        "                    return span(\n"
        "                        hidden[:, begin:end],\n"
        "                        mask[:, : step.prefix_length + end] if mask is not None else None,\n"
        "                        positions[:, begin:end] if positions is not None else None,\n"
        "                        session.cache,\n"
        "                        step.prefix_length + begin,\n"
        "                        blocks=session.blocks,\n"
        "                        between_layers=self.served.compute.checkpoint,\n"
        "                        adapter=session.adapter,\n"
        "                    )\n",
        "                    out = span(\n"
        "                        hidden[:, begin:end],\n"
        "                        mask[:, : step.prefix_length + end] if mask is not None else None,\n"
        "                        positions[:, begin:end] if positions is not None else None,\n"
        "                        session.cache,\n"
        "                        step.prefix_length + begin,\n"
        "                        blocks=session.blocks,\n"
        "                        between_layers=self.served.compute.checkpoint,\n"
        "                        adapter=session.adapter,\n"
        "                    )\n"
        "                    if step.prefix_length:  # MUTATION\n"
        "                        rewind_cache(session.cache, step.prefix_length)\n"
        "                    return out\n",
        "the peer's KV cache keeps only the prompt: a new token sees the prompt and itself",
        (f"{FAST_PUSHES}[never]", f"{GEN}::test_greedy_generation_is_identical[llama]"),
    ),
    Mutation(
        "replay-drops-last-token",
        "client/session.py",
        "            history = torch.cat(old.inputs, dim=1)\n            positions = torch.cat(old.positions, dim=1)\n",
        "            history = torch.cat(old.inputs, dim=1)[:, :-1]  # MUTATION\n"
        "            positions = torch.cat(old.positions, dim=1)[:, :-1]\n",
        "failover replays a span's history without its last token",
        (FAST_CRASH, f"{FAIL}::test_generation_survives_sigkill"),
    ),
    Mutation(
        "replay-positions-off-by-one",
        "client/session.py",
        "            positions = torch.cat(old.positions, dim=1)\n",
        "            positions = torch.cat(old.positions, dim=1) + 1  # MUTATION\n",
        "failover replays the history at positions shifted by one",
        (FAST_CRASH, f"{FAIL}::test_generation_survives_sigkill"),
    ),
    Mutation(
        "peer-ignores-mask",
        "peer/served.py",
        "        return hidden, mask, positions\n",
        "        return hidden, None, positions  # MUTATION\n",
        "the peer validates the padding mask, then drops it",
        (FAST_PADDED_CRASH, f"{GEN}::test_batch_with_left_padding_is_identical[llama]"),
    ),
    Mutation(
        "session-mask-not-sent",
        "client/session.py",
        "                    attention_mask=packer.optional(mask),\n",
        "                    attention_mask=packer.optional(None),  # MUTATION\n",
        "inference steps are sent without the padding mask",
        (FAST_PADDED_CRASH, f"{GEN}::test_batch_with_left_padding_is_identical[llama]"),
    ),
    Mutation(
        "peer-span-one-block-short",
        "peer/served.py",
        "        return span.start, span.end\n",
        "        return span.start, span.end - 1  # MUTATION\n",
        "the peer runs a request's span without its last block",
        (
            "tests/peer/test_activations.py::test_backward_uses_kept_activations_and_matches_recompute",
            f"{GEN}::test_logits_match_local_model[llama]",
        ),
    ),
    Mutation(
        "route-hop-end-off-by-one",
        "client/routing.py",
        "        hops.append(RouteHop(peer_id, i, j, usable[peer_id].endpoint))\n",
        "        hops.append(RouteHop(peer_id, i, j - 1, usable[peer_id].endpoint))  # MUTATION\n",
        "an inference route's hops end one block early (that block is skipped)",
        ("tests/client/test_routing.py",),
        "not forward",
    ),
    Mutation(
        "backward-skips-a-hop",
        "client/sequence.py",
        "        for record in reversed(records):\n            grad = await self._backward_hop(record, grad, mask, positions, 0,",
        "        for record in reversed(records[1:]):  # MUTATION\n"
        "            grad = await self._backward_hop(record, grad, mask, positions, 0,",
        "backward does not go through the first hop",
        (
            f"{FAST_FAIL}::test_forward_and_backward_fail_over",
            f"{GEN}::test_gradients_flow_through_remote_blocks[llama]",
        ),
    ),
    Mutation(
        "peer-backward-returns-grad",
        "peer/handler.py",
        "(grad_inputs,) = torch.autograd.grad(outputs, kept.inputs, grads)\n                return grad_inputs\n",
        "(grad_inputs,) = torch.autograd.grad(outputs, kept.inputs, grads)\n                return grad.to(span.device)  # MUTATION\n",
        "the peer's backward returns the gradient it was given, unchanged",
        (
            "tests/peer/test_activations.py::test_backward_uses_kept_activations_and_matches_recompute",
            f"{GEN}::test_gradients_flow_through_remote_blocks[llama]",
        ),
    ),
    Mutation(
        "ban-never-lifted",
        "client/bans.py",
        "    def banned(self",
        "    def banned(self, *args, **kwargs) -> set[str]:  # MUTATION: every peer ever banned\n"
        "        return set(self._until)\n\n"
        "    def _banned_before_mutation(self",
        "a banned peer stays banned forever",
        ("tests/client",),
        "ban",
    ),
    Mutation(
        "failure-does-not-ban",
        "client/sequence.py",
        "        length_s = self.bans.ban(hop.peer_id)",
        "        length_s = 0 and self.bans.ban(hop.peer_id)",
        "a failed peer is not banned, so it is routed to again",
        (
            f"{FAST_FAIL}::test_no_peer_left_raises_typed_error_in_bounded_time",
            "tests/client/test_giving_up.py::test_a_request_tries_max_retries_other_peers_then_raises",
        ),
    ),
    Mutation(
        "inference-failover-retries-dead-peer",
        "client/session.py",
        "        replacements = await self._open_route(old.hop.start, old.hop.end, refresh=True)\n",
        "        replacements = [await self._open(old.hop)]  # MUTATION\n",
        "an inference session retries the failed peer instead of re-routing its span",
        (FAST_CRASH, f"{FAIL}::test_generation_survives_sigkill"),
    ),
    Mutation(
        "replay-skips-second-replacement",
        "client/session.py",
        "            for span in replacements:\n                span.inputs, span.positions",
        "            for span in replacements[:1]:  # MUTATION\n                span.inputs, span.positions",
        "when two peers replace a span, only the first gets the history replayed",
        (f"{FAST_FAIL}::test_span_is_rerouted_to_two_peers",),
    ),
    Mutation(
        "replay-drops-mask",
        "client/session.py",
        "            mask = self.mask[:, : history.shape[1]] if self.mask is not None else None\n",
        "            mask = None  # MUTATION\n",
        "failover replays a padded batch without its mask",
        (FAST_PADDED_CRASH,),
    ),
    Mutation(
        "backward-retries-dead-peer",
        "client/sequence.py",
        "        _, records = await self.forward(inputs, mask, positions, hop.start, hop.end, keep_for_backward=True)\n",
        "        records = [record]  # MUTATION\n",
        "a failed backward hop is retried on the dead peer instead of re-routed",
        (f"{FAST_FAIL}::test_forward_and_backward_fail_over",),
    ),
    Mutation(
        "kept-activations-unchecked",
        "peer/handler.py",
        "                    or not kept.matches(blocks, hidden, mask, positions, adapter)\n",
        "                    or False  # MUTATION\n",
        "a backward uses activations kept under its id even for other inputs",
        ("tests/peer/test_activations.py::test_backward_uses_kept_activations_and_matches_recompute",),
    ),
    # training you can trust (issue 22): each must be caught
    Mutation(
        "peer-gradients-unweighted",
        "peer/training/accumulators.py",
        "                acc.add_(grad.to(torch.float32), alpha=samples)\n",
        "                acc.add_(grad.to(torch.float32), alpha=1)  # MUTATION\n",
        "a training peer adds each micro-batch's gradients without weighting them by its samples",
        ("tests/peer/training/test_accumulators.py", f"{TRAIN}::test_swarm_training_equals_local_training"),
    ),
    Mutation(
        "redo-without-dedup",
        "peer/training/accumulators.py",
        "            if index in held.indices:\n                return False\n",
        "            if False:  # MUTATION\n                return False\n",
        "a micro-batch sent again (its answer was lost) is added twice",
        ("tests/peer/training/test_accumulators.py", EXACT),
    ),
    Mutation(
        "lost-peer-not-fenced",
        "client/training/ledger.py",
        "        return sorted(stage.held.pop(peer_id, {}).items(), key=lambda item: item[0])\n",
        "        return []  # MUTATION\n",
        "the micro-batches a lost member held are not sent to another member: the update misses them",
        ("tests/client/training/test_ledger.py", EXACT),
    ),
    Mutation(
        "stale-micro-batches-swallowed",
        "client/training/update.py",
        "        if status.trainers and self.trainer not in status.trainers:\n",
        "        if False:  # MUTATION\n",
        "a trainer that came late to an update takes the others' round for its own: its batch is lost",
        ("tests/client/training/test_update.py",),
    ),
    Mutation(
        "late-trainer-mixed-in",
        "peer/training/commits.py",
        "        return list(max(agreeing, key=lambda t: (len(t), t))) if agreeing else None\n",
        "        return sorted(self.by_trainer)  # MUTATION\n",
        "a stage waits for (or mixes in) a trainer that came late to the update",
        ("tests/peer/training/test_commits.py",),
    ),
    Mutation(
        "no-master-weights",
        "peer/training/span.py",
        "            for param, master in zip(self.params, self.masters):\n                if param is not master:\n"
        "                    param.copy_(master)\n        # before the next update shows in Info",
        "            for param, master in zip(self.params, self.masters):\n                if param is not master:\n"
        "                    param.copy_(master)\n                    master.copy_(param)  # MUTATION\n"
        "        # before the next update shows in Info",
        "updates live in the compute dtype: in bfloat16 a small update rounds away",
        (f"{EXACT}::test_peers_computing_in_bfloat16_keep_float32_masters_and_track_float32_training",),
    ),
    Mutation(
        "unsigned-progress-accepted",
        "swarm/training/members.py",
        "        peer_id = owners.owner(subkey)\n",
        "        peer_id = owners.owner(subkey) or str(subkey)  # MUTATION\n",
        "a progress record under a plain subkey counts: anyone can announce in a member's name",
        ("tests/swarm/training/test_members.py",),
    ),
    Mutation(
        "group-skips-averaging",
        "peer/training/span.py",
        "            elif len(plan.members) == 1:\n",
        "            elif True:  # MUTATION\n",
        "members of a stage apply their own gradients, never averaging",
        (f"{TRAIN}::test_two_peers_per_stage_and_two_trainers_stay_together",),
    ),
    Mutation(
        "clipping-ignored",
        "peer/training/span.py",
        "                master.grad = (g * scale).to(device=master.device, dtype=torch.float32)\n",
        "                master.grad = g.to(device=master.device, dtype=torch.float32)  # MUTATION\n",
        "a stage ignores the clipping factor of the global norm",
        (EXACT,),
    ),
    Mutation(
        "sat-out-member-not-named",
        "client/training/stages.py",
        "        for pid in self.last_update - taking_part - set(online):\n",
        "        for pid in ():  # MUTATION\n",
        "a member that the directory read missed sits an update out unsaid: the step's log hides it",
        ("tests/client/training/test_stages.py",),
    ),
    Mutation(
        "schedule-ignored",
        "peer/training/span.py",
        "        lr = lr_at(self.recipe, self.epoch)\n",
        "        lr = self.recipe.lr  # MUTATION\n",
        "a stage ignores the learning-rate schedule (warmup, cosine)",
        (EXACT,),
    ),
    Mutation(
        "export-skips-lora-merge",
        "peer/training/span.py",
        "            return lora.merged_layer_state(self.span)",
        "            return {k.replace('.base_layer', ''): v for k, v in self.span.layers.state_dict().items() "
        "if 'lora_' not in k}  # MUTATION",
        "a LoRA peer exports its base weights without the trained adapters",
        (f"{TRAIN}::test_lora_training_exports_what_the_swarm_serves",),
    ),
    Mutation(
        "adapter-export-gets-merged-weights",
        "peer/handler.py",
        "                weights_of = training.adapters\n",
        "                pass  # MUTATION\n",
        "a peer asked for its LoRA adapters sends its merged weights instead",
        (f"{TRAIN}::test_lora_training_exports_what_the_swarm_serves",),
    ),
    Mutation(
        "int8-scale-off",
        "protocol/codec.py",
        "    values = codes.float() * (scales / 127.0).unsqueeze(1)\n",
        "    values = codes.float() * (scales / 128.0).unsqueeze(1)  # MUTATION\n",
        "int8 compression decodes with a scale off by one code: every value 0.8% small",
        ("tests/protocol/test_codec.py",),
    ),
    Mutation(
        "wire-dtype-ignored",
        "client/sequence.py",
        "        self.compression = pb.Compression.Value(config.wire_dtype.upper())\n",
        "        self.compression = pb.NONE  # MUTATION\n",
        "a client asked to compress its activations sends them as computed",
        ("tests/client/test_wire_dtype.py",),
    ),
    Mutation(
        "spot-check-uses-outvoted-answer",
        "client/verify.py",
        "                return majority\n",
        "                return first  # MUTATION\n",
        "a spot check outvotes (and bans) a peer but keeps its wrong answer",
        ("tests/client/test_verify.py", "tests/client/test_spot_checks.py"),
    ),
    Mutation(
        "two-colluders-ban",
        "client/verify.py",
        "        if fourth is not None and agree(fourth.value, majority.value, rtol):\n",
        "        if fourth is None or agree(fourth.value, majority.value, rtol):  # MUTATION\n",
        "a peer outvoted two to one is banned with no fourth peer to confirm it: two colluders ban an honest one",
        ("tests/client/test_verify.py",),
    ),
    Mutation(
        "outvoted-peer-rerouted-to",
        "client/session.py",
        "        self.set_aside.add(liar.hop.peer_id)\n",
        "        pass  # MUTATION\n",
        "a session rewound after a check outvoted a peer (not banned) may route its span back to that peer",
        (
            "tests/client/test_inference_checks.py::"
            "test_with_two_honest_peers_the_liar_is_only_set_aside_and_the_text_is_still_the_local_models",
        ),
    ),
    # --- a hostile network ---
    Mutation(
        "request-caps-unchecked",
        "peer/served.py",
        "        self.admission.check(batch, seq, prefix_length)\n",
        "        pass  # MUTATION\n",
        "a peer computes requests of any size and length",
        ("tests/integration/test_limits.py::test_requests_over_the_hard_caps_are_refused_before_any_compute",),
    ),
    Mutation(
        "cache-quota-ignored",
        "peer/cache.py",
        "                and self.used_by[source] + tokens <= self.source_quota\n",
        "                and True  # MUTATION\n",
        "one client address can take the whole KV cache",
        ("tests/integration/test_limits.py::test_one_client_address_cannot_take_the_whole_cache",),
    ),
    Mutation(
        "session-lifetime-ignored",
        "peer/inference.py",
        "        return time.monotonic() > session.opened_at + self.limits.session_lifetime_s\n",
        "        return False  # MUTATION\n",
        "a session kept busy lives forever",
        (
            "tests/peer/test_inference.py::test_a_session_past_its_lifetime_ends_at_its_next_request",
            "tests/integration/test_limits.py::test_a_session_ends_at_its_lifetime_however_busy",
        ),
    ),
    Mutation(
        "unowned-subkeys-accepted",
        "swarm/trust/identity.py",
        "        return (peer_id, public_key) if peer_id_of(public_key) == peer_id else None\n",
        "        return (peer_id, public_key)  # MUTATION\n",
        "a record whose peer id is not its key's is read as that peer's",
        ("tests/swarm/trust/test_identity.py", "tests/swarm/dht/test_records_dht.py"),
    ),
    Mutation(
        "plain-values-accepted",
        "swarm/dht/validators.py",
        "        if subkey is None:  # hivemind's mark of a plain value\n",
        "        if subkey is None:  # MUTATION\n            return\n        if False:\n",
        "a DHT node keeps a stranger's plain value, which replaces every record under its key",
        (
            "tests/swarm/dht/test_validators.py",
            "tests/swarm/dht/test_records_dht.py::test_a_plain_value_under_every_block_key_erases_nothing",
        ),
    ),
    Mutation(
        "record-size-unbounded",
        "swarm/dht/validators.py",
        "        if len(record.subkey) > MAX_SUBKEY_BYTES or len(record.value) > MAX_VALUE_BYTES:\n",
        "        if False:  # MUTATION\n",
        "a DHT node parses megabyte values and subkeys before it refuses them",
        (
            "tests/swarm/dht/test_validators.py",
            "tests/swarm/dht/test_records_dht.py::test_junk_and_megabyte_entries_are_refused_everywhere",
        ),
    ),
    Mutation(
        "storage-per-key-unbounded",
        "swarm/dht/ledger.py",
        "        if held is None and len(under_key) >= self.max_per_key:\n",
        "        if False:  # MUTATION\n",
        "a DHT node keeps any number of entries under one key",
        ("tests/swarm/dht/test_validators.py",),
    ),
    Mutation(
        "index-unsigned",
        "swarm/dht/directory.py",
        '        if parse_record_subkey(subkey) is None:\n            logger.debug("skipping a model index entry',
        '        if False:  # MUTATION\n            logger.debug("skipping a model index entry',
        "readers count model index entries whose subkey names no owner key",
        ("tests/swarm/dht/test_directory_read.py",),
    ),
    Mutation(
        "status-reads-every-model",
        "swarm/dht/state.py",
        "        if record.num_blocks <= max_blocks:\n",
        "        if True:  # MUTATION\n",
        "the monitor and status read every model of the index, however many blocks a flood of them claims",
        ("tests/swarm/dht/test_state.py",),
    ),
    Mutation(
        "index-read-in-any-order",
        "swarm/dht/directory.py",
        "    ranked = sorted(said, key=lambda prefix: (-support[prefix], prefix))\n",
        "    ranked = sorted(said)  # MUTATION\n",
        "readers with a budget read made-up models before the one most peers announce",
        ("tests/swarm/dht/test_state.py",),
    ),
    Mutation(
        "impostor-not-checked",
        "client/dialing.py",
        "            if snapshot is None or not snapshot.verify(\n",
        "            if False and not snapshot.verify(  # MUTATION\n",
        "a client uses a server that cannot prove the record owner's key",
        (
            f"{FAST_LIES}::test_a_record_pointing_at_another_peers_server_is_an_impostor",
            "tests/integration/test_lying_peer.py::test_a_record_pointing_at_another_peers_server_is_an_impostor",
        ),
    ),
    Mutation(
        "step-id-unchecked",
        "client/checks.py",
        "    if step.step_id != step_id:\n",
        "    if False:  # MUTATION\n",
        "a client takes a peer's answer to another step",
        (
            "tests/client/test_checks.py",
            f"{FAST_LIES}::test_a_lying_peer_is_banned_and_the_results_stay_exact[inference-step_id]",
            "tests/integration/test_lying_peer.py::test_a_lying_peer_is_banned_and_the_results_stay_exact[inference-step_id]",
        ),
    ),
    Mutation(
        "private-calls-unchecked",
        "swarm/trust/rpcauth.py",
        "        if handler is None or reason is None:\n",
        "        if True:  # MUTATION\n",
        "a private swarm's peer serves strangers",
        ("tests/integration/test_private_swarm.py",),
    ),
    Mutation(
        "rounds-take-joiners",
        "swarm/training/rounds.py",
        "        yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)\n",
        "        async for answer in super().rpc_join_group(request, context):  # MUTATION\n            yield answer\n",
        "a stranger may join a training group's rounds through hivemind's matchmaking",
        ("tests/swarm/training/test_private_rounds.py",),
    ),
    Mutation(
        "state-sent-to-strangers",
        "swarm/training/rounds.py",
        "        if self._private and not await self._published_progress(context.remote_id.to_base58()):\n",
        "        if False:  # MUTATION\n",
        "a stranger downloads a private swarm's training state",
        ("tests/swarm/training/test_private_rounds.py",),
    ),
    Mutation(
        "inference-queued-as-training",
        "peer/steps.py",
        "            parts.append(await self.served.run(timed, batch * (end - begin), INFERENCE))\n",
        "            parts.append(await self.served.run(timed, batch * (end - begin)))  # MUTATION: TRAINING, the default\n",
        "a peer's decode steps wait behind every queued training request",
        ("tests/integration/test_compute_order.py",),
    ),
    Mutation(
        "abandoned-work-computed",
        "peer/compute.py",
        "            work.abandoned = True  # not started: skipped; running: stops at its next checkpoint\n",
        "            pass  # MUTATION\n",
        "a peer computes the work of clients that went away",
        ("tests/peer/test_compute.py", "tests/integration/test_compute_order.py"),
    ),
    Mutation(
        "lifetime-is-a-fault",
        "client/session.py",
        "        return isinstance(error, SessionExpiredError) and age >= self.sequence.config.min_session_lifetime_s\n",
        "        return False  # MUTATION\n",
        "a client bans a peer that ended a session at its lifetime",
        (f"{FAST_FAIL}::test_a_client_reopens_a_session_that_reached_its_lifetime_and_keeps_the_peer",),
    ),
    Mutation(
        "batch-padding-unmasked",
        "peer/batching.py",
        "    if bool((lengths == longest).all()):\n",
        "    if True:  # MUTATION\n",
        "a batch's shorter sessions attend to the padding of the longest",
        ("tests/peer/test_batching.py",),
    ),
    Mutation(
        "batch-positions-shared",
        "peer/batching.py",
        "    position_ids = _pad_steps(positions, steps).to(device)\n",
        "    position_ids = _pad_steps(positions, steps).to(device)[:1].expand(sum(rows), steps)  # MUTATION\n",
        "every session of a batch gets the first one's position",
        ("tests/peer/test_batching.py",),
    ),
    Mutation(
        "decode-never-batched",
        "peer/steps.py",
        "            if mask is None and not alone and can_batch(span, new) and batch * new <= self.limits.max_batch_tokens:\n",
        "            if False:  # MUTATION\n",
        "a peer computes concurrent sessions' decode steps one by one",
        ("tests/integration/test_batching.py::test_concurrent_sessions_are_batched_and_each_stays_exact",),
    ),
    Mutation(
        "monitor-renders-markup",
        "client/monitor/static/monitor.js",
        "      node.append(child instanceof Node ? child : String(child));\n",
        '      if (child instanceof Node) node.append(child); else node.insertAdjacentHTML("beforeend", String(child));\n',
        "the monitor's page turns text a peer announced into markup (and runs its script)",
        (
            "tests/integration/test_monitor.py::test_the_page_shows_peers_and_coverage_and_then_the_gap_of_a_killed_peer",
        ),
    ),
    Mutation(
        "monitor-ignores-pings",
        "swarm/dht/state.py",
        "    usable = coverage if answering is None else answering\n",
        "    usable = coverage  # MUTATION\n",
        "a block whose only peers do not answer (crashed, their records not expired yet) is not a gap",
        (
            "tests/swarm/dht/test_state.py",
            "tests/integration/test_monitor.py::test_the_page_shows_peers_and_coverage_and_then_the_gap_of_a_killed_peer",
        ),
    ),
    Mutation(
        "api-cancel-ignored",
        "client/api/generation.py",
        "            if cancel.is_set():\n",
        "            if False:  # MUTATION\n",
        "a generation whose HTTP client went away runs on to max_tokens",
        (
            "tests/client/test_api_app.py::test_a_client_that_disconnects_cancels_its_generation",
            f"{API}::test_a_client_that_disconnects_frees_its_session_on_every_peer",
        ),
    ),
    Mutation(
        "api-stop-string-emitted",
        "client/api/text.py",
        "            return buffer[: min(found)], True\n",
        "            return buffer, True  # MUTATION\n",
        "the API emits the stop string it stopped at",
        ("tests/client/test_api_text.py", f"{API}::test_a_stop_string_ends_the_text_before_it"),
    ),
    Mutation(
        "api-sampling-global-rng",
        "client/api/engine.py",
        "        return torch.multinomial(probs, num_samples=1, generator=self.generator).squeeze(1)\n",
        "        return torch.multinomial(probs, num_samples=1).squeeze(1)  # MUTATION\n",
        "the API samples from the process's global generator: a seed no longer fixes the text",
        (f"{API}::test_seeded_sampling_is_reproducible_and_equals_the_local_model",),
    ),
    Mutation(
        "api-temperature-skipped",
        "client/api/engine.py",
        "            if sampling.temperature != 1.0:\n",
        "            if False:  # MUTATION\n",
        "the API samples without applying the temperature",
        (f"{API}::test_seeded_sampling_is_reproducible_and_equals_the_local_model",),
    ),
    Mutation(
        "head-round-waits-for-nobody",
        "client/heads.py",
        "        if len(self._pending) >= self._members or left <= 0:\n",
        "        if True:  # MUTATION\n",
        "a head batcher with a wait computes each round at once: lockstep among generations is lost",
        ("tests/client/test_heads.py",),
    ),
    Mutation(
        "head-rows-swapped",
        "client/heads.py",
        "                for request, part in zip(batch, logits.split(rows)):\n",
        "                for request, part in zip(reversed(batch), logits.split(rows[::-1])):  # MUTATION\n",
        "a round of LM heads hands each generation another's logits",
        ("tests/client/test_heads.py", f"{API}::test_eight_concurrent_streams_are_each_exact"),
    ),
    Mutation(
        "push-token-unchecked",
        "peer/inference.py",
        " or not hmac.compare_digest(request.push_token, session.push_token):\n",
        " or False:  # MUTATION\n",
        "a peer takes steps pushed into a session by anyone who names it",
        (
            "tests/peer/test_inference.py::test_a_session_answers_its_clients_steps_and_the_steps_pushed_into_it",
            "tests/integration/test_forwarding.py::test_a_pushed_step_needs_the_sessions_token_and_is_checked_like_a_clients",
        ),
    ),
    Mutation(
        "push-hops-unbounded",
        "peer/forwarding.py",
        "    most = min(MAX_HOPS, blocks_left)\n",
        "    most = MAX_HOPS  # MUTATION\n",
        "one step names more next hops than the model has spans left, each a prefill",
        ("tests/peer/test_inference.py::test_more_hops_than_blocks_left_or_a_hop_twice_is_refused_before_any_compute",),
    ),
    Mutation(
        "push-errors-unscrubbed",
        "peer/forwarding.py",
        '    return "the next peer could not be reached"\n',
        "    return str(exc)  # MUTATION\n",
        "a failed push tells its client the transport's words: a refused port from a filtered one",
        ("tests/peer/test_inference.py::test_a_push_of_ours_that_fails_is_reported_on_the_stream",),
    ),
    Mutation(
        "push-report-bans-next",
        "client/session.py",
        "            if isinstance(failed.error, _PushNotTaken):  # the step goes to `span` from here, the client's own\n",
        "            if False:  # MUTATION\n",
        "a peer's report that it could not push a step on gets the next peer banned",
        ("tests/client/test_pushes.py",),
    ),
    Mutation(
        "push-refusal-stops-all-pushes",
        "client/session.py",
        "            if span.session_id in self.unpushed:\n",
        "            if self.unpushed:  # MUTATION\n",
        "one refused push turns pushing off for the whole session, into the replacement of a crashed peer too",
        ("tests/client/test_pushes.py",),
    ),
    Mutation(
        "inference-lies-kept",
        "client/inference_checks.py",
        "            self.found = span\n",
        "            pass  # MUTATION\n",
        "a check that caught a liar on an inference route changes nothing: its wrong tokens stay",
        ("tests/client/test_inference_checks.py",),
    ),
    Mutation(
        "api-rewound-not-retried",
        "client/api/jobs.py",
        "MAX_ATTEMPTS = 3 ",
        "MAX_ATTEMPTS = 1 ",
        "the API answers 503 to a whole answer a check rewound, though none of its text was sent: it could retry",
        ("tests/client/test_api_app.py",),
    ),
    Mutation(
        "api-last-check-not-awaited",
        "client/api/generation.py",
        "            settle()\n",
        "            pass  # MUTATION\n",
        "an answer ends before the route's last check: a liar caught after the last token leaves it wrong, unsaid",
        ("tests/client/test_api_app.py",),
    ),
    Mutation(
        "placement-counts-unproven-records",
        "peer/placement_view.py",
        "        return peer_id != self.own_peer_id\n",
        "        return False  # MUTATION\n",
        "placement counts records nobody proved: a made-up fast record for some blocks keeps honest peers off them",
        ("tests/peer/test_placement_view.py",),
    ),
    Mutation(
        "placement-trusts-libp2p-records",
        "peer/placement_view.py",
        "        return peer_id != self.own_peer_id\n",
        "        return peer_id != self.own_peer_id and info.transport != Transport.P2P  # MUTATION\n",
        "a made-up record of a peer reached only through libp2p counts unproven, and keeps honest peers off its blocks",
        ("tests/peer/test_placement_view.py", "tests/integration/test_placement.py"),
    ),
    Mutation(
        "tunnel-listeners-unbounded",
        "swarm/net/tunnel.py",
        "            while len(self._servers) >= self.max_listeners:\n",
        "            while False:  # MUTATION\n",
        "records naming many libp2p addresses make a peer or client hold a listening socket for each, for good",
        ("tests/swarm/net/test_tunnel.py",),
    ),
    Mutation(
        "joining-dated-by-its-claim",
        "peer/placement_view.py",
        '        return info.model_copy(update={"joined_at": first}) if info.joined_at > first else info\n',
        "        return info  # MUTATION\n",
        "a JOINING record renewed with a fresh joined_at counts as coverage for ever: its blocks stay unserved",
        ("tests/peer/test_placement_view.py",),
    ),
    Mutation(
        "pushed-bytes-not-counted",
        "peer/inference.py",
        "        held = self.served.admission.hold(size_of(received))\n",
        "        held = 0  # MUTATION\n",
        "steps pushed into a session wait outside the peer's queued bytes: pushes pile up memory past --max-queued-bytes",
        ("tests/peer/test_inference.py",),
    ),
    Mutation(
        "inbox-left-not-released",
        "peer/inference.py",
        "            stack.callback(self._release_waiting, stream.inbox)\n",
        "            pass  # MUTATION\n",
        "what a stream left in its inbox stays counted as queued: the peer refuses work for bytes nobody holds",
        ("tests/peer/test_inference.py",),
    ),
    Mutation(
        "checkers-drawn-by-throughput",
        "client/routing.py",
        "        if sum(weights) > 0 and not uniform:\n",
        "        if sum(weights) > 0:  # MUTATION\n",
        "a check's peers are drawn by announced throughput: a liar announcing 1e7 checks itself or its accomplice",
        ("tests/client/test_routing.py::test_a_checks_route_is_drawn_uniformly_whatever_throughput_is_announced",),
    ),
    Mutation(
        "tolerance-by-largest-magnitude",
        "client/verify.py",
        "    return (a - b).abs() <= rtol * (magnitude + floor)\n",
        "    return (a - b).abs() <= rtol * magnitude.max()  # MUTATION\n",
        "answers agree within a tolerance of their largest element: one outlier feature hides lies on the rest",
        ("tests/client/test_verify.py::test_an_outlier_feature_hides_no_lie_on_the_other_elements",),
    ),
    Mutation(
        "unreachable-peers-routed",
        "client/sequence.py",
        "                        snapshot, start, end, inference, banned | self.dialer.unreachable(), min_cache_tokens\n",
        "                        snapshot, start, end, inference, banned, min_cache_tokens  # MUTATION\n",
        "peers that answer no ping are routed to: five stopped fast liars cost each request a timeout",
        ("tests/client/test_dialing.py::test_five_stopped_fast_peers_get_no_request_and_cost_no_timeout",),
    ),
    Mutation(
        "state-streams-unbounded",
        "peer/state_stream.py",
        "        if self._gate.locked() and self.waiting >= MAX_WAITING:\n",
        "        if False:  # MUTATION\n",
        "every State caller waits for its turn: unread streams pile up without bound",
        ("tests/peer/test_state_stream.py",),
    ),
    Mutation(
        "state-writes-untimed",
        "peer/state_stream.py",
        "                    await within(write(part), self.write_timeout_s)\n",
        "                    await write(part)  # MUTATION\n",
        "a State caller that never reads holds the one stream forever",
        ("tests/peer/test_state_stream.py",),
    ),
    Mutation(
        "tunneled-quota-per-identity",
        "peer/cache.py",
        '    return TUNNELED if source.startswith("ipv4:127.") and source != "ipv4:127.0.0.1" else None\n',
        "    return None  # MUTATION\n",
        "every libp2p identity, free to make, gets a cache quota of its own: two of them take the whole cache",
        ("tests/peer/test_cache.py",),
    ),
    Mutation(
        "idle-sessions-kept",
        "peer/inference.py",
        "        budget.reclaim = self._reclaim\n",
        "        pass  # MUTATION\n",
        "a session idle on its cache keeps a waiting client out until the idle timeout",
        ("tests/peer/test_inference.py",),
    ),
    Mutation(
        "announced-throughput-trusted",
        "client/sequence.py",
        "                snapshot = self.speeds.capped(snapshot)\n",
        "                pass  # MUTATION\n",
        "routes weigh peers by the throughput they announce: a liar announcing 1e7 draws nearly every request",
        ("tests/client/test_speeds.py",),
    ),
    Mutation(
        "export-reads-unbounded",
        "client/training/export.py",
        "            if expected is not None:\n",
        "            if False:  # MUTATION\n",
        "export keeps whatever a peer streams: a peer that streams without end fills its reader's memory",
        ("tests/client/test_export_stream.py",),
    ),
    Mutation(
        "pushes-to-any-endpoint",
        "peer/forwarding.py",
        "        if not await self.announced(hop.endpoint):\n",
        "        if False:  # MUTATION\n",
        "a peer pushes steps to any host:port a client names: a relay towards any host, and a port scanner",
        ("tests/peer/test_forwarding.py",),
    ),
    Mutation(
        "tunnel-streams-uncapped",
        "swarm/net/tunnel.py",
        "        if len(self._tasks) >= self.max_streams or self._by_source.get(source, 0) >= self.max_per_source:\n",
        "        if False:  # MUTATION\n",
        "a peer splices every tunnel stream a remote identity opens: 500 streams, 500 sockets",
        (
            "tests/swarm/net/test_tunnel.py::test_a_flood_of_tunnel_streams_from_one_identity_is_capped_and_others_still_get_through",
        ),
    ),
    Mutation(
        "tunnel-streams-never-freed",
        "swarm/net/tunnel.py",
        "            self._by_source[source] -= 1\n",
        "            self._by_source[source] -= 0  # MUTATION\n",
        "a tunnel's end keeps its place under the cap: a client, or a relay and all behind it, refused for good",
        ("tests/swarm/net/test_tunnel.py::test_a_remote_peer_that_closed_its_tunnels_can_open_new_ones",),
    ),
    Mutation(
        "decided-update-dropped",
        "peer/training/follow.py",
        "        decision = decision_for(records, training.status)\n",
        "        decision = None  # MUTATION\n",
        "a stage whose Apply never came drops the update its dead trainer applied elsewhere: stages one apart for good",
        ("tests/integration/test_training_decided.py",),
    ),
    Mutation(
        "lost-apply-never-finished",
        "peer/training/follow.py",
        "            if decider is not None and decider.epoch > decision.epoch and not training.applying():\n",
        "            if False:  # MUTATION\n",
        "a lone stage member whose Apply was lost stays one update behind while its trainer goes on: the run stalls",
        ("tests/integration/test_training_decided.py",),
    ),
    Mutation(
        "decision-not-stored",
        "client/training/trainer.py",
        "        await asyncio.to_thread(self.trainers.decide, epoch, [d.round_id for d in done.values()], scale)\n",
        "        pass  # MUTATION\n",
        "a trainer applies without storing its decision: a stage whose Apply never comes cannot finish the update",
        ("tests/integration/test_training_decided.py",),
    ),
    Mutation(
        "router-grad-not-sent",
        "client/training/microbatches.py",
        "                router_grad = tuple(totals.prob_grad(self.aux_coef))\n",
        "                router_grad = ()  # MUTATION\n",
        "a MoE run's stages never get the load-balancing loss's gradient: the loss says it is there, the weights not",
        ("tests/integration/test_training_moe.py",),
    ),
    Mutation(
        "aux-loss-not-added",
        "client/training/microbatches.py",
        "                loss += self.aux_coef * totals.loss()\n",
        "                pass  # MUTATION\n",
        "a MoE run's trainer reports the LM loss alone, not the loss it trains on",
        ("tests/integration/test_training_moe.py",),
    ),
    Mutation(
        "peer-ignores-router-grad",
        "peer/handler.py",
        "                if router_grad is not None and kept.routers.probs is not None:  # the load-balancing loss's part\n",
        "                if False:  # MUTATION\n",
        "a stage drops the load-balancing loss's part of its backward",
        ("tests/integration/test_training_moe.py",),
    ),
    Mutation(
        "checked-forward-loses-router-sums",
        "client/sequence.py",
        "                        hop_records = [await self._with_routers(r, mask, positions, routers) for r in hop_records]\n",
        "                        pass  # MUTATION\n",
        "a forward whose answer a spot check replaced leaves that hop's router sums out of the load-balancing loss",
        ("tests/client/test_moe_loss.py",),
    ),
    Mutation(
        "checked-backward-without-router-grad",
        "client/hop_checks.py",
        'other, seq._call_backward(other, hidden, grad_out, mask, positions, "", router_grad=router_grad)\n',
        'other, seq._call_backward(other, hidden, grad_out, mask, positions, "")  # MUTATION\n',
        "a spot check recomputes a backward without the router term, and the honest answer loses to the others",
        ("tests/client/test_moe_loss.py",),
    ),
    Mutation(
        "remote-blocks-drop-router-grad",
        "client/remote_blocks.py",
        "        router_grad = tuple(grad_probs.tolist()) if grad_probs is not None and bool(grad_probs.any()) else ()\n",
        "        router_grad = ()  # MUTATION\n",
        "the client's own backward leaves the load-balancing loss out of the peers' gradients",
        ("tests/client/test_moe_loss.py",),
    ),
    Mutation(
        "trainer-save-without-norm-bias",
        "client/training/cli.py",
        "        tensors = model.local_tensors()\n",
        "        tensors = {k: v for k, v in model.local_tensors().items() if not k.endswith('bias')}  # MUTATION\n",
        "a trainer's save leaves out its final LayerNorm's bias: a resumed run and the export lose what it trained",
        ("tests/integration/test_training_ends.py",),
    ),
    Mutation(
        "logit-scale-ignored",
        "swarm/models/ends.py",
        "        logits = logits * scale\n",
        "        pass  # MUTATION\n",
        "a Cohere model's logits are not scaled by logit_scale: other logits, other tokens",
        ("tests/client/test_families.py",),
    ),
    Mutation(
        "router-rows-unchecked",
        "swarm/models/routers.py",
        "    if rows_expected is not None and not math.isclose(rows, rows_expected, rel_tol=1e-9):\n",
        "    if False:  # MUTATION\n",
        "a peer that leaves out its router sums (an older one) is believed: the load-balancing loss misses its layers",
        ("tests/client/test_moe_loss.py",),
    ),
    Mutation(
        "sdpa-for-every-family",
        "swarm/models/checkpoint.py",
        '        return "sdpa" if getattr(causal_lm_class(config), "_supports_sdpa", True) else "eager"\n',
        '        return "sdpa"  # MUTATION\n',
        "a family that refuses sdpa (GPT-OSS's attention sinks) is built with it: its peers cannot load",
        ("tests/client/test_families.py",),
    ),
    Mutation(
        "overlapped-step-drops-inner-steps",
        "swarm/training/outer.py",
        "            p.copy_(anchor if before is None else anchor.double() + (p.double() - before.double()))\n",
        "            p.copy_(anchor)  # MUTATION\n",
        "an overlapped sync's outer step throws away the inner steps taken while its round ran",
        (
            "tests/swarm/training/test_outer.py",
            "tests/peer/training/test_local_steps.py",
        ),
    ),
    Mutation(
        "trainers-overlapped-sync-alone",
        "client/training/cotrainers.py",
        "        if len(trainers) == 1:\n            return deltas\n\n        async def publish(attempt: int, digest: str) -> None:\n"
        '            self._sync = {"sync_update"',
        "        if True:  # MUTATION\n            return deltas\n\n        async def publish(attempt: int, digest: str) -> None:\n"
        '            self._sync = {"sync_update"',
        "each trainer lands its own pseudo-gradients in an overlapped sync: the trainers drift apart",
        ("tests/integration/test_training.py::test_overlapped_syncs_keep_two_members_and_two_trainers_together",),
    ),
    Mutation(
        "overlapped-sync-read-from-update-fields",
        "peer/training/syncs.py",
        "            round_of=agreement.overlapped_sync if overlapped else agreement.update_round,\n",
        "            round_of=agreement.update_round,  # MUTATION\n",
        "stage members agree on an overlapped sync by their update's fields, which moved on: each takes its own outcome",
        (
            "tests/peer/training/test_sync_agreement.py::"
            "test_an_overlapped_sync_complete_at_one_member_only_is_tried_again_by_both",
        ),
    ),
    Mutation(
        "state-served-before-an-overlapped-sync-lands",
        "swarm/training/outer.py",
        '            raise RuntimeError(f"a sync lands after update {pending.lands}; ask again then")\n',
        "            pass  # MUTATION\n",
        "a joiner copies a member's state while its overlapped sync has yet to land, and misses that outer step",
        ("tests/peer/training/test_local_steps.py",),
    ),
    Mutation(
        "balancing-loss-for-every-moe",
        "swarm/models/routers.py",
        '    if not hasattr(importlib.import_module(causal_lm_class(config).__module__), "load_balancing_loss_func"):\n',
        "    if False:  # MUTATION\n",
        "DeepSeek's experts, which transformers balances without this loss, get it added anyway",
        ("tests/swarm/models/test_routers.py",),
    ),
    Mutation(
        "router-probs-of-last-layer-only",
        "swarm/models/routers.py",
        "        self.probs = probs if self.probs is None else self.probs + probs\n",
        "        self.probs = probs  # MUTATION\n",
        "a stage of several routed layers reports only its last one's routing probabilities",
        ("tests/swarm/models/test_routers.py",),
    ),
    Mutation(
        "relay-streams-per-client-uncapped",
        "swarm/net/relay.py",
        "            if self._sources.get(source, 0) >= self.max_streams_per_source:\n",
        "            if False:  # MUTATION\n",
        "one client takes every stream a relay carries to a peer",
        ("tests/swarm/net/test_tunnel.py::test_a_relay_carries_a_bounded_number_of_streams_per_client",),
    ),
    Mutation(
        "inputs-decoded-before-checks",
        "peer/served.py",
        '        declared = layout(message.hidden_states, "hidden_states")\n',
        '        declared = layout(message.hidden_states, "hidden_states")\n'
        '        decode_optional(message, "hidden_states", payload)  # MUTATION\n',
        "a request's tensors are decoded (and widened) before its shape, dtype and caps are checked",
        ("tests/peer/test_served.py",),
    ),
    Mutation(
        "replaced-rounds-held",
        "swarm/training/rounds.py",
        "        if task is not None:\n            task.cancel()\n",
        "        if task is not None:\n            pass  # MUTATION\n",
        "a round that a later attempt replaced runs on to its timeout, holding the member's next round",
        (
            "tests/swarm/training/test_rounds.py::test_a_round_a_later_attempt_replaced_ends_at_once_and_the_next_one_meets",
        ),
    ),
    Mutation(
        "proofs-unmetered",
        "peer/handler.py",
        "                if not self.proofs.take(source_of(context)):\n",
        "                if False:  # MUTATION\n",
        "a peer signs every nonce it is sent: a flood takes its CPU",
        ("tests/client/test_dialing.py::test_a_nonce_flood_from_one_address_is_refused_while_others_get_their_proof",),
    ),
    Mutation(
        "steps-never-forwarded",
        "client/session.py",
        "        if config.forward_steps == ForwardSteps.NEVER or not self.sequence.forwards(first.hop):\n",
        "        if True:  # MUTATION\n",
        "every inference step goes back through the client after each hop",
        (
            FAST_PUSHES,
            "tests/integration/test_forwarding.py::test_the_middle_peer_of_a_forwarding_route_dies_and_the_outputs_do_not_change",
        ),
    ),
    Mutation(
        "speculative-rollback-one-short",
        "client/speculative.py",
        "        sent = ids.shape[1] + new.shape[1] - 1\n",
        "        sent = ids.shape[1] + new.shape[1]  # MUTATION\n",
        "speculative decoding cuts the peers' caches back one token too few after refused drafts",
        ("tests/client/test_speculative.py",),
    ),
    Mutation(
        "speculative-accepts-every-draft",
        "client/speculative.py",
        "            kept = (tokens[:, :k] == drafts).long().cumprod(dim=1).sum(dim=1)\n",
        "            kept = torch.full((batch,), k, dtype=torch.long)  # MUTATION\n",
        "speculative decoding keeps every draft, whatever the swarm's own choice",
        ("tests/client/test_speculative.py",),
    ),
    Mutation(
        "quantized-peers-used-by-default",
        "client/sequence.py",
        "                if info.quantization == wanted and (",
        "                if True and (  # MUTATION\n",
        "a client routes through peers whose weights are rounded, computing another model than it asked for",
        ("tests/integration/test_quantized.py",),
    ),
    Mutation(
        "orphaned-update-kept",
        "peer/training/follow.py",
        "        self._orphaned_since = self._orphaned_since or now\n",
        "        self._orphaned_since = self._orphaned_since or now\n        return  # MUTATION\n",
        "an update whose trainers died between commit and Apply stays committed: the trainers left are refused for good",
        (f"{EXACT}::test_one_run_through_every_fault_and_attack_equals_local_training",),
    ),
    Mutation(
        "made-up-trainer-claims-credible",
        "client/training/cotrainers.py",
        "if ceiling is not None and p.epoch <= ceiling}",
        "if True}  # MUTATION",
        "a trainer catching up counts a stranger's record of an update no stage applied",
        (f"{EXACT}::test_one_run_through_every_fault_and_attack_equals_local_training",),
    ),
    Mutation(
        "quantized-blocks-map-checkpoint",
        "peer/blocks.py",
        "            _own_copies(layer, misaligned_only=quantization == Quantization.NONE)\n",
        "            pass  # MUTATION\n",
        "a quantized block's norms keep its checkpoint's mapping: the full-precision pages read stay resident",
        ("tests/peer/test_quantize.py::test_a_quantized_span_keeps_no_mapping_of_its_checkpoint",),
    ),
    Mutation(
        "sync-applied-without-agreement",
        "swarm/training/agreement.py",
        '            agreed = digest != "x" and all(d == digest for d in done)\n',
        '            agreed = digest != "x"  # MUTATION\n',
        "a member whose sync completed steps though another's did not: the pair stays apart for good",
        ("tests/peer/training/test_sync_agreement.py",),
    ),
    Mutation(
        "local-steps-trainers-not-agreed",
        "client/training/cotrainers.py",
        "        return agreed\n",
        "        return trainers  # MUTATION\n",
        "with local steps, each trainer commits the trainers it met: sets that differ leave every stage waiting",
        ("tests/client/training/test_cotrainers.py",),
    ),
    Mutation(
        "split-commits-waited-out",
        "client/training/update.py",
        "        self.split_seen = self.split_seen or status.split\n",
        "        self.split_seen = False  # MUTATION\n",
        "a trainer waits on stages whose commits name different trainers: no round ever starts there",
        ("tests/client/training/test_update.py",),
    ),
    Mutation(
        "logits-not-capped",
        "swarm/models/ends.py",
        "    if cap is not None:\n",
        "    if cap is None:  # MUTATION\n",
        "Gemma 2 and 3's logits are not capped by final_logit_softcapping: the client's logits are not the model's",
        ("tests/client/test_families.py",),
    ),
    Mutation(
        "one-rotary-for-every-attention-type",
        "peer/blocks.py",
        '        self._typed_rotary = "layer_type" in inspect.signature(rotary.forward).parameters\n',
        "        self._typed_rotary = False  # MUTATION\n",
        "Gemma 3's sliding layers get the full layers' rotary embedding (another base frequency)",
        ("tests/client/test_families.py",),
    ),
    Mutation(
        "adapter-head-not-tied",
        "client/training/adapters.py",
        "        ensure_weight_tying=tied and trainer is not None,\n",
        "        ensure_weight_tying=False,  # MUTATION\n",
        "an adapter folder of a model whose head is its embeddings keeps the checkpoint's head under peft",
        ("tests/client/training/test_local.py",),
    ),
    Mutation(
        "split-commits-not-reported",
        "peer/training/span.py",
        "the trainers' commits name different trainers\", True)\n",
        "the trainers' commits name different trainers\", False)  # MUTATION\n",
        "a member whose trainers' commits name different trainers waits without saying so: no trainer agrees",
        ("tests/peer/training/test_sync_agreement.py",),
    ),
    Mutation(
        "members-add-their-own-difference",
        "swarm/training/rounds.py",
        "                    local[index].copy_(output)\n",
        "                    local[index].add_(output - local[index])  # MUTATION\n",
        "each member ends with its own value plus the difference to the average, rounded its own way: digests split",
        ("tests/swarm/training/test_rounds.py::test_three_members_average_exactly_and_identically",),
    ),
    Mutation(
        "compressed-reducer-keeps-exact-part",
        "swarm/training/allreduce.py",
        "            decoded = self._decode(await self._answer(part_index, averaged))\n",
        "            decoded = averaged  # MUTATION\n",
        "a reducer of a compressed round keeps its own part exact: it ends unlike the members it answered",
        (
            "tests/swarm/training/test_rounds.py::test_float16_rounds_send_a_quarter_of_the_bytes_and_every_member_ends_identical",
        ),
    ),
    Mutation(
        "owed-inference-check-skipped",
        "client/inference_checks.py",
        "        if self.owed:\n",
        "        if False:  # MUTATION\n",
        "steps decoded while a slow check ran stay unverified when generate() returns: a liar there goes unseen",
        (
            "tests/client/test_inference_checks.py::test_steps_decoded_while_a_check_ran_are_checked_before_generate_returns",
        ),
    ),
    Mutation(
        "streamed-blocks-kept",
        "peer/offload.py",
        "        for other in [i for i in self._pending if i != index]:  # the block computed before is done with\n",
        "        for other in []:  # MUTATION\n",
        "a streaming span never lets a streamed block go: its memory grows past the budget's two slots",
        ("tests/peer/test_offload.py::test_a_streaming_span_computes_what_a_resident_one_does",),
    ),
    Mutation(
        "streamed-weights-changed-in-place",
        "peer/offload.py",
        "            setattr(owner, leaf, nn.Parameter(tensor, requires_grad=False))\n",
        "            getattr(owner, leaf).data = tensor  # MUTATION\n",
        "taking a block's weights out changes the tensors a saved graph holds: its backward computes with others",
        ("tests/peer/test_offload.py::test_a_backward_through_streamed_blocks_uses_the_weights_its_forward_used",),
    ),
    Mutation(
        "decoding-run-out-ends-its-session",
        "client/decoding.py",
        "        finally:\n            decoding.close()\n",
        "        finally:\n            decoding.close()\n            model._run(session.close())  # MUTATION\n",
        "a caller that takes every token and then settles: the last steps' check is cancelled, a liar there unseen",
        (
            "tests/client/test_inference_checks.py::test_a_lie_in_the_last_step_is_caught_by_settle_after_the_tokens_ran_out",
        ),
    ),
    Mutation(
        "unverified-inference-check-stands",
        "client/hop_checks.py",
        "        return Verdict(None)\n",
        "        return Verdict(True)  # MUTATION\n",
        "a check that no other peer could make marks the span's answers verified: they are never checked again",
        (
            "tests/client/test_inference_checks.py::test_answers_no_other_peer_can_recompute_are_never_taken_as_verified",
        ),
    ),
    Mutation(
        "stage-member-ignores-its-trainers-word",
        "peer/training/span.py",
        "        return deciding(members, self.group.peer_id, comembers=self.applied_members, applied=applied)\n",
        "        return members  # MUTATION\n",
        "members that sat one update out, outnumbering the one that took part, never catch up",
        (
            "tests/integration/test_training_exact.py::test_one_run_through_every_fault_and_attack_equals_local_training",
        ),
    ),
    Mutation(
        "stage-member-trusts-strangers-records",
        "swarm/training/state.py",
        "    trusted = {peer: p for peer, p in members.items() if peer in comembers and peer != me and p.epoch >= applied}\n",
        "    trusted = {peer: p for peer, p in members.items() if peer != me and p.epoch >= applied}  # MUTATION\n",
        "a stranger's record ahead of the group counts once the trainers' word sets the stale members aside",
        ("tests/swarm/training/test_state.py",),
    ),
    Mutation(
        "forward-over-the-caps-sent-whole",
        "client/sequence.py",
        "        if batch * length <= caps[0] and batch * length * length <= caps[1]:\n",
        "        if True:  # MUTATION\n",
        "a forward over a peer's announced caps is sent whole: every peer refuses it",
        ("tests/client/test_splitting.py",),
    ),
    Mutation(
        "prompt-over-the-caps-sent-whole",
        "client/session.py",
        "        if batch * new > caps[0] or batch * new * (self.position + new) > caps[1]:  # in steps the peers take\n",
        "        if False:  # MUTATION\n",
        "a prompt over the peers' announced caps is sent as one step: every peer refuses it",
        ("tests/client/test_splitting.py",),
    ),
    Mutation(
        "auto-rounds-more-than-it-must",
        "peer/capacity.py",
        "        if found.blocks(mode) >= wanted:\n            return mode\n",
        "        if found.blocks(mode) >= wanted:\n            return Quantization.NF4  # MUTATION\n",
        "--quantize auto takes nf4 whenever the blocks fit: peers round weights they could hold in full",
        ("tests/peer/test_capacity.py",),
    ),
    Mutation(
        "expert-cache-overflows",
        "peer/experts.py",
        "        while len(self.resident) >= self.capacity:\n",
        "        while False:  # MUTATION\n",
        "the expert cache never evicts: every expert a layer ever picked stays on the device",
        ("tests/peer/test_experts.py",),
    ),
    Mutation(
        "expert-picks-wrong-rows",
        "peer/experts.py",
        "                top_k_pos, token_idx = torch.where(mask[expert])\n",
        "                token_idx, top_k_pos = torch.where(mask[expert])  # MUTATION\n",
        "a cached expert computes the wrong tokens, weighted by the wrong router scores",
        ("tests/peer/test_experts.py",),
    ),
    Mutation(
        "expert-guess-evicts-itself",
        "peer/experts.py",
        "                if expert in self.resident:\n                    self.resident.move_to_end(expert)\n",
        "                if expert in self.resident:  # MUTATION\n",
        "a guessed expert already resident is left where LRU put it, so the guess's own loads evict it",
        ("tests/peer/test_experts.py",),
    ),
    Mutation(
        "expert-guess-half-cache",
        "peer/experts.py",
        "            for expert in experts[: self.capacity]:\n",
        "            for expert in experts[: max(1, self.capacity // 2)]:  # MUTATION\n",
        "a guess brings in half the cache at most (the policy before a trained model was measured)",
        ("tests/peer/test_experts.py",),
    ),
    Mutation(
        "expert-disk-wrong-layer",
        "peer/experts.py",
        "        state = self.store.get(self._first_key + expert)\n",
        "        state = self.store.get(expert)  # MUTATION\n",
        "an expert read from disk is the first MoE layer's expert of that number, whatever its layer",
        ("tests/peer/test_experts.py",),
    ),
    Mutation(
        "expert-guess-read-on-compute",
        "peer/experts.py",
        "        if ahead and self._reader is not None and self.store is not None:\n",
        "        if False:  # MUTATION\n",
        "a guess on disk is read on the compute thread, as it is guessed, rather than beside the compute",
        ("tests/peer/test_experts.py",),
    ),
    Mutation(
        "streamed-buffer-reused-under-grad",
        "peer/offload.py",
        "            if buffer is not None and not graded and len(self._free) < STREAM_SLOTS:\n",
        "            if buffer is not None and len(self._free) < STREAM_SLOTS:  # MUTATION\n",
        "a streamed block's read buffer is reused after a pass with grad, under the weights its graph saved",
        ("tests/peer/test_offload.py",),
    ),
    Mutation(
        "streamed-buffers-never-reused",
        "peer/offload.py",
        "                self._free.append(buffer)\n",
        "                pass  # MUTATION\n",
        "every load from disk reads into a fresh buffer (the allocator then holds more than the budget)",
        ("tests/peer/test_offload.py",),
    ),
    Mutation(
        "silent-streams-wait-the-session-timeout",
        "peer/inference.py",
        "                stream.inbox.get(), self.limits.session_timeout_s if opened else self.limits.open_timeout_s\n",
        "                stream.inbox.get(), self.limits.session_timeout_s  # MUTATION\n",
        "a stream that opens no session holds its concurrent call for the idle session's timeout (300 s)",
        ("tests/peer/test_inference.py",),
    ),
    Mutation(
        "streams-per-source-unbounded",
        "peer/inference.py",
        "        if self._streams_of[source] >= self.limits.max_streams_per_source:\n",
        "        if False:  # MUTATION\n",
        "one client address may hold every concurrent call of a peer with inference streams",
        ("tests/peer/test_inference.py",),
    ),
    Mutation(
        "throughput-key-ignores-expert-cache",
        "peer/throughput.py",
        "    if caches is not None:  # and so do experts loaded when picked\n",
        "    if False:  # MUTATION\n",
        "a peer caching experts announces the throughput measured with every expert resident",
        ("tests/peer/test_throughput.py",),
    ),
    Mutation(
        "throughput-key-ignores-experts",
        "peer/throughput.py",
        "    if experts:  # the experts' number, choice and size set an MoE block's work as much as its hidden size\n",
        "    if False:  # MUTATION\n",
        "MoE models of other expert counts share one measured throughput",
        ("tests/peer/test_throughput.py",),
    ),
    Mutation(
        "colluder-confirmed-lie-kept",
        "client/inference_checks.py",
        "            span.verified = min(span.verified, verdict.first_wrong)\n",
        "            pass  # MUTATION\n",
        "a caught liar's session rewinds only to what a colluder's check confirmed, keeping the lie before it",
        ("tests/client/test_inference_checks.py",),
    ),
    Mutation(
        "no-clock-skew-allowed",
        "protocol/records.py",
        "CLOCK_SKEW_S = 60.0\n",
        "CLOCK_SKEW_S = 0.0  # MUTATION\n",
        "writers fill the whole TTL cap: a reader whose clock is a few seconds behind refuses their records",
        ("tests/swarm/dht/test_validators.py",),
    ),
    Mutation(
        "concurrent-rpcs-unbounded",
        "peer/server.py",
        "        options=options, interceptors=server_interceptors(auth), maximum_concurrent_rpcs=cfg.max_concurrent_rpcs\n",
        "        options=options, interceptors=server_interceptors(auth)  # MUTATION\n",
        "the peer's gRPC server serves any number of calls at once: --max-concurrent-rpcs is read and not used",
        ("tests/protocol/test_refused.py",),
    ),
    Mutation(
        "int8-losses-not-fed-back",
        "swarm/training/codec.py",
        "                    self._residuals[part] = lost\n",
        "                    pass  # MUTATION\n",
        "8-bit rounds forget what each part lost: the same rounding adds up round after round",
        ("tests/swarm/training/test_codec.py", "tests/swarm/training/test_rounds.py"),
    ),
    Mutation(
        "adapter-rows-not-passed",
        "peer/adapters.py",
        '    return args, {**kwargs, "adapter_names": list(rows)}\n',
        "    return None  # MUTATION\n",
        "a peer serving adapters computes every session without its adapter",
        ("tests/peer/test_adapters.py",),
    ),
    Mutation(
        "batched-rows-lose-their-adapter",
        "peer/batching.py",
        "    per_row = [name for name, r in zip(adapters, rows) for _ in range(r)] if adapters and any(adapters) else None\n",
        "    per_row = None  # MUTATION\n",
        "a decode step batched with other sessions forgets its session's adapter",
        ("tests/peer/test_adapters.py",),
    ),
    Mutation(
        "client-routes-past-the-adapter",
        "client/sequence.py",
        "                servers = serving_adapter(servers, self.config.adapter, self.adapter_digest)\n",
        "                pass  # MUTATION\n",
        "a client that names an adapter also routes through peers that do not serve it",
        ("tests/integration/test_adapters.py",),
    ),
    Mutation(
        "sync-skips-the-outer-step",
        "peer/training/syncs.py",
        "        if averaged is not None:\n            await compute(lambda: self.outer_step(averaged))\n",
        "        if averaged is not None:\n            pass  # MUTATION\n",
        "a stage with local steps never applies the outer step: its weights drift from the run's DiLoCo reference",
        ("tests/integration/test_training.py",),
        keyword="local_steps_equal",
    ),
    Mutation(
        "split-sync-never-healed",
        "peer/training/follow.py",
        "            if not busy and not training.samples and mine is not None and claim[1] != mine:\n",
        "            if False:  # MUTATION\n",
        "members a sync failed for stay apart from the majority for good (each later sync moves each from its own)",
        ("tests/peer/training/test_local_steps.py",),
    ),
    Mutation(
        "members-vouch-for-their-local-weights",
        "swarm/training/outer.py",
        "    if outer is None:\n        return state_digest(state)\n",
        "    if True:  # MUTATION\n        return state_digest(state)\n",
        "members with local steps vouch for weights that differ between syncs: no majority, no verified copy",
        ("tests/peer/training",),
        keyword="local_steps",
    ),
)


class MutationError(Exception):
    """A mutation no longer applies: its snippet does not occur exactly once, or the result is not Python."""


def mutated_text(mutation: Mutation, text: str) -> str:
    count = text.count(mutation.find)
    if count != 1:
        first_line = mutation.find.strip().splitlines()[0]
        raise MutationError(
            f"mutation {mutation.name!r}: its snippet occurs {count} times in {mutation.path} (it must occur "
            f"exactly once); the code changed, update the snippet in tests/mutations.py. It begins: {first_line!r}"
        )
    result = text.replace(mutation.find, mutation.replace)
    try:
        if mutation.path.endswith(".py"):  # other files (the monitor's page script) are only replaced
            compile(result, mutation.path, "exec")
    except SyntaxError as exc:
        raise MutationError(f"mutation {mutation.name!r} makes {mutation.path} invalid Python: {exc}") from None
    return result


# --- the pytest plugin side: one JSON line per test phase ---


def _record(entry: dict) -> None:
    path = os.environ.get(OUTCOMES_ENV)
    if path:
        with open(path, "a") as out:
            out.write(json.dumps(entry) + "\n")


def pytest_collection_finish(session) -> None:
    _record({"collected": len(session.items)})


def pytest_collectreport(report) -> None:
    if report.failed:  # an import error in a test module
        _record({"nodeid": report.nodeid, "outcome": "failed"})


def pytest_runtest_logreport(report) -> None:
    if report.failed or report.when == "call" or report.skipped:
        _record({"nodeid": report.nodeid, "outcome": report.outcome})


# --- running pytest in the copy ---


@dataclass
class RunResult:
    returncode: int | None  # None: stopped after the time limit
    duration_s: float
    collected: int | None = None
    outcomes: dict[str, str] = field(default_factory=dict)  # node id -> passed / failed / skipped
    output: str = ""
    leftovers: list[str] = field(default_factory=list)  # processes still alive after pytest ended, killed then

    @property
    def failed(self) -> list[str]:
        return [node for node, outcome in self.outcomes.items() if outcome == "failed"]


class Runner:
    """Runs pytest in the copy, bounded in time, and kills whatever a run leaves behind."""

    def __init__(self, copy: Path, scratch: Path, timeout_s: float):
        self.copy, self.scratch, self.timeout_s = copy, scratch, timeout_s
        self.marker = uuid.uuid4().hex
        self.runs = 0

    def env(self, outcomes: Path | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(self.copy)] + [p for p in [env.get("PYTHONPATH")] if p])
        env.update(PYTHONDONTWRITEBYTECODE="1", **{MARKER_ENV: self.marker})
        if outcomes is not None:
            env[OUTCOMES_ENV] = str(outcomes)
        return env

    def check_imports(self) -> None:
        """Our packages must resolve to the copy in a fresh process started outside it (as a peer would be)."""
        code = (
            "import importlib.util, json; print(json.dumps({n: importlib.util.find_spec(n).origin "
            "for n in ('protocol', 'swarm', 'peer', 'client')}))"
        )
        out = subprocess.run(
            [sys.executable, "-c", code],
            cwd=self.scratch,
            env=self.env(),
            text=True,
            capture_output=True,
            timeout=60,
            check=True,
        ).stdout
        wrong = {
            name: origin
            for name, origin in json.loads(out).items()
            if not Path(origin).resolve().is_relative_to(self.copy.resolve())
        }
        if wrong:
            raise RuntimeError(
                f"with PYTHONPATH={self.copy} these packages still load from elsewhere: {wrong}; "
                f"a mutated copy would not be what the tests run"
            )

    def pytest(self, args: list[str], *, every_test: bool, timeout_s: float | None = None) -> RunResult:
        """Run pytest on `args` within `timeout_s` (default: the runner's); each test gets half the runner's."""
        self.runs += 1
        outcomes = self.scratch / f"outcomes-{self.runs}.jsonl"
        log = self.scratch / f"pytest-{self.runs}.log"
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "tests.mutations",
            "-p",
            "no:cacheprovider",
            f"--basetemp={self.scratch / f'basetemp-{self.runs}'}",
            "-o",
            f"timeout={int(self.timeout_s // 2)}",
        ]
        command += ([] if every_test else ["-x"]) + args
        began = time.monotonic()
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                command,
                cwd=self.copy,
                env=self.env(outcomes),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                returncode = proc.wait(timeout_s or self.timeout_s)
            except subprocess.TimeoutExpired:
                returncode = None
                self._stop(proc)
            except BaseException:  # Ctrl+C: stop the run's swarms before leaving
                self._stop(proc)
                raise
            finally:
                leftovers = self.kill_leftovers()
        result = RunResult(
            returncode, time.monotonic() - began, output=log.read_text(errors="replace"), leftovers=leftovers
        )
        if outcomes.exists():
            for line in outcomes.read_text().splitlines():
                entry = json.loads(line)
                if "collected" in entry:
                    result.collected = entry["collected"]
                elif result.outcomes.get(entry["nodeid"]) != "failed":  # a failed teardown after a passed call
                    result.outcomes[entry["nodeid"]] = entry["outcome"]
        return result

    @staticmethod
    def _stop(proc: subprocess.Popen) -> None:
        for sig, wait_s in ((signal.SIGTERM, 60), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(wait_s)
                return
            except ProcessLookupError:
                return
            except subprocess.TimeoutExpired:
                continue

    def kill_leftovers(self, grace_s: float = 5.0) -> list[str]:
        """SIGKILL, by pid, every process that inherited this run's marker and does not exit within `grace_s`
        (peers whose pytest was killed; helpers such as torch_shm_manager linger a moment by themselves)."""
        import psutil

        mine = []
        for proc in psutil.process_iter():
            try:
                if proc.pid != os.getpid() and proc.environ().get(MARKER_ENV) == self.marker:
                    mine.append(proc)
            except psutil.Error:
                continue
        _, alive = psutil.wait_procs(mine, timeout=grace_s) if mine else ([], [])
        killed = []
        for proc in alive:
            try:
                killed.append(proc.name())
                proc.kill()
            except psutil.Error:
                pass
        return killed


def copy_worktree(dest: Path) -> None:
    """Copy the files git knows of (tracked and untracked-but-not-ignored), as they are on disk now."""
    listing = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in sorted(set(filter(None, listing.split("\0")))):
        source = REPO / name
        if source.is_file():  # a tracked file deleted in the working tree is simply absent
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


# --- the check ---


@dataclass
class Verdict:
    mutation: Mutation
    result: RunResult
    caught_by: list[str] = field(default_factory=list)
    note: str = ""

    @property
    def caught(self) -> bool:
        return bool(self.caught_by)

    @property
    def summary(self) -> str:
        return "caught by " + ", ".join(_short(n) for n in self.caught_by) if self.caught else self.note


def judge(mutation: Mutation, result: RunResult) -> Verdict:
    verdict = Verdict(mutation, result, result.failed)
    if verdict.caught:
        return verdict
    if result.returncode is None:
        verdict.note = "TIMEOUT: the selection did not finish; raise --timeout-s"
    elif result.returncode == 0:
        verdict.note = "NOT CAUGHT"
    elif result.returncode in (4, 5):
        verdict.note = f"NOT CAUGHT: no test ran (pytest exit {result.returncode}: selection matches nothing)"
    else:
        verdict.note = f"ERROR: pytest exit {result.returncode} without a failed test"
    return verdict


def confirm(runner: Runner, verdicts: list[Verdict]) -> None:
    """Run every catching test once without mutations; one that fails anyway catches nothing."""
    nodes = sorted({node for v in verdicts for node in v.caught_by})
    if not nodes:
        return
    print(f"confirming that the {len(nodes)} catching tests pass without mutations ...", flush=True)
    # each test may take up to half the per-run limit (pytest-timeout), so the whole run may take that many halves
    baseline = runner.pytest(nodes, every_test=True, timeout_s=runner.timeout_s / 2 * len(nodes))
    print(
        f"    {sum(o == 'passed' for o in baseline.outcomes.values())} of {len(nodes)} passed "
        f"({baseline.duration_s:.0f} s)",
        flush=True,
    )
    for verdict in verdicts:
        if not verdict.caught:
            continue
        outcomes = {node: baseline.outcomes.get(node) for node in verdict.caught_by}
        broken = [node for node, outcome in outcomes.items() if outcome not in ("passed", None)]
        verdict.caught_by = [node for node, outcome in outcomes.items() if outcome == "passed"]
        if verdict.caught:
            continue
        if None in outcomes.values():  # the run ended (timed out) before these tests
            verdict.note = "UNCONFIRMED: the catching tests did not run without the mutation (time limit)"
        else:
            failing = ", ".join(_short(n) for n in broken)
            verdict.note = f"NOT CAUGHT: {failing} do(es) not pass without the mutation either"


def _short(node: str) -> str:
    return node.rsplit("/", 1)[-1]


def _selection(mutation: Mutation) -> str:
    text = " ".join(_short(t) if "::" in t else t for t in mutation.tests)
    return text + (f" -k {mutation.keyword!r}" if mutation.keyword else "")


def table(verdicts: list[Verdict]) -> str:
    lines = ["| mutation | breaks | tests run | result | time |", "|---|---|---|---|---|"]
    for v in verdicts:
        ran = len(v.result.outcomes)
        of = f" of {v.result.collected}" if v.result.collected is not None else ""
        cells = [v.mutation.name, v.mutation.breaks, f"{ran}{of}", v.summary, f"{v.result.duration_s:.0f} s"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def list_mutations(mutations: list[Mutation]) -> None:
    for m in mutations:
        try:
            mutated_text(m, (REPO / m.path).read_text())
            state = "applies"
        except (MutationError, OSError) as exc:
            state = f"STALE: {exc}"
        print(f"{m.name}  [{state}]\n    {m.path}: {m.breaks}\n    tests: {_selection(m)}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.mutations", description=__doc__.split("\n")[0])
    parser.add_argument("--list", action="store_true", help="list the mutations and whether they still apply")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutations")
    parser.add_argument(
        "--tests",
        nargs="+",
        metavar="TEST",
        help="run these test files or node ids instead of each mutation's own selection",
    )
    parser.add_argument("--timeout-s", type=float, default=300.0, help="limit per pytest run (default 300)")
    parser.add_argument("-x", "--exitfirst", action="store_true", help="stop at the first mutation not caught")
    parser.add_argument(
        "--every-test",
        action="store_true",
        help="run a mutation's whole selection, not only up to the first failing test",
    )
    parser.add_argument(
        "--no-confirm", action="store_true", help="do not re-run the catching tests without mutations at the end"
    )
    args = parser.parse_args(argv)
    if args.timeout_s <= 0:
        parser.error(f"--timeout-s must be positive, got {args.timeout_s}")
    known = {m.name for m in MUTATIONS}
    unknown = sorted(set(args.only or ()) - known)
    if unknown:
        parser.error(f"unknown mutation(s) {unknown}; see --list")
    return args


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mutations = [m for m in MUTATIONS if args.only is None or m.name in args.only]
    if args.list:
        list_mutations(mutations)
        return 0
    signal.signal(signal.SIGTERM, _interrupt)  # a CI timeout cleans up like Ctrl+C
    began = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="swarmlm-mutations-"))
    try:
        copy, scratch = root / "repo", root / "scratch"
        scratch.mkdir()
        copy_worktree(copy)
        originals = {m.path: (copy / m.path).read_text() for m in mutations}
        try:
            mutated = {m.name: mutated_text(m, originals[m.path]) for m in mutations}
        except MutationError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        runner = Runner(copy, scratch, args.timeout_s)
        runner.check_imports()
        print(f"{len(mutations)} mutation(s), tests run in a copy at {copy}", flush=True)
        verdicts = []
        for number, mutation in enumerate(mutations, 1):
            target = copy / mutation.path
            target.write_text(mutated[mutation.name])
            try:
                selection = list(args.tests or mutation.tests)
                if mutation.keyword and not args.tests:
                    selection += ["-k", mutation.keyword]
                verdict = judge(mutation, runner.pytest(selection, every_test=args.every_test))
            finally:
                target.write_text(originals[mutation.path])
            verdicts.append(verdict)
            print(
                f"[{number}/{len(mutations)}] {mutation.name}: {verdict.summary} ({verdict.result.duration_s:.0f} s)",
                flush=True,
            )
            if verdict.result.leftovers:
                print(f"    killed what the run left behind: {', '.join(verdict.result.leftovers)}", flush=True)
            if verdict.note.startswith(("ERROR", "TIMEOUT")):
                print("    ..." + verdict.result.output[-1500:].replace("\n", "\n    "), flush=True)
            if args.exitfirst and not verdict.caught:
                break
        if not args.no_confirm:
            confirm(runner, verdicts)
        print()
        print(table(verdicts))
        survivors = [v.mutation.name for v in verdicts if not v.caught]
        print(
            f"\n{len(verdicts) - len(survivors)} of {len(verdicts)} caught in {time.monotonic() - began:.0f} s"
            + (f"; not caught: {', '.join(survivors)}" if survivors else "")
        )
        return 1 if survivors else 0
    except KeyboardInterrupt:
        print("\ninterrupted; the copy and its processes are being removed", file=sys.stderr)
        return 130
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
