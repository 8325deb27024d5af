"""Pure renderers: spec, plan and options in, manifest dicts out; no I/O."""

from vllm_dp_operator.render.endpointslice import build_endpoint_slice
from vllm_dp_operator.render.headjob import build_head_job, launcher_entrypoint
from vllm_dp_operator.render.networkpolicy import build_network_policies, build_network_policy
from vllm_dp_operator.render.raycluster import build_raycluster, cluster_hash
from vllm_dp_operator.render.service import build_service

__all__ = [
    "build_endpoint_slice",
    "build_head_job",
    "build_network_policies",
    "build_network_policy",
    "build_raycluster",
    "build_service",
    "cluster_hash",
    "launcher_entrypoint",
]
