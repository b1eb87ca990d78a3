"""The KV-cache budget: reservations, waiting with a timeout, and release."""

from __future__ import annotations

import asyncio

import pytest

from peer.cache import CacheBudget
from protocol.errors import CacheFullError


def test_reserve_and_release():
    async def go():
        budget = CacheBudget(100)
        async with budget.reserve(60, timeout_s=1):
            assert budget.tokens_left == 40
            async with budget.reserve(40, timeout_s=1):
                assert budget.tokens_left == 0
        assert budget.tokens_left == 100

    asyncio.run(go())


def test_waits_for_space_then_times_out():
    async def go():
        budget = CacheBudget(100)
        async with budget.reserve(80, timeout_s=1):
            with pytest.raises(CacheFullError, match=r"after waiting 0\.2s"):
                async with budget.reserve(30, timeout_s=0.2):
                    pass
        assert budget.tokens_left == 100

    asyncio.run(go())


def test_a_waiting_session_gets_space_once_freed():
    async def go():
        budget = CacheBudget(100)
        held, release = asyncio.Event(), asyncio.Event()
        order = []

        async def holder():
            async with budget.reserve(80, timeout_s=1):
                held.set()
                await release.wait()
                order.append("released")

        async def waiter():
            async with budget.reserve(50, timeout_s=2):
                order.append("acquired")

        holding = asyncio.create_task(holder())
        await held.wait()
        waiting = asyncio.create_task(waiter())
        for _ in range(20):  # let the loop run the waiter as far as it can get: into the wait for space
            await asyncio.sleep(0)
        assert not waiting.done() and order == [] and budget.tokens_left == 20
        release.set()
        await asyncio.wait_for(asyncio.gather(holding, waiting), 2)
        assert order == ["released", "acquired"] and budget.tokens_left == 100

    asyncio.run(go())


def test_more_than_the_whole_budget_fails_at_once():
    async def go():
        with pytest.raises(CacheFullError, match="whole budget is 100"):
            async with CacheBudget(100).reserve(101, timeout_s=10):
                pass

    asyncio.run(go())


def test_budget_must_be_positive():
    with pytest.raises(ValueError, match="must be positive"):
        CacheBudget(0)


def test_one_client_address_holds_at_most_its_share():
    async def go():
        budget = CacheBudget(100, max_share=0.5)
        with pytest.raises(CacheFullError, match="quota per client address is 50"):
            async with budget.reserve(60, timeout_s=1, source="ipv4:10.0.0.1"):
                pass
        async with budget.reserve(30, timeout_s=1, source="ipv4:10.0.0.1"):
            with pytest.raises(CacheFullError, match="your address holds 30 of its quota 50"):
                async with budget.reserve(30, timeout_s=0.1, source="ipv4:10.0.0.1"):
                    pass
            async with budget.reserve(50, timeout_s=1, source="ipv4:10.0.0.2"):  # others still fit
                assert budget.tokens_left == 20
        assert budget.tokens_left == 100 and not budget.used_by

    asyncio.run(go())


def test_clients_tunneled_through_libp2p_share_one_quota():
    """Each remote libp2p identity comes from a loopback address of its own (swarm/net/tunnel.py), and identities
    are free: together they hold one quota, not one each."""

    async def go():
        budget = CacheBudget(100, max_share=0.5)
        async with budget.reserve(30, timeout_s=1, source="ipv4:127.1.2.3"):
            with pytest.raises(CacheFullError, match="tunneled through libp2p hold 30 of the quota 50 they share"):
                async with budget.reserve(30, timeout_s=0.1, source="ipv4:127.4.5.6"):
                    pass
            async with budget.reserve(20, timeout_s=1, source="ipv4:127.4.5.6"):  # within the shared quota
                # a direct client, and one on this host, count on their own
                async with budget.reserve(50, timeout_s=1, source="ipv4:10.0.0.1"):
                    with pytest.raises(CacheFullError):
                        async with budget.reserve(1, timeout_s=0.1, source="ipv4:127.0.0.1"):
                            pass
        assert budget.tokens_left == 100 and not budget.used_by

    asyncio.run(go())


def test_tokens_come_back_when_the_holder_is_cancelled_again_while_releasing():
    """A session's task cancelled, then cancelled again as it gives its tokens back (a client vanishing while
    its stream is being closed): the tokens must still come back, and a waiter must get them."""

    async def go():
        budget = CacheBudget(100)
        held = asyncio.Event()

        async def session():
            async with budget.reserve(60, timeout_s=1):
                held.set()
                await asyncio.sleep(3600)

        task = asyncio.ensure_future(session())
        await held.wait()
        async with budget._freed:  # the lock is busy: the release would have to wait for it
            task.cancel()
            await asyncio.sleep(0)
            task.cancel()
            await asyncio.sleep(0)
        with pytest.raises(asyncio.CancelledError):
            await task
        assert budget.tokens_left == 100 and not budget.used_by
        async with budget.reserve(100, timeout_s=1):
            pass

    asyncio.run(go())
