"""Watched namespaces: the setting's parsing, and one reflector per kind and namespace."""

from __future__ import annotations

import pytest
from fake_api import FakeApi
from vllm_dp_operator.config import Config
from vllm_dp_operator.controller.kube import ENDPOINTSLICE, WORKLOAD
from vllm_dp_operator.controller.manager import CHILD_KINDS, Controller
from world import FakeProbe, FakeRayJobs


@pytest.mark.parametrize(
    ("env", "want"),
    [(None, ()), ("", ()), ("a", ("a",)), ("a,b", ("a", "b")), (" a , b,,a ", ("a", "b"))],
)
def test_watch_namespaces_setting(monkeypatch: pytest.MonkeyPatch, env: str | None,
                                  want: tuple[str, ...]) -> None:
    if env is None:
        monkeypatch.delenv("VLLMDP_WATCH_NAMESPACES", raising=False)
    else:
        monkeypatch.setenv("VLLMDP_WATCH_NAMESPACES", env)
    assert Config.from_env().watch_namespaces == want


def test_one_reflector_per_kind_and_listed_namespace() -> None:
    ctl = Controller(FakeApi(), Config(), FakeProbe(), FakeRayJobs(), namespaces=("a", "b"))
    pairs = {(r.kind, r.namespace) for r in ctl.reflectors}
    # Kueue's Workloads too, optional (watched where Kueue is installed).
    assert pairs == {(k, ns) for k in (*CHILD_KINDS, WORKLOAD) for ns in ("a", "b")}
    assert ENDPOINTSLICE in CHILD_KINDS  # the slice is watched: a deleted one is repaired
    # The metrics show one watch state per kind, however many namespaces.
    assert sorted(s.kind for s in ctl.watch_states()) == sorted(
        {s.kind for s in ctl.watch_states()})
    everywhere = Controller(FakeApi(), Config(), FakeProbe(), FakeRayJobs())
    assert {r.namespace for r in everywhere.reflectors} == {None}
