"""The engine command line and environment: the plan's, plus what only the launcher knows."""

from __future__ import annotations

from collections.abc import Mapping

from vllm_dp_launcher.errors import PlanError
from vllm_dp_launcher.plan import LaunchPlan

DP_ADDRESS_FLAGS = ("--data-parallel-address", "-dpa")
HOST_IP_ENV = "VLLM_HOST_IP"
PREFIXES_ENV = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"
# Ray actors do not inherit the driver's environment; without these prefixes the engine
# actors lose GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME and pick the wrong NIC.
REQUIRED_PREFIXES = ("GLOO_", "NCCL_")
#: vLLM's API server closes an idle HTTP connection after VLLM_HTTP_TIMEOUT_KEEP_ALIVE seconds
#: (5 by default). The operator asks /health every 30 s over one kept connection per Service,
#: and a load balancer in front of the Service typically keeps idle connections 60 s: with 5 s
#: each probe opened a new connection, and a balancer could reuse one vLLM had just closed.
KEEP_ALIVE_ENV = "VLLM_HTTP_TIMEOUT_KEEP_ALIVE"
KEEP_ALIVE_SECONDS = 75
# Shown in --dry-run when no address can be resolved; the pod sets VLLM_HOST_IP from its IP.
ADDRESS_PLACEHOLDER = "$(VLLM_HOST_IP)"


def build_command(plan: LaunchPlan, dp_address: str) -> list[str]:
    """Return the plan's command with ``--data-parallel-address <dp_address>`` appended."""
    for arg in plan.command:
        flag = arg.split("=", 1)[0]
        if flag in DP_ADDRESS_FLAGS:
            raise PlanError(
                f"launch plan: 'command' already sets {flag}; the launcher sets it to the IP "
                "of the Ray node it runs on, so the plan must leave it out"
            )
    return [*plan.command, DP_ADDRESS_FLAGS[0], dp_address]


def _with_required_prefixes(value: str | None) -> str:
    """Return a comma-separated prefix list that includes every required prefix."""
    prefixes = [p.strip() for p in (value or "").split(",") if p.strip()]
    prefixes += [p for p in REQUIRED_PREFIXES if p not in prefixes]
    return ",".join(prefixes)


def engine_env_overrides(
    plan: LaunchPlan, host_ip: str | None, inherited: Mapping[str, str]
) -> dict[str, str]:
    """Return the variables the launcher sets on top of ``inherited`` for the engine."""
    overrides = dict(plan.env)
    merged = {**inherited, **overrides}
    if host_ip is not None and not merged.get(HOST_IP_ENV):
        overrides[HOST_IP_ENV] = host_ip
    if not merged.get(KEEP_ALIVE_ENV):
        overrides[KEEP_ALIVE_ENV] = str(KEEP_ALIVE_SECONDS)
    prefixes = _with_required_prefixes(merged.get(PREFIXES_ENV))
    if prefixes != merged.get(PREFIXES_ENV):
        overrides[PREFIXES_ENV] = prefixes
    return overrides


def engine_env(
    plan: LaunchPlan, host_ip: str | None, inherited: Mapping[str, str]
) -> dict[str, str]:
    """Return the full environment the engine process runs with."""
    return {**inherited, **engine_env_overrides(plan, host_ip, inherited)}
