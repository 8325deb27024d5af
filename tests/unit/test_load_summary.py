"""engines/load_summary.py: the level of a reading, and when a new summary is worth a write."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from vllm_dp_operator.engines.engine_metrics import EngineLoad
from vllm_dp_operator.engines.load_summary import (
    BUSY,
    IDLE,
    SATURATED,
    level_of,
    summarize,
)
from vllm_dp_operator.reconcile.status import rfc3339

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def loads(*ranks: tuple[int, int, float]) -> dict[int, EngineLoad]:
    return {i: EngineLoad(i, run, wait, kv) for i, (run, wait, kv) in enumerate(ranks)}


def test_levels() -> None:
    assert level_of(loads((0, 0, 0.0), (0, 0, 0.3))) == IDLE
    assert level_of(loads((4, 0, 0.5), (0, 0, 0.1))) == BUSY
    assert level_of(loads((4, 1, 0.5), (0, 0, 0.1))) == SATURATED  # a queue on one rank
    assert level_of(loads((4, 0, 0.95), (0, 0, 0.1))) == SATURATED  # a full KV cache
    assert level_of({}) == IDLE


def test_the_first_reading_is_written() -> None:
    assert summarize(loads((1, 0, 0.1)), None, T0) == {
        "level": BUSY, "ranksReporting": 1, "since": rfc3339(T0)}  # fmt: skip


def test_the_same_level_returns_the_previous_summary_unchanged() -> None:
    prev = summarize(loads((1, 0, 0.1), (2, 0, 0.1)), None, T0)
    later = T0 + timedelta(minutes=10)
    assert summarize(loads((9, 0, 0.8), (5, 0, 0.2)), prev, later) == prev


def test_a_new_level_waits_for_the_old_one_to_stand_a_minute() -> None:
    prev = summarize(loads((1, 0, 0.1)), None, T0)
    assert summarize(loads((1, 3, 0.1)), prev, T0 + timedelta(seconds=59)) == prev
    new = summarize(loads((1, 3, 0.1)), prev, T0 + timedelta(seconds=60))
    assert new["level"] == SATURATED and new["since"] == rfc3339(T0 + timedelta(seconds=60))


def test_a_rank_that_stops_reporting_is_written_at_once() -> None:
    prev = summarize(loads((1, 0, 0.1), (1, 0, 0.1)), None, T0)
    at = T0 + timedelta(seconds=5)
    same_level = summarize(loads((1, 0, 0.1)), prev, at)
    assert same_level == {**prev, "ranksReporting": 1}  # level and its age unchanged
    new_level = summarize(loads((0, 0, 0.0)), prev, at)  # and the level it comes with
    assert new_level == {"level": IDLE, "ranksReporting": 1, "since": rfc3339(at)}


def test_a_summary_from_an_unknown_shape_is_replaced() -> None:
    assert summarize(loads((0, 0, 0.0)), {"level": "Hot"}, T0)["level"] == IDLE
