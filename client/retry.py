"""What a client does when a peer fails a request: one rule for every call of client/sequence.py and session.py.

A peer's failure is first blamed (client/checks.py `blame`): the caller's bad input, and NoPeersError (which comes
after waiting already), are raised at once. Anything else may work on other peers: the peer is reported
(`RemoteSequence.report_failure`: banned, forgotten, its channel dropped) and its blocks are routed to others, at
most `max_retries` times per request. No wait before the first retry (the failed peer is banned, others are likely
fine), then `retry_delay_s` doubling with each retry, up to 5 s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from client import checks
from client.routing import RouteHop
from protocol.errors import BadRequestError, NoPeersError, SwarmError

MAX_BACKOFF_S = 5.0

Report = Callable[[RouteHop, BaseException], Awaitable[None]]
"""Bans a failed hop's peer and re-routes around it (RemoteSequence.report_failure)."""


def is_retriable(error: BaseException) -> bool:
    """Bad input is the caller's to fix, and NoPeersError comes after waiting already; the rest may work elsewhere.

    Decide on what `checks.blame` made of a peer's error: a peer's own bad_request means nothing here.
    """
    return isinstance(error, SwarmError) and not isinstance(error, (BadRequestError, NoPeersError))


def describe(hop: RouteHop) -> str:
    """A hop's peer, as error messages name it."""
    return f"{hop.peer_id} at {hop.endpoint}"


def backoff_s(retry: int, retry_delay_s: float) -> float:
    """The wait before retry number `retry` (1 for the first): none, then `retry_delay_s` doubling up to 5 s."""
    return 0.0 if retry <= 1 else min(retry_delay_s * 2 ** (retry - 2), MAX_BACKOFF_S)


async def blame(exc: BaseException, hop: RouteHop, report: Report, *, training: bool = False) -> BaseException:
    """What `hop`'s failure `exc` means (`checks.blame`); a peer that is at fault for it is reported at once.

    For a try that fails as a whole (opening a route, replaying into it, a spot check's own call): whether to try
    again is its caller's decision (`Attempts.failed` without a hop), but the peer is banned whatever comes next.
    """
    error = checks.blame(exc, describe(hop), training=training)
    if is_retriable(error):
        await report(hop, error)
    return error


class Attempts:
    """The tries of one request, and the route changes it has left after peer failures.

    An attempt is one try of a route: it fails when a peer fails (or when opening or replaying into a route does,
    for the sites that retry a whole `blame`d try). `count` is the retries granted so far; the failure that finds it
    at `max_retries` is raised, so a request makes at most `max_retries + 1` tries. A forward counts every failed hop
    of all its routes; an inference step counts its failed hops and its failed re-routes together; a backward hop
    starts from its depth of re-routing (each re-routed hop's backward counts from one more; the forward that
    re-runs its blocks counts afresh), and opening a session's first route counts its tries. Usage:

        error = await attempts.failed(exc, hop)
        if error is not None:
            raise error from exc
        await attempts.backoff()  # then try again on another route
    """

    def __init__(self, *, max_retries: int, retry_delay_s: float, report: Report, count: int = 0):
        self.max_retries, self.retry_delay_s, self.report = max_retries, retry_delay_s, report
        self.count = count

    async def failed(
        self, exc: BaseException, hop: RouteHop | None = None, *, training: bool = False, report: bool = True
    ) -> BaseException | None:
        """A try failed with `exc`: the error to raise, or None when the request may try again (after `backoff()`).

        With `hop`, `exc` is that peer's failure: it is blamed, and when retried the peer is reported, unless
        `report` is False (a peer not at fault). Without, `exc` was blamed and reported where it happened (`blame`).
        """
        error = exc if hop is None else checks.blame(exc, describe(hop), training=training)
        if not is_retriable(error) or self.count >= self.max_retries:
            return error
        if hop is not None and report:
            await self.report(hop, error)
        self.count += 1
        return None

    async def backoff(self) -> None:
        """Wait before the retry that `failed` just granted: nothing before the first, then exponential."""
        if self.count > 1:
            await asyncio.sleep(backoff_s(self.count, self.retry_delay_s))
