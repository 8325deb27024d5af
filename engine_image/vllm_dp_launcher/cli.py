"""Command line: ``python -m vllm_dp_launcher --plan-b64 B64`` (or ``--plan``/``--plan-file``)."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from vllm_dp_launcher import drain_gate, health, raycluster, report, stages
from vllm_dp_launcher.beside import PreflightBeside
from vllm_dp_launcher.cluster import GpuNode, layout_problems, wait_for_cluster
from vllm_dp_launcher.command import (
    ADDRESS_PLACEHOLDER,
    HOST_IP_ENV,
    build_command,
    engine_env,
    engine_env_overrides,
)
from vllm_dp_launcher.errors import (
    ClusterNotReadyError,
    LauncherError,
    PlanError,
    StoppedError,
)
from vllm_dp_launcher.plan import PLAN_B64_FLAG, LaunchPlan, decode_plan, load_plan
from vllm_dp_launcher.preflight import run_preflight
from vllm_dp_launcher.supervise import FORWARDED_SIGNALS, final_status, run_engine

log = logging.getLogger("vllm_dp_launcher")
LOG_FORMAT = "%(asctime)s vllm-dp-launcher %(levelname)s %(message)s"
STAGE_FORMAT = "%(asctime)s vllm-dp-launcher %(message)s"
# Ray's job supervisor SIGKILLs every process of a stopping job this long after its SIGTERM.
STOP_WAIT_ENV = "RAY_JOB_STOP_WAIT_TIME_S"
RAY_DEFAULT_STOP_WAIT_S = 3


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
    source.add_argument(
        PLAN_B64_FLAG,
        help="the launch plan as base64 (RFC 4648 standard alphabet, no line breaks) of its "
        "UTF-8 JSON: what the operator renders, since no shell alters it",
    )
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
        help="print the plan, the exact vllm serve command and the environment it adds, as "
        "JSON (UTF-8), and exit without running vLLM",
    )
    parser.add_argument(
        "--node-ip",
        help="with --dry-run: the data-parallel address to show instead of asking Ray "
        "(asked only when --ray-address or RAY_ADDRESS says where it is)",
    )
    parser.add_argument(
        "--progress-interval",
        type=float,
        default=10.0,
        help="seconds between progress lines while waiting for the cluster (default 10)",
    )
    return parser


def read_plan(args: argparse.Namespace) -> LaunchPlan:
    """Load the plan from --plan-b64, --plan or --plan-file."""
    if args.plan_b64 is not None:
        return decode_plan(args.plan_b64)
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


def dry_run_ray_ip(ray_address: str | None, env: Mapping[str, str]) -> str | None:
    """Ask Ray for this node's IP only when told where Ray is (--ray-address or RAY_ADDRESS).

    Ray's ``auto`` would otherwise scan this machine's processes for any GCS and may attach a
    dry run to an unrelated cluster, or wait on one that does not answer.
    """
    if not (ray_address or env.get("RAY_ADDRESS")):
        return None
    return raycluster.try_own_node_ip(ray_address)


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


def check_stop_wait(plan: LaunchPlan, env: Mapping[str, str]) -> None:
    """Say how long a stop may drain, and warn when Ray would cut it shorter than planned."""
    raw = env.get(STOP_WAIT_ENV)
    try:
        # Ray's job supervisor reads it with int(): anything else breaks the job's stop.
        ray_wait = int(raw) if raw else RAY_DEFAULT_STOP_WAIT_S
    except ValueError:
        log.warning(
            "%s=%r is not an integer: Ray's job supervisor fails on it when it stops this job",
            STOP_WAIT_ENV, raw,
        )  # fmt: skip
        return
    source = f"{STOP_WAIT_ENV}={raw}" if raw else f"Ray's default, {STOP_WAIT_ENV} unset"
    if plan.drain_grace_seconds is not None and ray_wait < plan.drain_grace_seconds:
        log.warning(
            "a Ray job stop SIGKILLs vllm serve %ds after its SIGTERM (%s), before the planned "
            "drain grace of %gs; the Ray pods need %s=%d",
            ray_wait, source, plan.drain_grace_seconds, STOP_WAIT_ENV,
            math.ceil(plan.drain_grace_seconds),
        )  # fmt: skip
    else:
        log.info("a Ray job stop gives vllm serve %ds to exit (%s)", ray_wait, source)


def _raise_stopped(signum: int, _frame: object) -> None:
    """Until vllm serve runs, a stop signal ends the launch: there is nothing to drain."""
    raise StoppedError(signum)


def launch(plan: LaunchPlan, ray_address: str | None, progress_interval: float) -> int:
    """Gate on the cluster and the network, then run the engine; return the launcher's status."""
    previous = {sig: signal.signal(sig, _raise_stopped) for sig in FORWARDED_SIGNALS}
    try:
        return _launch(plan, ray_address, progress_interval)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _launch(plan: LaunchPlan, ray_address: str | None, progress_interval: float) -> int:
    stages.enter(stages.CONNECTING)
    raycluster.connect(ray_address)
    # ray.init installs its own SIGTERM handler (sys.exit); a stop must still end the launch.
    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, _raise_stopped)
    try:
        own_ip, nodes = _gate(plan, progress_interval)
    except BaseException:
        raycluster.disconnect()
        raise
    # The preflight runs beside vLLM's start (beside.py): the exec follows the last join.
    preflight = PreflightBeside(
        lambda cancelled: run_preflight(own_ip, nodes, timeout=plan.preflight_timeout_seconds,
                                        cancelled=cancelled),
        timeout=plan.preflight_timeout_seconds,
    )
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
    check_stop_wait(plan, os.environ)
    drain_gate.clear()  # a drain of an earlier head job on this pod is not this one's
    url = health.health_url(plan)
    request = health.completion_request(plan, env)

    def on_start(child: subprocess.Popen[bytes], stopping: Callable[[], bool]) -> None:
        preflight.start(child, stopping)
        health.watch(
            url,
            alive=lambda: child.poll() is None and not stopping(),
            completion=lambda: health.complete(request),
        )

    try:
        run = run_engine(command, env, drain_grace=plan.drain_grace_seconds, on_start=on_start)
        failed = preflight.settle(stopped=run.stop_signal is not None)
    finally:
        if preflight.finished:  # else still running past its cancel; the exit disconnects
            raycluster.disconnect()
    if failed is not None:
        raise failed  # the launch ends with the preflight's status and cause, said above
    status, cause = final_status(run)
    if run.stop_signal is None:
        log.error(
            "vllm serve exited with status %d although no stop signal was forwarded to it: it "
            "ended on its own (an engine died?), so this launch failed%s",
            run.status,
            f"; exiting with {status}" if status != run.status else "",
        )
    stages.enter(stages.EXITED, status=status, cause=cause, engine_status=run.status)
    return status


