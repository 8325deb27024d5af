"""The /metrics parser behind status.load and the per-rank gauges, over vLLM 0.33's
exposition text (labels `model_name` and `engine`), and the ranks that report nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_dp_operator.engines.engine_metrics import (
    EngineLoad,
    ExpositionError,
    complete_lines,
    missing_ranks,
    parse_engine_loads,
    ranks_text,
    series_cap,
)

# Two DP ranks' worth of what vLLM 0.33's API server answers on /metrics (gauges, counters,
# histograms with buckets, info series, Python's own), trimmed to two ranks.
SAMPLE = (Path(__file__).parent / "data" / "vllm-0.33-dp2-metrics.txt").read_text()


def test_reads_the_three_gauges_per_rank_and_nothing_else() -> None:
    loads = parse_engine_loads(SAMPLE)
    assert loads == {
        0: EngineLoad(0, running=3, waiting=0, kv_cache_usage=0.125),
        1: EngineLoad(1, running=5, waiting=2, kv_cache_usage=0.375),
    }


def test_a_rank_that_stops_reporting_is_absent() -> None:
    text = "\n".join(line for line in SAMPLE.splitlines() if 'engine="1"' not in line)
    assert sorted(parse_engine_loads(text)) == [0]
    assert missing_ranks(parse_engine_loads(text), data_parallel_size=2) == [1]


def test_label_order_escapes_and_timestamps() -> None:
    text = (
        'vllm:num_requests_running{model_name="a\\"b,engine=\\"9\\"}",engine="4"} 7 1700000000\n'
        'vllm:num_requests_waiting{engine="4", model_name="x"} 1.0\n'
        'vllm:kv_cache_usage_perc{model_name="x",engine="4"} 5.5e-01\n'
        'vllm:num_requests_running_total{engine="4"} 99\n'  # another family, same prefix
        'vllm:num_requests_running{model_name="x"} 4\n'  # no engine label: not a rank
    )
    assert parse_engine_loads(text) == {4: EngineLoad(4, 7, 1, 0.55)}


def test_an_unparseable_wanted_line_is_an_error_naming_it() -> None:
    with pytest.raises(ExpositionError, match="not a number"):
        parse_engine_loads('vllm:num_requests_running{engine="0"} many\n')
    with pytest.raises(ExpositionError, match="unterminated"):
        parse_engine_loads('vllm:num_requests_waiting{engine="0} 1\n')


def test_a_cut_response_loses_only_its_partial_last_line() -> None:
    cut = SAMPLE[: SAMPLE.index('vllm:kv_cache_usage_perc{engine="1"') + 30]
    loads = parse_engine_loads(complete_lines(cut))
    assert loads[1].running == 5 and loads[1].kv_cache_usage == 0.0  # not a misread number
    assert complete_lines("no newline") == ""


def test_missing_ranks_and_their_text() -> None:
    assert missing_ranks(parse_engine_loads(SAMPLE), data_parallel_size=4) == [2, 3]
    assert ranks_text([7, 0, 2, 3, 4]) == "0, 2-4, 7"


def test_wanted_lines_are_found_anywhere_and_the_rest_is_skipped_unread() -> None:
    # The parser searches for the families' line starts instead of splitting every line: a
    # wanted line first in the text, last without a newline, after CRLF line ends, or
    # between histogram lines that mention a wanted name in a label, is read all the same.
    text = (
        'vllm:num_requests_running{engine="0",model_name="m"} 2.0\r\n'
        'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",note="vllm:num_requests_'
        'waiting{engine=\\"0\\"} 9"} 4.0\r\n'
        '# HELP vllm:num_requests_waiting Number of requests waiting.\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 3.0\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5'
    )
    assert parse_engine_loads(text) == {
        0: EngineLoad(0, running=2, waiting=1, kv_cache_usage=0.0),
        1: EngineLoad(1, running=3, waiting=0, kv_cache_usage=0.5),
    }


def test_ranks_beyond_the_dp_size_are_skipped_before_their_labels_are_parsed() -> None:
    # A tenant's exposition of made-up ranks (issue 39, item 4): only the planned ones count,
    # and the others are not parsed at all (a label parse of each cost seconds at 4 MiB).
    lines = [f'vllm:num_requests_running{{engine="{r}",model_name="m"}} {r}\n'
             for r in range(30)]  # fmt: skip
    text = "".join(lines) + 'vllm:num_requests_running{engine="9999",bad="unterminated} 1\n'
    loads = parse_engine_loads(text, ranks=4)
    assert sorted(loads) == [0, 1, 2, 3] and loads[3].running == 3
    with pytest.raises(ExpositionError):
        parse_engine_loads(text)  # without the bound, the bad line is parsed (and refused)


def test_a_family_of_more_series_than_the_dp_size_allows_is_not_read_further() -> None:
    # 5,000 made-up ranks: past series_cap(4) = 32 lines of the family, the reading stops
    # (the work per read is bounded by the DP size, not by the text's length).
    text = "".join(f'vllm:num_requests_running{{engine="{r}",model_name="m"}} {r}\n'
                   for r in range(5000))  # fmt: skip
    with pytest.raises(ExpositionError, match=r"more than 32 series of "
                                              r"vllm:num_requests_running for 4 ranks"):
        parse_engine_loads(text, ranks=4)
    # As many series as the cap allows (each rank from 4 API server processes) are read.
    many = "".join(f'vllm:num_requests_running{{engine="{r}",pid="{p}"}} {r}\n'
                   for p in range(4) for r in range(4))  # fmt: skip
    assert sorted(parse_engine_loads(many, ranks=4)) == [0, 1, 2, 3]
    assert series_cap(0) == 0 and series_cap(8) == 80 and series_cap(64) == 64 * 64 + 16
