"""TEST-ONLY vLLM general plugin for the CPU engine test image: a Ray device key for the CPU.

vLLM's CPU platform says it cannot run on Ray (`ray_device_key = ""`), so the Ray
data-parallel backend stops at "No  found in Ray cluster" before placing any rank. The test
bed's Ray nodes advertise logical GPUs (the operator asks KubeRay for `nvidia.com/gpu`), so
this plugin names that resource, `GPU`, as the CPU platform's device key (override with
VLLM_CPU_RAY_DEVICE_KEY). vLLM's own GPU placement path then runs unchanged, as it would on
real GPUs. vLLM loads general plugins in every process it starts, engines included.

It also picks the engines' executor. With `--data-parallel-backend ray` and no
`--distributed-executor-backend`, vLLM defaults each engine's executor to Ray, which its CPU
platform cannot run ("current platform cpu does not support ray"). The operator owns that flag,
so a resource cannot pass `mp`; instead the CPU platform's own config hook (where vLLM already
turns `uni` into `mp` on CPU) turns a defaulted `ray` into `mp` when an engine is one process
(TP x PP = 1), before any engine starts. `VLLM_CPU_DP_EXECUTOR` overrides the choice.
"""

from __future__ import annotations

import logging
import os
from typing import Any

DEFAULT_KEY = "GPU"
DEFAULT_EXECUTOR = "mp"


def register() -> None:
    """Give the CPU platform a Ray device key (vLLM calls this at start, in each process)."""
    from vllm.platforms import current_platform

    key = os.environ.get("VLLM_CPU_RAY_DEVICE_KEY", DEFAULT_KEY)
    if current_platform.device_type != "cpu":
        return
    if not current_platform.ray_device_key:
        type(current_platform).ray_device_key = key
        logging.getLogger("vllm").info(
            "vllm_dp_test_cpu_glue: CPU platform ray_device_key=%r (pid %d)", key, os.getpid()
        )
    local_executor(type(current_platform), os.environ.get("VLLM_CPU_DP_EXECUTOR",
                                                          DEFAULT_EXECUTOR))


def local_executor(platform: type, executor: str) -> None:
    """Wrap `platform.check_and_update_config` (once): a one-process engine that vLLM gave the
    Ray executor because the DP backend is Ray gets `executor` instead."""
    hook = platform.__dict__["check_and_update_config"].__func__
    if getattr(hook, "vllm_dp_test_cpu_glue", False):
        return

    def check_and_update_config(cls: type, vllm_config: Any) -> None:
        pc = vllm_config.parallel_config
        if (pc.distributed_executor_backend == "ray" and pc.data_parallel_backend == "ray"
                and pc.world_size == 1):  # fmt: skip
            pc.distributed_executor_backend = executor
            logging.getLogger("vllm").info(
                "vllm_dp_test_cpu_glue: engine executor %s instead of ray (pid %d)",
                executor, os.getpid())  # fmt: skip
        hook(cls, vllm_config)

    check_and_update_config.vllm_dp_test_cpu_glue = True  # type: ignore[attr-defined]
    platform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[attr-defined]
