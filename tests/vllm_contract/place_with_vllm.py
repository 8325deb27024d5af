"""Run INSIDE the vllm==0.33.0 virtualenv: vLLM's own Ray DP placement on a real Ray cluster.

Reads ``{"testbed": DIR, "groups": [...]}`` as JSON on stdin, where ``DIR`` holds the ray
tier's ``ray_testbed.py`` and each group is ``{"pods", "gpusPerPod", "cpusPerPod", "cases"}``,
every case ``{"name", "command", "env"}``: the launcher's full ``vllm serve`` command (with
``--data-parallel-address <head IP>``) and the variables it sets for the engine; a case may
add ``"readyTimeout"`` (seconds) and ``"hold": {"ip", "CPU"}`` (CPUs to take from one node
first, for a negative control). For each group it starts a real Ray cluster with
``ray_testbed.RayTestbed`` (this interpreter's ``ray``, so driver and cluster run the same
Ray): a head on 127.0.0.2 and workers on 127.0.0.3, .4, ..., each with ``gpusPerPod`` logical
GPUs and ``cpusPerPod`` CPUs. For each case it then:

1. sets the case's environment (``VLLM_RAY_DP_PACK_STRATEGY`` among it) and reads the pack
   strategy back through ``vllm.envs``;
2. parses the command with ``vllm serve``'s own parser, builds ``EngineArgs.from_cli_args`` and
   from it the ``ParallelConfig`` the way ``EngineArgs.create_engine_config`` does (the rest
   of that method needs the model's Hugging Face config, which this offline machine cannot
   fetch), then ``VllmConfig(parallel_config=...)``: ``create_dp_placement_groups`` reads
   only ``vllm_config.parallel_config`` (master IP, DP size, DP size local, world size,
   all2all backend), so the model config is left at its default (None);
3. calls vLLM's unmodified ``CoreEngineActorManager.create_dp_placement_groups(vllm_config)``
   from a driver attached to the head node, as the head job's driver is;
4. waits, bounded, for every placement group to be ready and reports, per group, its name,
   strategy, state, local rank and the node IP each bundle landed on; then removes every
   placement group in the cluster (vLLM leaves the ones it made before it raised).

The GPU platform. vLLM picks its platform once (``vllm.platforms.current_platform``), by
probing NVML in ``cuda_platform_plugin``; here that returns None (no NVIDIA driver), and
``vllm.platforms.cuda`` itself cannot be imported (``vllm._C_stable_libtorch`` links
``libcuda.so.1``). So this script sets ``vllm.platforms._current_platform`` to a stand-in
before anything resolves it: a ``vllm.platforms.interface.Platform`` subclass whose class
attributes (``_enum = PlatformEnum.CUDA``, ``ray_device_key = "GPU"``,
``device_control_env_var = "CUDA_VISIBLE_DEVICES"``, ``device_name``, ``dist_backend``, ...)
are read from ``CudaPlatformBase`` in vLLM's own ``vllm/platforms/cuda.py`` source.
``ray_device_key`` is the only platform attribute ``create_dp_placement_groups`` reads; the
stand-in's ``device_count()`` is the head pod's GPU count, which ``ParallelConfig`` compares
with the world size on CUDA, and which is what ``CudaPlatform`` reports to the head job's
driver (Ray's job manager starts a driver that asks for no resources with
``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1``, so it sees every GPU of its pod). Nothing
in vLLM's placement or config code is patched. ``VLLM_TARGET_DEVICE`` is left unset (default
``cuda``); ``cpu`` would select ``CpuPlatform``, whose ``ray_device_key`` is empty, and whose
``is_cuda()`` is false, which skips ParallelConfig's GPU-count check.

Writes ``{"platform": {...}, "results": [...]}`` as JSON on stdout, each result ``{"name",
"error", "facts", "groups", "cluster", "seconds", "leftover_processes"}``; vLLM's and Ray's
logs go to stderr. Standard library, vLLM and Ray only.
"""

