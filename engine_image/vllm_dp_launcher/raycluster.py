"""The launcher's driver connection to Ray: connect, find its own node, list the GPU nodes."""

from __future__ import annotations

import logging
import os

from vllm_dp_launcher.cluster import GpuNode, gpu_nodes
from vllm_dp_launcher.errors import LauncherError

log = logging.getLogger(__name__)

RAY_ADDRESS_ENV = "RAY_ADDRESS"


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
        raise LauncherError(
            f"cannot connect to the Ray cluster at {address or 'auto'}: {exc}"
        ) from exc


def disconnect() -> None:
    """Drop the driver connection so that vLLM's own driver is the only one left."""
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
    """Return the alive GPU nodes of the cluster."""
    import ray

    return gpu_nodes(ray.nodes())  # type: ignore[no-untyped-call]


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
