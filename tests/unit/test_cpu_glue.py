"""The CPU engine test image's glue (tests/images/engine-cpu/glue): a one-process engine that
vLLM gave the Ray executor because the DP backend is Ray runs the `mp` executor instead, so
`examples/dev-cpu.yaml` needs no `--distributed-executor-backend` (a flag the operator owns)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "images" / "engine-cpu" / "glue"))
import vllm_dp_test_cpu_glue as glue  # noqa: E402


def platform() -> type:
    class CpuPlatform:
        seen: ClassVar[list[str]] = []

        @classmethod
        def check_and_update_config(cls, vllm_config: Any) -> None:
            pc = vllm_config.parallel_config
            if pc.distributed_executor_backend == "uni":  # what vLLM's CPU hook does itself
                pc.distributed_executor_backend = "mp"
            cls.seen.append(pc.distributed_executor_backend)

    return CpuPlatform


def config(backend: str, dp_backend: str = "ray", world_size: int = 1) -> Any:
    return SimpleNamespace(parallel_config=SimpleNamespace(
        distributed_executor_backend=backend, data_parallel_backend=dp_backend,
        world_size=world_size))  # fmt: skip


def test_defaulted_ray_executor_becomes_mp_for_one_process_engines() -> None:
    p = platform()
    glue.local_executor(p, "mp")
    cfg = config("ray")
    p.check_and_update_config(cfg)  # type: ignore[attr-defined]
    assert cfg.parallel_config.distributed_executor_backend == "mp"
    assert p.seen == ["mp"]  # vLLM's own hook still runs, after the change


def test_other_shapes_keep_their_executor() -> None:
    p = platform()
    glue.local_executor(p, "mp")
    for cfg, want in ((config("ray", world_size=2), "ray"), (config("ray", "mp"), "ray"),
                      (config("uni"), "mp"), (config("mp"), "mp")):  # fmt: skip
        p.check_and_update_config(cfg)  # type: ignore[attr-defined]
        assert cfg.parallel_config.distributed_executor_backend == want


def test_wrapping_twice_wraps_once() -> None:
    p = platform()
    glue.local_executor(p, "mp")
    first = p.__dict__["check_and_update_config"]
    glue.local_executor(p, "mp")
    assert p.__dict__["check_and_update_config"] is first