from __future__ import annotations

import ast
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from vllm_serve_args import engine_args, parallel_config, serve_parser

HEAD_IP = "127.0.0.2"
READY_TIMEOUT_S = 20.0
RELEASE_TIMEOUT_S = 20.0
CUDA_ATTRS = (
    "_enum",
    "device_name",
    "device_type",
    "dispatch_key",
    "ray_device_key",
    "dist_backend",
    "device_control_env_var",
    "ray_noset_device_env_vars",
)

os.environ.pop("VLLM_TARGET_DEVICE", None)
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def cuda_platform_attrs() -> dict[str, Any]:
    """Read ``CudaPlatformBase``'s plain class attributes from vLLM's own cuda.py source."""
    import vllm.platforms
    from vllm.platforms.interface import PlatformEnum

    source = (Path(vllm.platforms.__file__).parent / "cuda.py").read_text()
    (cls,) = [
        node
        for node in ast.parse(source).body
        if isinstance(node, ast.ClassDef) and node.name == "CudaPlatformBase"
    ]
    attrs: dict[str, Any] = {}
    for stmt in cls.body:
        target = stmt.targets[0] if isinstance(stmt, ast.Assign) else getattr(stmt, "target", None)
        value = getattr(stmt, "value", None)
        if not isinstance(target, ast.Name) or target.id not in CUDA_ATTRS or value is None:
            continue
        if ast.unparse(value).startswith("PlatformEnum."):
            attrs[target.id] = PlatformEnum[ast.unparse(value).split(".", 1)[1]]
        else:
            attrs[target.id] = ast.literal_eval(value)
    missing = set(CUDA_ATTRS) - set(attrs)
    if missing:
        raise RuntimeError(f"vllm/platforms/cuda.py: CudaPlatformBase lacks {sorted(missing)}")
    return attrs


def install_gpu_platform() -> dict[str, Any]:
    """Make ``vllm.platforms.current_platform`` a CUDA stand-in; say why it had to be done."""
    import vllm.platforms
    from vllm.platforms.interface import Platform

    if vllm.platforms._current_platform is not None:
        raise RuntimeError(
            f"vLLM resolved its platform too early: {vllm.platforms._current_platform!r}"
        )
    facts: dict[str, Any] = {"cuda_platform_plugin": vllm.platforms.cuda_platform_plugin()}
    try:
        import vllm.platforms.cuda
    except Exception as exc:
        facts["import_vllm_platforms_cuda"] = f"{type(exc).__name__}: {exc}"
    else:
        facts["import_vllm_platforms_cuda"] = "ok"
    attrs = cuda_platform_attrs()

    def device_count(cls: Any) -> int:
        return int(cls.head_pod_gpus)

    stand_in = type(
        "StandInCudaPlatform",
        (Platform,),
        {
            **attrs,
            "head_pod_gpus": 0,  # set per cluster: the GPUs of the pod the driver runs in
            "device_count": classmethod(device_count),
            "__module__": __name__,
        },
    )
    vllm.platforms._current_platform = stand_in()
    from vllm.platforms import current_platform

    facts.update(
        stand_in={k: str(v) for k, v in attrs.items()},
        is_cuda=current_platform.is_cuda(),
        ray_device_key=current_platform.ray_device_key,
    )
    return facts


def vllm_config_for(parser: Any, command: list[str]) -> Any:
    """Parse ``command`` as ``vllm serve`` does; build the VllmConfig's ParallelConfig."""
    from vllm.config import VllmConfig

    _, engine = engine_args(parser, command)
    return VllmConfig(parallel_config=parallel_config(engine))


def node_ips() -> dict[str, str]:
    """Map every alive Ray node's id to its IP."""
    import ray

    return {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}


