"""The pure steps of an update (reconcile/update.py): every transition of a Surge, Recreate,
and changes that need no new engines."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from vllm_dp_operator.constants import DRAIN_QUIET_SECONDS
from vllm_dp_operator.reconcile.update import (
    DRAINING,
    STARTING,
    Decision,
    Draining,
    Generation,
    Mode,
    Wanted,
    decide,
    switched,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def want(strategy: str = "Surge", shape: str = "aaaa1111", plan: str = "p1",
         **over: Any) -> Wanted:  # fmt: skip
    """The spec's wish: a plan `plan` on a shape; the job hash is plan@cluster."""
    fields: dict[str, Any] = dict(
        strategy=strategy, shape=shape, cluster=f"demo-{shape[:5]}",
        surge_cluster=f"demo-s{plan}", job_hash=lambda cl: f"{plan}@{cl}",
        deadline_seconds=600, drain_seconds=30,
    )  # fmt: skip
    fields.update(over)
    return Wanted(**fields)


OLD = Generation("demo-aaaa1", "aaaa1111", "p1@demo-aaaa1")


def step(w: Wanted, serving: Generation | None = OLD, record: dict[str, Any] | None = None,
         failed: str | None = None, now: datetime = T0,
         live: dict[str, str] | None = None) -> Decision:  # fmt: skip
    shapes = live if live is not None else {OLD.cluster: OLD.shape}
    return decide(w, serving, shapes, record, failed, now)


def test_no_change_converges_the_serving_cluster_and_starts_nothing() -> None:
    for strategy in ("Recreate", "Surge"):
        d = step(want(strategy))
        assert (d.mode, d.cluster, d.record, d.delete) == (Mode.CONVERGE, OLD.cluster, None, [])
        assert d.events == []


def test_surge_engine_change_starts_a_second_cluster_of_the_same_shape() -> None:
    d = step(want(plan="p2"))
    assert d.mode is Mode.CANDIDATE
    assert d.cluster == "demo-sp2" and d.keep == {OLD.cluster}
    assert d.record is not None
    assert d.record["phase"] == STARTING
    assert (d.record["from"], d.record["to"]) == (OLD.cluster, "demo-sp2")
    assert d.record["target"] == "p2@demo-sp2"
    assert d.record["startedAt"] == "2026-01-01T00:00:00Z"
    assert d.record["deadline"] == "2026-01-01T00:10:00Z"
    assert [r for _, r, _ in d.events] == ["UpdateStarted"]
    assert d.recheck == 601


def test_surge_shape_change_uses_the_rendered_name() -> None:
    d = step(want(shape="bbbb2222"))
    assert (d.mode, d.cluster) == (Mode.CANDIDATE, "demo-bbbb2")


def test_surge_in_progress_keeps_its_record_until_the_deadline() -> None:
    first = step(want(plan="p2"))
    later = step(want(plan="p2"), record=first.record, now=T0 + timedelta(seconds=300))
    assert later.mode is Mode.CANDIDATE and later.record == first.record
    assert later.events == []
    assert later.recheck == 301


def test_new_generation_serving_switches_to_draining() -> None:
    record = step(want(plan="p2")).record
    assert record is not None
    drained = switched(record, T0 + timedelta(seconds=60))
    assert drained["phase"] == DRAINING and drained["deadline"] is None
    assert drained["drainingSince"] == "2026-01-01T00:01:00Z"


#: A Surge to plan p2 that switched at T0: its new generation, and its record.
SWITCHED_TO = Generation("demo-sp2", "aaaa1111", "p2@demo-sp2")


def draining_at(seconds: int, old: Draining) -> Decision:
    """The decision `seconds` after the switch to SWITCHED_TO, the old generation as `old`."""
    record = switched(step(want(plan="p2")).record or {}, T0)
    live = {OLD.cluster: OLD.shape, SWITCHED_TO.cluster: SWITCHED_TO.shape}
    return decide(want(plan="p2"), SWITCHED_TO, live, record, None,
                  T0 + timedelta(seconds=seconds), old_state=old)  # fmt: skip


def test_drain_keeps_both_then_stops_the_old_head_job_then_deletes_the_old_cluster() -> None:
    record = switched(step(want(plan="p2")).record or {}, T0)
    new, at = SWITCHED_TO, draining_at

    during = at(10, Draining(running=3, jobs_left=True))
    assert during.mode is Mode.CONVERGE and during.cluster == new.cluster
    assert during.keep == {OLD.cluster, new.cluster} and during.delete == []
    assert during.record == record and during.recheck == 21 and during.stop is None
    assert "3 request(s) running" in (during.updated or ("", "", ""))[2]
    # Its engines report no request (a read after the switch): its head job stops first.
    stopping = at(12, Draining(running=0, jobs_left=True))
    assert stopping.stop == OLD.cluster and stopping.delete == []
    assert stopping.keep == {OLD.cluster, new.cluster} and stopping.record == record
    done = at(14, Draining(running=None, jobs_left=False))
    assert done.delete == [(OLD.cluster, "drained after the switch, its head job stopped")]
    assert done.record is None and done.mode is Mode.CONVERGE
    assert [r for _, r, _ in done.events] == ["UpdateDone"]
    # Requests that never end: the drain time bounds it, then the stop.
    assert at(30, Draining(running=5, jobs_left=True)).stop == OLD.cluster


