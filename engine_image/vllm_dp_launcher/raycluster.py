"""The launcher's driver connection to Ray: connect, find its own node, list the GPU nodes.

Also where the launcher asks Ray who holds GPUs: through Ray's state API, which the head's
dashboard serves (KubeRay always runs it). Its records are turned into plain dicts here and
judged in ``holders``.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import os
from collections.abc import Mapping
from typing import Any

from vllm_dp_launcher import holders
from vllm_dp_launcher.cluster import GpuNode, gpu_nodes
from vllm_dp_launcher.errors import LauncherError, RayConnectError

log = logging.getLogger(__name__)

RAY_ADDRESS_ENV = "RAY_ADDRESS"
# Ray's job supervisor hands each driver its job config (with the submission id) here.
JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
STATE_API_TIMEOUT_S = 10


def check_address(address: str | None) -> None:
    """Refuse Ray Client addresses: vLLM cannot run its engines through one (vllm#14349)."""
    env_value = os.environ.get(RAY_ADDRESS_ENV)
    for source, value in (("--ray-address", address), (RAY_ADDRESS_ENV, env_value)):
        if value and value.strip().startswith("ray://"):
            raise LauncherError(
                f"{source}={value}: a ray:// (Ray Client) address is not supported; vLLM's Ray "
                "data-parallel backend must run inside the cluster (vllm#14349). Use the GCS "
                "address (host:6379) or 'auto'."
            )


def connect(address: str | None) -> None:
    """Connect this process to the Ray cluster as a driver (``auto`` when no address)."""
    check_address(address)
    try:
        import ray

        ray.init(address=address or "auto", log_to_driver=False, logging_level=logging.WARNING)
    except Exception as exc:
        raise RayConnectError(
            f"cannot connect to the Ray cluster at {address or 'auto'}: {exc}"
        ) from exc


def disconnect() -> None:
    """Drop the launcher's driver connection, once neither the gate nor the preflight needs it.

    Ray's shutdown puts the process's SIGTERM back to the default at the C level, whatever
    Python's ``signal.getsignal`` says: a handler wanted after it must be installed again.
    """
    import ray

    if ray.is_initialized():
        ray.shutdown()


def own_node_ip() -> str:
    """Return the IP of the Ray node this driver is attached to (its ``node:<ip>``)."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():  # type: ignore[no-untyped-call]
        if node["NodeID"] == node_id:
            return str(node["NodeManagerAddress"])
    raise LauncherError(f"this driver's Ray node {node_id} is not in the cluster's node table")


def list_gpu_nodes() -> list[GpuNode]:
    """Return the alive GPU nodes of the cluster, with the GPUs free on each."""
    import ray

    # The very call vLLM's placement makes (vllm/v1/engine/utils.py): free means free to it.
    from ray._private.state import available_resources_per_node

    available = available_resources_per_node()  # type: ignore[no-untyped-call]
    return gpu_nodes(ray.nodes(), available)  # type: ignore[no-untyped-call]


def own_submission_id(env: Mapping[str, str] = os.environ) -> str | None:
    """Return the Ray job submission this launcher runs in, if it runs in one."""
    try:
        config = json.loads(env.get(JOB_CONFIG_ENV) or "{}")
        submission = config.get("metadata", {}).get("job_submission_id")
    except (ValueError, AttributeError):
        return None
    return str(submission) if submission else None


def _plain(value: Any) -> Any:
    """Turn a state API record (dataclass, pydantic model, enum) into plain data."""
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if hasattr(value, "model_dump"):
        return _plain(value.model_dump())
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def job_table() -> list[dict[str, Any]]:
    """Every driver in Ray's job table (the GCS's, no dashboard needed), as plain dicts."""
    import ray

    client = ray._private.worker.global_worker.gcs_client  # type: ignore[attr-defined]
    infos = client.get_all_job_info(
        skip_submission_job_info_field=True, skip_is_running_tasks_field=True
    )
    return [
        {
            "job_id": info.job_id.hex(),
            "is_dead": bool(info.is_dead),
            "driver_pid": int(info.driver_pid),
            "driver_ip": str(info.driver_address.ip_address),
            "entrypoint": str(info.entrypoint),
            "submission_id": dict(info.config.metadata).get("job_submission_id"),
        }
        for info in infos.values()
    ]


def gpu_holders() -> holders.HolderReport:
    """Ask Ray which jobs hold GPUs; a state API that cannot answer is reported, not raised.

    Placement groups and actors (with the job that created them) come from Ray's state API,
    which the head's dashboard serves; whether each job's driver still runs comes from the
    GCS job table, exactly per driver (a submission may have had several: the launcher's own
    connection, then vllm serve's).
    """
    import ray

    try:
        from ray.util import state

        options: dict[str, Any] = {
            "timeout": STATE_API_TIMEOUT_S,
            "raise_on_missing_output": False,
        }
        pgs = state.list_placement_groups(
            filters=[("state", "=", "CREATED")], detail=True, **options
        )
        actors = state.list_actors(filters=[("state", "=", "ALIVE")], detail=True, **options)
        jobs = job_table()
    except Exception as exc:  # the dashboard may be down: then the holders are unknown
        return holders.HolderReport(error=f"Ray's state API: {type(exc).__name__}: {exc}")
    node_ips = {
        str(n["NodeID"]): str(n["NodeManagerAddress"])
        for n in ray.nodes()  # type: ignore[no-untyped-call]
    }
    return holders.summarize(_plain(pgs), _plain(actors), jobs, node_ips, own_submission_id())


def try_own_node_ip(address: str | None) -> str | None:
    """Return this node's Ray IP if a cluster is reachable, else None (for --dry-run)."""
    check_address(address)
    try:
        connect(address)
        try:
            return own_node_ip()
        finally:
            disconnect()
    except Exception as exc:  # any failure just means "no Ray here"
        log.debug("no Ray cluster reachable for --dry-run: %s", exc)
        return None
