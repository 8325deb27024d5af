"""The work queue: dedup, one key in flight at a time, scheduled adds, backoff, shutdown."""

from __future__ import annotations

import asyncio

import pytest
from vllm_dp_operator.controller.workqueue import ShutDown, WorkQueue


async def test_a_burst_of_adds_queues_a_key_once() -> None:
    q: WorkQueue[str] = WorkQueue()
    for _ in range(100):
        q.add("a")
    q.add("b")
    assert len(q) == 2
    assert await q.get() == "a"
    assert await q.get() == "b"
    assert len(q) == 0


async def test_urgent_keys_are_handed_out_first() -> None:
    q: WorkQueue[str] = WorkQueue()
    for key in ("a", "b", "c"):
        q.add(key)
    q.add("new1", urgent=True)
    q.add("b", urgent=True)  # already waiting: promoted
    q.add("new2", urgent=True)
    got = [await q.get() for _ in range(5)]
    assert got == ["new1", "b", "new2", "a", "c"]
    assert len(q) == 0


async def test_an_urgent_key_wakes_a_waiting_worker() -> None:
    q: WorkQueue[str] = WorkQueue()
    waiting = asyncio.create_task(q.get())
    await asyncio.sleep(0)
    q.add("new", urgent=True)
    assert await asyncio.wait_for(waiting, timeout=1) == "new"


async def test_add_while_in_flight_requeues_once_after_done() -> None:
    q: WorkQueue[str] = WorkQueue()
    q.add("a")
    key = await q.get()
    for _ in range(10):
        q.add(key)  # events during the reconcile
    assert len(q) == 0, "never handed to a second worker while in flight"
    q.done(key)
    assert len(q) == 1
    assert await q.get() == "a"
    q.done("a")
    assert len(q) == 0


async def test_idle_is_set_only_with_nothing_queued_or_in_flight() -> None:
    q: WorkQueue[str] = WorkQueue()
    assert q.idle.is_set()
    q.add("a")
    assert not q.idle.is_set()
    key = await q.get()
    assert not q.idle.is_set()
    q.done(key)
    assert q.idle.is_set()
    q.add_after("b", 30)
    assert q.idle.is_set(), "a scheduled add is not work yet"


async def test_add_after_keeps_the_earliest_deadline() -> None:
    q: WorkQueue[str] = WorkQueue()
    q.add_after("a", 30)
    q.add_after("a", 0.05)
    q.add_after("a", 60)
    due = q.due_in("a")
    assert due is not None and due <= 0.05
    assert await asyncio.wait_for(q.get(), timeout=1) == "a"
    assert q.scheduled == 0


async def test_scheduled_key_is_not_handed_out_early() -> None:
    q: WorkQueue[str] = WorkQueue()
    q.add_after("a", 0.3)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(q.get(), timeout=0.1)
    assert await asyncio.wait_for(q.get(), timeout=1) == "a"


async def test_rate_limited_backoff_doubles_caps_and_resets() -> None:
    q: WorkQueue[str] = WorkQueue(backoff_base=1, backoff_cap=5)
    assert [q.add_rate_limited("a") for _ in range(5)] == [1, 2, 4, 5, 5]
    q.forget("a")
    assert q.add_rate_limited("a") == 1
    q.drop("a")
    assert q.scheduled == 0


async def test_drop_cancels_a_scheduled_add() -> None:
    q: WorkQueue[str] = WorkQueue()
    q.add_after("a", 0.05)
    q.drop("a")
    await asyncio.sleep(0.1)
    assert len(q) == 0


async def test_shutdown_wakes_waiting_workers() -> None:
    q: WorkQueue[str] = WorkQueue()
    waiting = [asyncio.create_task(q.get()) for _ in range(3)]
    await asyncio.sleep(0)
    q.shutdown(workers=3)
    for task in waiting:
        with pytest.raises(ShutDown):
            await task
    q.add("late")
    assert len(q) == 0
