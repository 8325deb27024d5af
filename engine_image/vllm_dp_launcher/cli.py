"""Command line: ``python -m vllm_dp_launcher --plan JSON`` (or ``--plan-file PATH``)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from vllm_dp_launcher import raycluster
from vllm_dp_launcher.cluster import layout_problems, wait_for_cluster
from vllm_dp_launcher.command import (
    ADDRESS_PLACEHOLDER,
    HOST_IP_ENV,
    build_command,
    engine_env,
    engine_env_overrides,
)
from vllm_dp_launcher.errors import ClusterNotReadyError, LauncherError, PlanError
from vllm_dp_launcher.plan import LaunchPlan, load_plan
from vllm_dp_launcher.preflight import run_preflight
from vllm_dp_launcher.supervise import run_engine

log = logging.getLogger("vllm_dp_launcher")
LOG_FORMAT = "%(asctime)s vllm-dp-launcher %(levelname)s %(message)s"


def build_parser() -> argparse.ArgumentParser:
    """Return the launcher's argument parser."""
    parser = argparse.ArgumentParser(
        prog="python -m vllm_dp_launcher",
        description=(
            "Wait for the Ray cluster to hold the planned GPU nodes, check that every node "
            "reaches this one, then run the plan's vllm serve command with "
            "--data-parallel-address set to this Ray node's IP."
        ),
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--plan", help="the launch plan as JSON text")
    source.add_argument("--plan-file", type=Path, help="a file holding the launch plan JSON")
    parser.add_argument(
        "--ray-address",
        help="Ray GCS address to connect to (default: 'auto', which honours RAY_ADDRESS); "
        "ray:// client addresses are refused",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan, command and environment as JSON and exit without running vLLM",
    )
    parser.add_argument(
        "--node-ip",
        help="with --dry-run: the data-parallel address to show instead of asking Ray",
    )
    parser.add_argument(
        "--progress-interval",
        type=float,
        default=10.0,
        help="seconds between progress lines while waiting for the cluster (default 10)",
    )
    return parser


def read_plan(args: argparse.Namespace) -> LaunchPlan:
    """Load the plan from --plan or --plan-file."""
    if args.plan_file is not None:
        try:
            return load_plan(Path(args.plan_file).read_text())
        except OSError as exc:
            raise PlanError(f"cannot read --plan-file {args.plan_file}: {exc}") from exc
    return load_plan(args.plan)


def resolve_dry_run_address(
    node_ip: str | None, ray_ip: Callable[[], str | None], env: Mapping[str, str]
) -> tuple[str, str]:
    """Pick the --dry-run address: --node-ip, else Ray, else VLLM_HOST_IP, else a placeholder."""
    if node_ip:
        return node_ip, "--node-ip"
    from_ray = ray_ip()
    if from_ray:
        return from_ray, "ray"
    if env.get(HOST_IP_ENV):
        return env[HOST_IP_ENV], HOST_IP_ENV
    return ADDRESS_PLACEHOLDER, "placeholder"


def dry_run_report(
    plan: LaunchPlan, address: str, source: str, inherited: Mapping[str, str]
) -> dict[str, Any]:
    """Return what a launch would run: plan, command and the variables set for the engine."""
    host_ip = None if address == ADDRESS_PLACEHOLDER else address
    return {
        "plan": plan.to_json_dict(),
        "dataParallelAddress": address,
        "dataParallelAddressSource": source,
        "command": build_command(plan, address),
        "env": engine_env_overrides(plan, host_ip, inherited),
    }


def launch(plan: LaunchPlan, ray_address: str | None, progress_interval: float) -> int:
    """Gate on the cluster and the network, then run the engine; return its exit status."""
    raycluster.connect(ray_address)
    try:
        own_ip = raycluster.own_node_ip()
        log.info("launcher runs on Ray node %s", own_ip)
        nodes = wait_for_cluster(
            plan,
            raycluster.list_gpu_nodes,
            own_ip,
            timeout=plan.wait_timeout_seconds,
            progress_interval=progress_interval,
        )
        problems = layout_problems(plan, nodes, own_ip)
        if problems:
            raise ClusterNotReadyError(
                f"the Ray cluster cannot hold the plan (packStrategy {plan.pack_strategy}): "
                + "; ".join(problems)
            )
        run_preflight(own_ip, nodes, timeout=plan.preflight_timeout_seconds)
    finally:
        raycluster.disconnect()
    command = build_command(plan, own_ip)
    env = engine_env(plan, own_ip, os.environ)
    if env[HOST_IP_ENV] != own_ip:
        log.warning(
            "%s=%s differs from this Ray node's IP %s; vLLM may pick the wrong address",
            HOST_IP_ENV,
            env[HOST_IP_ENV],
            own_ip,
        )
    if ray_address:
        env[raycluster.RAY_ADDRESS_ENV] = ray_address
    return run_engine(command, env)


def setup_logging() -> None:
    """Send the launcher's messages to stderr, whatever else configured logging."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    for old in list(log.handlers):
        log.removeHandler(old)
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def main(argv: Sequence[str] | None = None) -> int:
    """Run the launcher; return the engine's exit status or the launcher's error status."""
    args = build_parser().parse_args(argv)
    setup_logging()
    try:
        plan = read_plan(args)
        if args.dry_run:
            address, source = resolve_dry_run_address(
                args.node_ip, lambda: raycluster.try_own_node_ip(args.ray_address), os.environ
            )
            report = dry_run_report(plan, address, source, os.environ)
            json.dump(report, sys.stdout, indent=2)
            sys.stdout.write("\n")
            return 0
        if args.node_ip:
            raise LauncherError("--node-ip only applies to --dry-run; a launch asks Ray")
        return launch(plan, args.ray_address, args.progress_interval)
    except LauncherError as exc:
        log.error("%s", exc)
        return exc.exit_status
