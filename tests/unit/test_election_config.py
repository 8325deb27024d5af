"""Leader-election settings: controller-runtime's defaults, the pod's identity from the
downward API, and timings that could let two processes write refused with the names."""

from __future__ import annotations

import pytest
from vllm_dp_operator.config import Config, LeaderElection


def test_defaults_are_controller_runtimes(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("VLLMDP_LEADER_ELECTION", "VLLMDP_LEASE_NAMESPACE", "VLLMDP_LEASE_NAME",
                 "VLLMDP_LEASE_DURATION_SECONDS", "VLLMDP_RENEW_DEADLINE_SECONDS",
                 "VLLMDP_RETRY_PERIOD_SECONDS"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("POD_NAME", "vdp-7d9f-abcde")
    monkeypatch.setenv("POD_NAMESPACE", "vllm-dp-system")
    got = Config.from_env().election
    assert got == LeaderElection(enabled=True, lease_name="vllm-dp-operator",
                                 lease_namespace="vllm-dp-system", lease_duration_seconds=15,
                                 renew_deadline_seconds=10, retry_period_seconds=2,
                                 pod_name="vdp-7d9f-abcde")  # fmt: skip


def test_overlapping_timings_are_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLMDP_RENEW_DEADLINE_SECONDS", "15")
    with pytest.raises(ValueError, match="VLLMDP_RENEW_DEADLINE_SECONDS < "
                                         "VLLMDP_LEASE_DURATION_SECONDS must hold"):  # fmt: skip
        Config.from_env()


def test_a_bad_switch_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLMDP_LEADER_ELECTION", "sometimes")
    with pytest.raises(ValueError, match="VLLMDP_LEADER_ELECTION: expected true or false"):
        Config.from_env()