def describe(pg: Any, local_rank: int, ips: dict[str, str]) -> dict[str, Any]:
    """Name, strategy, state and per-bundle node IP of one placement group."""
    from ray.util import placement_group_table

    table = placement_group_table(pg)
    where = table.get("bundles_to_node_id", {})
    return {
        "name": table["name"],
        "strategy": table["strategy"],
        "state": table["state"],
        "local_rank": local_rank,
        "bundles": [
            {"resources": resources, "node_ip": ips.get(where.get(i, ""))}
            for i, resources in sorted(table["bundles"].items())
        ],
    }


def remove_all_placement_groups() -> list[str]:
    """Remove every placement group of the cluster not yet removed; return their names."""
    from ray._raylet import PlacementGroupID
    from ray.util import placement_group_table, remove_placement_group
    from ray.util.placement_group import PlacementGroup

    names = []
    for pg_id, table in placement_group_table().items():
        if table["state"] != "REMOVED":
            remove_placement_group(PlacementGroup(PlacementGroupID.from_hex(pg_id)))
            names.append(table["name"])
    return sorted(names)


def wait_released(total: dict[str, float]) -> None:
    """Wait (bounded) until every node offers its full GPUs and CPUs again."""
    from ray._private.state import available_resources_per_node

    deadline = time.monotonic() + RELEASE_TIMEOUT_S
    while time.monotonic() < deadline:
        free = available_resources_per_node()
        if all(sum(r.get(k, 0) for r in free.values()) >= v for k, v in total.items()):
            return
        time.sleep(0.2)
    raise TimeoutError(f"placement groups not released after {RELEASE_TIMEOUT_S} s")


def place(parser: Any, case: dict[str, Any], total: dict[str, float]) -> dict[str, Any]:
    """Run vLLM's placement for one case; never raises."""
    import ray
    import vllm.envs as envs
    from ray.util import placement_group, remove_placement_group
    from vllm.v1.engine.utils import CoreEngineActorManager

    result: dict[str, Any] = {"name": case["name"], "error": None, "groups": [], "facts": {}}
    saved = dict(os.environ)
    os.environ.update(case.get("env", {}))
    pgs: list[Any] = []
    held = None
    ready_timeout = float(case.get("readyTimeout", READY_TIMEOUT_S))
    started = time.monotonic()
    try:
        if case.get("hold"):
            # A negative control: take CPUs away from one node before vLLM looks (vLLM's
            # snapshot counts GPUs only), as a pod with fewer CPUs than ranks would.
            ip, cpus = case["hold"]["ip"], float(case["hold"]["CPU"])
            held = placement_group([{"CPU": cpus, f"node:{ip}": 0.001}], strategy="STRICT_PACK")
            ray.get(held.ready(), timeout=ready_timeout)
        config = vllm_config_for(parser, case["command"])
        parallel = config.parallel_config
        result["facts"] = {
            "pack_strategy": envs.VLLM_RAY_DP_PACK_STRATEGY,
            "data_parallel_size": parallel.data_parallel_size,
            "data_parallel_size_local": parallel.data_parallel_size_local,
            "data_parallel_master_ip": parallel.data_parallel_master_ip,
            "world_size": parallel.world_size,
            "distributed_executor_backend": parallel.distributed_executor_backend,
        }
        pgs, local_ranks = CoreEngineActorManager.create_dp_placement_groups(config)
        ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=ready_timeout)
        ips = node_ips()
        result["groups"] = [describe(pg, r, ips) for pg, r in zip(pgs, local_ranks, strict=True)]
        if len(ready) < len(pgs):
            pending = [g["name"] for g in result["groups"] if g["state"] != "CREATED"]
            result["error"] = (
                f"TimeoutError: {len(pgs) - len(ready)} placement groups not ready after "
                f"{ready_timeout} s: {pending}"
            )
    except Exception as exc:  # AssertionError and ValueError are vLLM's refusals
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["facts"]["traceback"] = traceback.format_exc(limit=6)
    finally:
        for pg in [*pgs, *([held] if held else [])]:
            remove_placement_group(pg)
        # vLLM does not remove the groups it made before it raised ("Not enough resources"):
        # remove every group still alive, and say which.
        left = remove_all_placement_groups()
        if left:
            result["facts"]["left_by_vllm"] = left
        try:
            wait_released(total)
        except TimeoutError as exc:
            result["error"] = result["error"] or f"TimeoutError: {exc}"
        os.environ.clear()
        os.environ.update(saved)
    result["seconds"] = round(time.monotonic() - started, 2)
    return result