def _gate(plan: LaunchPlan, progress_interval: float) -> tuple[str, list[GpuNode]]:
    """This node's IP and the planned GPU nodes, once all are there with their GPUs free and
    their shape holds the plan."""
    own_ip = raycluster.own_node_ip()
    submission = raycluster.own_submission_id()
    log.info("launcher runs on Ray node %s%s", own_ip,
             f" in Ray job submission {submission}" if submission else "")  # fmt: skip
    nodes = wait_for_cluster(
        plan,
        raycluster.list_gpu_nodes,
        own_ip,
        timeout=plan.wait_timeout_seconds,
        progress_interval=progress_interval,
        find_holders=raycluster.gpu_holders,
    )
    stages.enter(stages.PREFLIGHT, nodes=len(nodes))
    problems = layout_problems(plan, nodes, own_ip)
    if problems:
        raise ClusterNotReadyError(
            f"the Ray cluster cannot hold the plan (packStrategy {plan.pack_strategy}): "
            + "; ".join(problems)
        )
    return own_ip, nodes


def setup_logging() -> Callable[[], None]:
    """Send the launcher's messages to stderr, whatever else configured logging.

    Returns a function that puts the loggers back as they were (for callers in-process).
    """
    saved = [(lg, list(lg.handlers), lg.level, lg.propagate) for lg in (log, stages.log)]
    for logger, fmt in ((log, LOG_FORMAT), (stages.log, STAGE_FORMAT)):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(fmt))
        for old in list(logger.handlers):
            logger.removeHandler(old)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    extra = report.report_handler(os.environ, STAGE_FORMAT)
    if extra is not None:
        stages.log.addHandler(extra)

    def restore() -> None:
        for logger, handlers, level, propagate in saved:
            for current in list(logger.handlers):
                logger.removeHandler(current)
            for handler in handlers:
                logger.addHandler(handler)
            logger.setLevel(level)
            logger.propagate = propagate

    return restore


def main(argv: Sequence[str] | None = None) -> int:
    """Run the launcher; return the engine's exit status or the launcher's error status."""
    args = build_parser().parse_args(argv)
    restore_logging = setup_logging()
    try:
        return _run(args)
    finally:
        restore_logging()


def _run(args: argparse.Namespace) -> int:
    try:
        plan = read_plan(args)
        if args.dry_run:
            address, source = resolve_dry_run_address(
                args.node_ip, lambda: dry_run_ray_ip(args.ray_address, os.environ), os.environ
            )
            report = dry_run_report(plan, address, source, os.environ)
            # UTF-8 whatever the locale: non-ASCII in the plan prints as itself.
            text = json.dumps(report, indent=2, ensure_ascii=False) + "\n"
            sys.stdout.flush()
            sys.stdout.buffer.write(text.encode("utf-8"))
            sys.stdout.buffer.flush()
            return 0
        if args.node_ip:
            raise LauncherError("--node-ip only applies to --dry-run; a launch asks Ray")
        return launch(plan, args.ray_address, args.progress_interval)
    except (LauncherError, StoppedError) as exc:
        log.error("%s", exc)
        if not args.dry_run:
            stages.enter(stages.EXITED, status=exc.exit_status, cause=exc.cause)
        return exc.exit_status
