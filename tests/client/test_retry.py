"""Retries after peer failures (client/retry.py): the rule, and how each request of sequence.py and session.py counts.

The call sites run on a RemoteSequence without a DHT whose routes and peer calls are replaced by fakes; the waits
between tries are recorded instead of slept.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import torch

from client import retry
from client.config import ClientConfig
from client.retry import Attempts, backoff_s, blame, is_retriable
from client.routing import RouteHop
from client.sequence import HopRecord, RemoteSequence, TrainingTag
from client.session import InferenceSession, SpanSession, _HopFailed
from protocol.errors import (
    BadRequestError,
    NoPeersError,
    PeerFaultError,
    PeerUnavailableError,
    SessionExpiredError,
    StaleEpochError,
)

HIDDEN = 8
HOP = RouteHop("a", 0, 4, "127.0.0.1:1")


@pytest.fixture
def waits(monkeypatch) -> list[float]:
    """The back-offs awaited, in order (not slept)."""
    waited: list[float] = []

    async def sleep(seconds: float) -> None:
        waited.append(seconds)

    monkeypatch.setattr(retry, "asyncio", SimpleNamespace(sleep=sleep))
    return waited


class Reports:
    def __init__(self):
        self.failures: list[tuple[str, BaseException]] = []

    async def __call__(self, hop: RouteHop, error: BaseException) -> None:
        self.failures.append((hop.peer_id, error))


def _run_failures(attempts: Attempts, errors: list[BaseException], **kwargs) -> BaseException:
    """Feed `errors` to `attempts` as failed tries of HOP, backing off between them, up to the one raised."""

    async def go():
        for exc in errors:
            error = await attempts.failed(exc, HOP, **kwargs)
            if error is not None:
                return error
            await attempts.backoff()
        raise AssertionError("every failure was retried")

    return asyncio.run(go())


def test_back_off_is_none_before_the_first_retry_then_doubles_up_to_five_seconds():
    assert [backoff_s(retry, 0.5) for retry in range(1, 9)] == [0.0, 0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0]
    assert [backoff_s(retry, 0.0) for retry in range(1, 4)] == [0.0, 0.0, 0.0]


def test_a_request_retries_max_retries_times_reporting_each_retried_peer(waits):
    reports = Reports()
    attempts = Attempts(max_retries=3, retry_delay_s=0.5, report=reports)
    failures = [PeerUnavailableError(f"gone {i}") for i in range(5)]
    raised = _run_failures(attempts, failures)
    assert raised is failures[3], "the failure after max_retries retries is raised"
    assert [error for _, error in reports.failures] == failures[:3], "the raised failure is not reported"
    assert attempts.count == 3 and waits == [0.5, 1.0]


def test_what_a_peer_cannot_fix_is_raised_at_once(waits):
    reports = Reports()
    for error in (BadRequestError("caller's"), NoPeersError("none"), RuntimeError("a bug of ours")):
        attempts = Attempts(max_retries=3, retry_delay_s=0.5, report=reports)
        assert asyncio.run(attempts.failed(error)) is error
        assert attempts.count == 0
    assert reports.failures == [] and waits == []
    assert not is_retriable(RuntimeError()) and is_retriable(PeerFaultError())


def test_a_peers_error_is_blamed_before_deciding(waits):
    reports = Reports()
    attempts = Attempts(max_retries=3, retry_delay_s=0.5, report=reports)
    refused = BadRequestError("bad shape")  # from the peer: the input passed the client's checks
    assert asyncio.run(attempts.failed(refused, HOP)) is None
    ((peer, error),) = reports.failures
    assert peer == "a" and isinstance(error, PeerFaultError) and error.__cause__ is refused
    stale = StaleEpochError("the stage updated")
    assert asyncio.run(attempts.failed(stale, HOP, training=True)) is stale, "a stale training step is the caller's"
    assert asyncio.run(attempts.failed(stale, HOP)) is None, "outside training it is the peer's"


def test_a_peer_not_at_fault_is_retried_unreported(waits):
    reports = Reports()
    attempts = Attempts(max_retries=3, retry_delay_s=0.5, report=reports)
    assert asyncio.run(attempts.failed(SessionExpiredError("lifetime"), HOP, report=False)) is None
    assert reports.failures == [] and attempts.count == 1


def test_blame_reports_a_peer_at_fault_whatever_its_caller_decides():
    reports = Reports()
    gone = PeerUnavailableError("gone")
    assert asyncio.run(blame(gone, HOP, reports)) is gone and reports.failures == [("a", gone)]
    bug = RuntimeError("ours")
    assert asyncio.run(blame(bug, HOP, reports)) is bug and len(reports.failures) == 1
    refused = asyncio.run(blame(BadRequestError("bad"), HOP, reports))
    assert isinstance(refused, PeerFaultError) and reports.failures[-1] == ("a", refused)


# --- the call sites ---


def _sequence(max_retries: int, retry_delay_s: float = 0.5) -> RemoteSequence:
    config = ClientConfig(
        initial_peers=("/ip4/127.0.0.1/tcp/1",),
        max_retries=max_retries,
        retry_delay_s=retry_delay_s,
        verify_fraction=0.0,
        forward_steps=False,
    )
    return RemoteSequence(None, "model", 4, config, hidden_size=HIDDEN)


class Routes:
    """A fresh peer for each route planned, and the `refresh` of each plan."""

    def __init__(self):
        self.refreshes: list[bool] = []

    async def plan(
        self, start: int, end: int, *, inference: bool, min_cache_tokens: int = 0, refresh: bool = False, avoid=()
    ):
        self.refreshes.append(refresh)
        peer = f"p{len(self.refreshes)}"
        return [RouteHop(peer, start, end, f"{peer}:1")]


def _hidden(tokens: int = 2) -> torch.Tensor:
    return torch.randn(1, tokens, HIDDEN)


def test_a_forward_counts_every_failed_hop_and_raises_the_last(waits):
    sequence, routes, tried = _sequence(max_retries=5, retry_delay_s=2.0), Routes(), []
    sequence.plan = routes.plan

    async def call_forward(hop, hidden, mask, positions, backward_id, routers=None):
        tried.append(hop.peer_id)
        raise PeerUnavailableError(f"{hop.peer_id} is gone")

    sequence._call_forward = call_forward
    with pytest.raises(PeerUnavailableError, match="p6 is gone"):
        asyncio.run(sequence.forward(_hidden(), None, None))
    assert tried == ["p1", "p2", "p3", "p4", "p5", "p6"]
    assert routes.refreshes == [False] + [True] * 5, "a retry reads the directory afresh"
    assert waits == [2.0, 4.0, 5.0, 5.0]
    assert sequence.failovers == 5 and sequence.bans.banned() == {"p1", "p2", "p3", "p4", "p5"}


def test_a_forward_goes_on_after_a_failure_and_a_bug_is_raised_unreported(waits):
    sequence, routes = _sequence(max_retries=2), Routes()
    sequence.plan = routes.plan
    outputs = _hidden()

    async def call_forward(hop, hidden, mask, positions, backward_id, routers=None):
        if hop.peer_id == "p1":
            raise PeerUnavailableError("gone")
        return outputs

    sequence._call_forward = call_forward
    output, records = asyncio.run(sequence.forward(_hidden(), None, None))
    assert output is outputs and [record.hop.peer_id for record in records] == ["p2"]
    assert sequence.failovers == 1 and waits == []

    async def broken(hop, hidden, mask, positions, backward_id, routers=None):
        raise RuntimeError("a bug of ours")

    sequence._call_forward = broken
    with pytest.raises(RuntimeError):
        asyncio.run(sequence.forward(_hidden(), None, None))
    assert sequence.failovers == 1


def test_a_backward_hop_counts_from_its_depth_of_re_routing(waits):
    sequence, routes, tried = _sequence(max_retries=2), Routes(), []
    sequence.plan = routes.plan

    async def call_forward(hop, hidden, mask, positions, backward_id, routers=None):
        return hidden

    async def call_backward(hop, inputs, grad, mask, positions, backward_id, training=None, router_grad=()):
        tried.append(hop.peer_id)
        raise PeerUnavailableError(f"{hop.peer_id} is gone")

    sequence._call_forward, sequence._call_backward = call_forward, call_backward
    records = [HopRecord(RouteHop("a", 0, 2, "a:1"), _hidden()), HopRecord(RouteHop("b", 2, 4, "b:1"), _hidden())]
    with pytest.raises(PeerUnavailableError, match="p2 is gone"):
        asyncio.run(sequence.backward(_hidden(), records, None, None))
    # b at depth 0, its blocks re-run on p1 (depth 1), then on p2 (depth 2 = max_retries): raised
    assert tried == ["b", "p1", "p2"] and waits == [0.5] and sequence.failovers == 2

    tag = TrainingTag("run", {})

    async def stale(hop, inputs, grad, mask, positions, backward_id, training=None, router_grad=()):
        raise StaleEpochError("the stage updated")

    sequence._call_backward = stale
    with pytest.raises(StaleEpochError):
        asyncio.run(sequence.backward(_hidden(), records, None, None, training=tag))
    assert sequence.failovers == 2


def test_opening_a_sessions_first_route_bans_every_peer_that_failed_it(waits):
    sequence, routes, opened = _sequence(max_retries=2), Routes(), []
    sequence.plan = routes.plan
    session = InferenceSession(sequence, max_length=8, batch_size=1)

    async def open_span(hop):
        opened.append(hop.peer_id)
        raise PeerUnavailableError(f"{hop.peer_id} is gone")

    session._open = open_span
    with pytest.raises(PeerUnavailableError, match="p3 is gone"):
        asyncio.run(session.step(_hidden(1), None, torch.arange(1)[None]))
    assert opened == ["p1", "p2", "p3"] and routes.refreshes == [False, True, True]
    assert waits == [0.5]
    assert sequence.failovers == 3, "a peer that failed to open is banned even when the session gives up"


class Stream:
    async def close(self) -> None:
        pass


def _session(max_retries: int, sends: list, replaces: list) -> InferenceSession:
    """A session on one span whose sends fail while `sends` says False, and replacements while `replaces` does."""
    sequence = _sequence(max_retries)
    session = InferenceSession(sequence, max_length=8, batch_size=1)
    session.spans = [SpanSession(RouteHop("a", 0, 4, "a:1"), Stream(), "s0")]
    session.sent, session.replaced = 0, 0

    async def send_chain(chain, hidden, mask, positions, prefix_length):
        session.sent += 1
        if not sends.pop(0):
            raise _HopFailed(0, PeerUnavailableError(f"{chain[0].hop.peer_id} is gone"), [])
        chain[0].position = prefix_length + hidden.shape[1]
        return [hidden]

    async def replace_span(index):
        session.replaced += 1
        if not replaces.pop(0):
            raise PeerUnavailableError(f"replacement {session.replaced} is gone")
        peer = f"r{session.replaced}"
        session.spans[index] = SpanSession(RouteHop(peer, 0, 4, f"{peer}:1"), Stream(), peer, session.position)

    session._send_chain, session._replace = send_chain, replace_span
    return session


def test_a_step_counts_its_failed_hop_and_its_failed_re_routes_together(waits):
    session = _session(max_retries=3, sends=[False], replaces=[False, False, False])
    with pytest.raises(PeerUnavailableError, match="replacement 3 is gone"):
        asyncio.run(session.step(_hidden(1), None, torch.arange(1)[None]))
    assert (session.sent, session.replaced) == (1, 3) and waits == [0.5, 1.0]
    assert session.sequence.failovers == 1  # the hop; a replacement's failure is reported where it happened

    session = _session(max_retries=2, sends=[False, False, False], replaces=[True, True])
    with pytest.raises(PeerUnavailableError, match="r2 is gone"):
        asyncio.run(session.step(_hidden(1), None, torch.arange(1)[None]))
    assert (session.sent, session.replaced) == (3, 2) and waits[2:] == [0.5]
    assert session.sequence.failovers == 2

    session = _session(max_retries=2, sends=[False, True], replaces=[True])
    asyncio.run(session.step(_hidden(1), None, torch.arange(1)[None]))
    assert session.position == 1 and session.spans[0].hop.peer_id == "r1"


def test_a_session_that_reached_its_lifetime_is_reopened_without_a_ban(waits):
    session = _session(max_retries=2, sends=[False, True], replaces=[True])
    session.spans[0].opened_at = time.monotonic() - session.sequence.config.min_session_lifetime_s

    async def send_chain(chain, hidden, mask, positions, prefix_length):
        if chain[0].hop.peer_id == "a":
            raise _HopFailed(0, SessionExpiredError("lifetime"), [])
        chain[0].position = prefix_length + hidden.shape[1]
        return [hidden]

    session._send_chain = send_chain
    asyncio.run(session.step(_hidden(1), None, torch.arange(1)[None]))
    assert session.replaced == 1 and session.sequence.failovers == 0 and not session.sequence.bans.banned()