def run_group(testbed_cls: Any, pick_port_base: Any, group: dict[str, Any]) -> list[dict[str, Any]]:
    """Start the group's Ray cluster, place every case on it, stop the cluster."""
    import ray

    pods, gpus, cpus = group["pods"], group["gpusPerPod"], group["cpusPerPod"]
    ips = [HEAD_IP, *(f"127.0.0.{3 + i}" for i in range(pods - 1))]
    root = Path(tempfile.mkdtemp(prefix="vdpvp", dir="/tmp"))  # short: unix socket paths
    testbed = testbed_cls(root=root, port_base=pick_port_base(nodes=pods))
    # RayTestbed starts nodes with --num-cpus=1; Ray lets RAY_OVERRIDE_RESOURCES override it.
    # Every placement group holds one {"CPU": 1} control bundle, so a node needs a CPU per rank.
    os.environ["RAY_OVERRIDE_RESOURCES"] = json.dumps({"CPU": cpus})
    results: list[dict[str, Any]] = []
    try:
        testbed.start_node(HEAD_IP, gpus, slot=0)
        testbed.wait_alive({HEAD_IP})
        for slot, ip in enumerate(ips[1:], start=1):
            testbed.start_node(ip, gpus, slot=slot)
        testbed.wait_alive(set(ips))
        os.environ.pop("RAY_OVERRIDE_RESOURCES")
        ray.init(
            address=testbed.gcs_address,
            _node_ip_address=HEAD_IP,
            logging_level=logging.WARNING,
            log_to_driver=False,
        )
        parser = serve_parser()
        total = {"GPU": float(pods * gpus), "CPU": float(pods * cpus)}
        for case in group["cases"]:
            result = place(parser, case, total)
            result["cluster"] = {ip: {"GPU": gpus, "CPU": cpus} for ip in ips}
            results.append(result)
    finally:
        os.environ.pop("RAY_OVERRIDE_RESOURCES", None)
        if ray.is_initialized():
            ray.shutdown()
        leftovers = stop_cluster(testbed)
        shutil.rmtree(root, ignore_errors=True)
    for result in results:
        result["leftover_processes"] = leftovers
    return results


def stop_cluster(testbed: Any) -> list[str]:
    """Stop every node (workers first); SIGKILL, by PID, what a node's own stop left behind."""
    leftovers = []
    for node in sorted(testbed.nodes, key=lambda n: n.ip == HEAD_IP):
        try:
            node.stop()
        except Exception as exc:  # RuntimeError: "left processes behind"
            leftovers.append(str(exc))
            deadline = time.monotonic() + 10
            while node.session_pids() and time.monotonic() < deadline:
                for pid in node.session_pids():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                time.sleep(0.2)
            if node.session_pids():
                leftovers.append(f"still alive after SIGKILL: {node.session_pids()}")
    testbed.nodes.clear()
    return leftovers


def main() -> int:
    """Place every case of every group; print the results as JSON."""
    request = json.load(sys.stdin)
    # Only the JSON goes to stdout: whatever vLLM, Ray or a child writes there goes to stderr.
    result_stream = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.path.insert(0, request["testbed"])
    from ray_testbed import RayTestbed, pick_port_base

    out: dict[str, Any] = {"platform": install_gpu_platform(), "results": []}
    import vllm.platforms

    stand_in = type(vllm.platforms._current_platform)
    for group in request["groups"]:
        stand_in.head_pod_gpus = group["gpusPerPod"]
        out["results"] += run_group(RayTestbed, pick_port_base, group)
    with result_stream:
        json.dump(out, result_stream, indent=2, default=str)
        result_stream.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
