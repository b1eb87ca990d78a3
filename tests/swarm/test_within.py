"""`swarm.runtime.within`: a timeout that never loses a cancellation (asyncio.wait_for before 3.12 can)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from swarm.runtime import within


async def _cancelled_as_it_finishes(wait) -> str:
    """Cancel a task in the loop iteration in which what it awaits gets its result; how the task ended."""
    done = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(wait(done, 10.0))
    await asyncio.sleep(0)  # the task now waits on `done`
    done.set_result("answer")
    task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        return "cancelled"


def test_a_cancel_that_meets_the_result_is_kept():
    assert asyncio.run(_cancelled_as_it_finishes(within)) == "cancelled"


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="wait_for keeps the cancel from Python 3.12 on")
def test_wait_for_loses_it_here_which_is_why_within_exists():
    assert asyncio.run(_cancelled_as_it_finishes(asyncio.wait_for)) == "answer"


def test_results_and_timeouts_are_as_wait_fors():
    async def main():
        assert await within(asyncio.sleep(0, result=7), 1.0) == 7
        with pytest.raises(asyncio.TimeoutError):
            await within(asyncio.sleep(5), 0.05)

    asyncio.run(main())