def test_a_drain_waits_until_no_client_request_came_for_a_while() -> None:
    """Kept-alive connections stay on the old head after the switch: its drain gate closes
    each after its next answer, and says how long no client request came. No request running
    is not enough while requests still come (a moment between two of them)."""
    at = draining_at

    between = at(5, Draining(running=0, jobs_left=True, idle=0.4))
    assert between.stop is None
    assert "the last request 0.4s ago" in (between.updated or ("", "", ""))[2]
    quiet = at(8, Draining(running=0, jobs_left=True, idle=DRAIN_QUIET_SECONDS))
    assert quiet.stop == OLD.cluster
    assert "no request came for 3s" in (quiet.updated or ("", "", ""))[2]
    # Quiet, but one still runs: it finishes first.
    assert at(8, Draining(running=1, jobs_left=True, idle=10.0)).stop is None
    # Clients that never stop sending on the old head: the drain time bounds it.
    assert at(30, Draining(running=0, jobs_left=True, idle=0.1)).stop == OLD.cluster


def test_deadline_deletes_the_new_generation_and_remembers_its_target() -> None:
    record = step(want(plan="p2")).record
    d = step(want(plan="p2"), record=record, now=T0 + timedelta(seconds=600))
    assert d.mode is Mode.HOLD and d.cluster == OLD.cluster
    assert d.delete == [("demo-sp2", "its update did not serve by its deadline")]
    assert d.record is None and d.failed == "p2@demo-sp2"
    [(kind, reason, message)] = d.events
    assert (kind, reason) == ("Warning", "UpdateFailed")
    assert "spec.launch.timeoutSeconds (600s)" in message and "2026-01-01T00:10:00Z" in message
    assert d.updated is not None and d.updated[:2] == (False, "UpdateFailed")


def test_a_failed_target_is_not_retried_until_the_spec_changes() -> None:
    again = step(want(plan="p2"), failed="p2@demo-sp2", now=T0 + timedelta(hours=5))
    assert again.mode is Mode.HOLD and again.record is None and again.delete == []
    assert again.events == [] and again.failed == "p2@demo-sp2"
    other = step(want(plan="p3"), failed="p2@demo-sp2")
    assert other.mode is Mode.CANDIDATE and other.cluster == "demo-sp3"


def test_reverting_to_what_serves_withdraws_the_update() -> None:
    record = step(want(plan="p2")).record
    d = step(want(plan="p1"), record=record, failed="p2@demo-sp2")
    assert d.mode is Mode.CONVERGE and d.cluster == OLD.cluster and d.record is None
    assert d.delete == [("demo-sp2", "the spec asks again for what already serves")]
    assert d.failed is None


def test_a_second_change_during_starting_supersedes_the_first() -> None:
    record = step(want(plan="p2")).record
    d = step(want(plan="p3"), record=record, now=T0 + timedelta(seconds=100))
    assert d.mode is Mode.CANDIDATE and d.cluster == "demo-sp3"
    assert d.delete == [("demo-sp2", "a newer spec change superseded its update")]
    assert d.record is not None and d.record["startedAt"] == "2026-01-01T00:01:40Z"


def test_a_second_change_on_the_same_new_cluster_restarts_its_deadline() -> None:
    record = step(want(shape="bbbb2222")).record
    d = step(want(shape="bbbb2222", plan="p3"), record=record, now=T0 + timedelta(seconds=100))
    assert d.mode is Mode.CANDIDATE and d.cluster == "demo-bbbb2" and d.delete == []
    assert d.record is not None and d.record["target"] == "p3@demo-bbbb2"
    assert d.record["startedAt"] == "2026-01-01T00:01:40Z"


def test_a_change_during_the_drain_waits_for_it() -> None:
    record = switched(step(want(plan="p2")).record or {}, T0)
    new = Generation("demo-sp2", "aaaa1111", "p2@demo-sp2")
    d = step(want(plan="p3"), new, record, now=T0 + timedelta(seconds=5))
    assert d.mode is Mode.HOLD and d.cluster == new.cluster and d.record == record


@pytest.mark.parametrize("shape", ["aaaa1111", "bbbb2222"])
def test_recreate_replaces_in_place_or_by_shape(shape: str) -> None:
    d = step(want("Recreate", shape=shape, plan="p2"))
    assert d.mode is Mode.CONVERGE and d.record is None and d.keep == frozenset()
    assert d.cluster == (OLD.cluster if shape == OLD.shape else "demo-bbbb2")


def test_nothing_serving_converges_a_live_cluster_of_the_wanted_shape() -> None:
    d = step(want(plan="p2"), serving=None, live={"demo-sp7": "aaaa1111"})
    assert (d.mode, d.cluster, d.record) == (Mode.CONVERGE, "demo-sp7", None)
    fresh = step(want(plan="p2"), serving=None, live={})
    assert fresh.cluster == "demo-aaaa1"
