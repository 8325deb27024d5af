"""TEST-ONLY vLLM general plugin for the CPU engine test image: a Ray device key for the CPU.

vLLM's CPU platform says it cannot run on Ray (`ray_device_key = ""`), so the Ray
data-parallel backend stops at "No  found in Ray cluster" before placing any rank. The test
bed's Ray nodes advertise logical GPUs (the operator asks KubeRay for `nvidia.com/gpu`), so
this plugin names that resource, `GPU`, as the CPU platform's device key (override with
VLLM_CPU_RAY_DEVICE_KEY). vLLM's own GPU placement path then runs unchanged, as it would on
real GPUs. vLLM loads general plugins in every process it starts, engines included.
"""

from __future__ import annotations

import logging
import os

DEFAULT_KEY = "GPU"


def register() -> None:
    """Give the CPU platform a Ray device key (vLLM calls this at start, in each process)."""
    from vllm.platforms import current_platform

    key = os.environ.get("VLLM_CPU_RAY_DEVICE_KEY", DEFAULT_KEY)
    if current_platform.device_type == "cpu" and not current_platform.ray_device_key:
        type(current_platform).ray_device_key = key
        logging.getLogger("vllm").info(
            "vllm_dp_test_cpu_glue: CPU platform ray_device_key=%r (pid %d)", key, os.getpid()
        )
