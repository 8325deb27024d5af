"""The bed's reader of `kubectl get` tables: cells are cut at their header's column, so an
empty cell reads as empty and the cells after it keep their headers."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testbed"))
from common import kubectl_table

TABLE = """\
NAME     DP    TP    PODS   PHASE       UPDATE     LOAD   ENDPOINT                 AGE
demo     8     1     2      Launching                     http://demo-api:8000/v1   3s
other    2     1     1      Serving     Starting   Idle   http://other-api:8000/v1  9m
"""


def test_an_empty_cell_shifts_nothing() -> None:
    demo, other = kubectl_table(TABLE)
    assert demo["UPDATE"] == "" and demo["LOAD"] == ""
    assert demo["ENDPOINT"] == "http://demo-api:8000/v1" and demo["AGE"] == "3s"
    assert (other["UPDATE"], other["LOAD"], other["AGE"]) == ("Starting", "Idle", "9m")


def test_no_output_is_no_rows() -> None:
    assert kubectl_table("") == []
    assert kubectl_table("NAME   AGE\n") == []
