"""Renewals on the election's own thread: a busy controller loop never costs the Lease.

Short timings (lease 0.6 s, renew deadline 0.4 s, retry 0.05 s) on the real clock; the
controller's loop is blocked by a CPU-bound computation that holds it for twice the renew
deadline, as a burst of reconciles and LIST parsing did at 10,000 resources.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from typing import Any

from test_lease import FakeLeases
from vllm_dp_operator.controller.lease import ElectionConfig, LeaderElector
from vllm_dp_operator.controller.lease_thread import ElectionThread

CFG = ElectionConfig("ops", "vdp", "a", lease_duration=0.6, renew_deadline=0.4,
                     retry_period=0.05)  # fmt: skip
BLOCK = 2 * CFG.renew_deadline


class TimedLeases(FakeLeases):
    """The Lease API double, noting when each renewal was written (monotonic)."""

    def __init__(self) -> None:
        super().__init__()
        self.written_at: list[float] = []
        self.hang = False

    def _bump(self, body: dict[str, Any]) -> dict[str, Any]:
        self.written_at.append(time.monotonic())
        return super()._bump(body)

    async def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        if self.hang:
            await asyncio.Event().wait()  # a request that never answers
        return await super().get(namespace, name)


def _busy(seconds: float) -> None:
    """Hold the calling thread's loop with CPU work, never yielding to it."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(range(1000))


def _largest_gap(times: list[float], start: float, end: float) -> float:
    inside = [start, *(t for t in times if start <= t <= end), end]
    return max(b - a for a, b in itertools.pairwise(inside))


async def _leading(elector: LeaderElector, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not elector.may_write():
        assert time.monotonic() < deadline, "never led"
        await asyncio.sleep(0.01)


async def test_on_the_controller_loop_a_busy_loop_loses_the_lease() -> None:
    """Why the thread: the same elector as a task of a loop held for 0.8 s stops leading."""
    api = TimedLeases()
    elector = LeaderElector(api, CFG)
    stopped = asyncio.Event()
    task = asyncio.create_task(elector.run(lambda: None, stopped.set))
    await _leading(elector)
    _busy(BLOCK)
    await asyncio.wait_for(stopped.wait(), 1)
    assert not elector.may_write()
    await task


async def test_on_its_own_thread_a_busy_loop_keeps_the_lease() -> None:
    api = TimedLeases()
    elector = LeaderElector(api, CFG)
    started, stopped = asyncio.Event(), threading.Event()
    election = ElectionThread(elector)
    election.start(started.set, stopped.set)
    try:
        await asyncio.wait_for(started.wait(), 2)  # on_started ran on this loop
        assert threading.current_thread() is threading.main_thread()
        begin = time.monotonic()
        gate_open_throughout = True
        end = begin + BLOCK
        while time.monotonic() < end:  # the controller's loop, held: it checks only the gate
            _busy(0.05)
            gate_open_throughout &= elector.may_write()
        assert not stopped.is_set(), "the Lease was lost while the controller's loop was busy"
        assert gate_open_throughout
        gap = _largest_gap(api.written_at, begin, end)
        # Renewed meanwhile: never a renew deadline without one (every retry period, when
        # the machine's cores are not busy elsewhere).
        assert gap < CFG.renew_deadline, f"{gap:.3f} s without a renewal"
    finally:
        await election.stop(release=True)
    assert not elector.may_write() and api.holder == ""  # released on stop


async def test_on_its_own_thread_the_gate_closes_at_the_renew_deadline_when_renewals_fail(
) -> None:  # fmt: skip
    api = TimedLeases()
    elector = LeaderElector(api, CFG)
    started, stopped = asyncio.Event(), threading.Event()
    election = ElectionThread(elector)
    election.start(started.set, stopped.set)
    try:
        await asyncio.wait_for(started.wait(), 2)
        api.hang = True  # every renewal from now on hangs
        await asyncio.sleep(0.02)  # one already past its read lands meanwhile
        last = api.written_at[-1]
        while elector.may_write():
            await asyncio.sleep(0.005)
        closed = time.monotonic()
        # Closed by the clock, counted from when the last good renewal was sent (just before
        # its write), and no later than the deadline plus a scheduling slice.
        assert last - CFG.retry_period < closed - CFG.renew_deadline <= last + 0.05
        assert await asyncio.to_thread(stopped.wait, 2), "the loss was never reported"
        assert not elector.may_write()
    finally:
        await election.stop(release=False)
