"""`vllm-dp`: plan and render VLLMDataParallel resources offline, print the CRD, and restart
a resource through kubectl (also as the kubectl plugin `kubectl vllm-dp restart`)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, TextIO

import yaml

from vllm_dp_operator import __version__, constants
from vllm_dp_operator.api.crd import build_crd
from vllm_dp_operator.api.validation import SpecError
from vllm_dp_operator.config import RenderOptions
from vllm_dp_operator.render.manifests import (
    Resource,
    load_documents,
    parse_resource,
    render_resource,
    to_yaml,
)

EXIT_OK = 0
EXIT_ERROR = 1  # unreadable input
EXIT_INVALID = 2  # a resource breaks the API's rules


def _describe(doc: dict[str, Any]) -> str:
    meta = doc.get("metadata") or {}
    where = f"{meta.get('namespace') or 'default'}/{meta.get('name') or '<unnamed>'}"
    return f"{doc.get('kind') or '<no kind>'} {where}"


def _read(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    with open(path, encoding="utf-8") as fh:
        return fh.read()


def _load(paths: Sequence[str], err: TextIO) -> tuple[list[Resource], int]:
    """Parse every VLLMDataParallel in the files; report errors on `err` with the exit code."""
    resources: list[Resource] = []
    code = EXIT_OK
    for path in paths:
        try:
            docs = load_documents(_read(path))
        except (OSError, ValueError, yaml.YAMLError) as exc:
            print(f"error: {path}: {exc}", file=err)
            return [], EXIT_ERROR
        for doc in docs:
            if doc.get("kind") != constants.KIND:
                print(f"skipped {_describe(doc)}: not a {constants.KIND}", file=err)
                continue
            try:
                resources.append(parse_resource(doc))
            except SpecError as exc:
                print(f"error: {_describe(doc)} is invalid:", file=err)
                for field_error in exc.errors:
                    print(str(field_error), file=err)
                code = EXIT_INVALID
    if code == EXIT_OK and not resources:
        print(f"error: no {constants.KIND} found in {', '.join(paths)}", file=err)
        code = EXIT_ERROR
    return resources, code


def _options(args: argparse.Namespace) -> RenderOptions:
    return RenderOptions(default_image=args.engine_image, socket_ifname=args.socket_ifname)


def format_plan(resource: Resource, options: RenderOptions) -> str:
    """The layout table, the vllm serve command and its environment, as text."""
    spec, plan = resource.spec, resource.plan
    gpu = spec.gpu.resource_name
    lines = [
        f"{constants.KIND} {resource.namespace}/{resource.name}",
        f"  model:  {spec.model}",
        f"  image:  {spec.image or options.default_image}",
        f"  layout: DP {plan.data_parallel_size}, TP {plan.tensor_parallel_size}, "
        f"{plan.ranks_per_node} rank(s) per node, pack strategy {plan.pack_strategy}",
        f"  pods:   {plan.gpu_pods} x {plan.gpus_per_pod} {gpu} = {plan.total_gpus} GPUs",
        f"  api servers: {plan.api_servers} on the head pod (--api-server-count)",
        f"  head pod:    cpu {plan.head_cpu or 'unset'}, memory {plan.head_memory or 'unset'} "
        f"(resources plus {constants.HEAD_CPU_PER_API_SERVER} CPU and "
        f"{constants.HEAD_MEMORY_PER_API_SERVER_MI}Mi per API server)",
        "",
    ]
    rows = [("POD", "ROLE", "RANKS", "GPUS USED/REQUESTED")]
    rows += [
        (str(p.index), p.role, p.ranks_text(), f"{p.gpus}/{plan.gpus_per_pod}") for p in plan.pods
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines += [
        "  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    ]
    lines += ["", "command (on the head pod; the launcher adds --data-parallel-address):"]
    lines.append("  " + shlex.join(plan.command))
    lines.append("env:")
    lines += [f"  {name}={value}" for name, value in plan.env]
    return "\n".join(lines) + "\n"


def cmd_plan(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Print the layout of each resource, or its validation errors."""
    resources, code = _load(args.filename, err)
    options = _options(args)
    out.write("\n".join(format_plan(r, options) for r in resources))
    return code


def cmd_render(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Print every manifest the operator would create; nothing when any resource is invalid."""
    resources, code = _load(args.filename, err)
    if code != EXIT_OK:
        return code
    options = _options(args)
    docs = [m for r in resources for m in render_resource(r, options)]
    if args.output == "json":
        out.write(json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}, indent=2))
        out.write("\n")
    else:
        out.write(to_yaml(docs))
    return EXIT_OK


def cmd_crd(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Print the CustomResourceDefinition."""
    crd = build_crd()
    out.write(json.dumps(crd, indent=2) + "\n" if args.output == "json" else to_yaml([crd]))
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `vllm-dp`."""
    defaults = RenderOptions()
    parser = argparse.ArgumentParser(
        prog="vllm-dp",
        description="Plan and render VLLMDataParallel resources without a cluster.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add_input(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "-f",
            "--filename",
            action="append",
            required=True,
            metavar="FILE",
            help="YAML or JSON file with one or more resources; '-' reads stdin (repeatable)",
        )
        p.add_argument(
            "--engine-image",
            default=defaults.default_image,
            help="engine image for resources that name none (default: %(default)s)",
        )
        p.add_argument(
            "--socket-ifname",
            default=defaults.socket_ifname,
            help="NIC for Gloo and NCCL in every pod (default: %(default)s)",
        )

    plan = sub.add_parser("plan", help="print the DP layout, command and env of each resource")
    add_input(plan)
    plan.set_defaults(func=cmd_plan)

    render = sub.add_parser("render", help="print the manifests the operator would create")
    add_input(render)
    render.add_argument("-o", "--output", choices=("yaml", "json"), default="yaml")
    render.set_defaults(func=cmd_render)

    restart = sub.add_parser(
        "restart", help="restart a resource's engines on new pods, as `kubectl rollout restart` "
        "does (the vllmdp.io/restartedAt annotation, through kubectl)")
    restart.add_argument("name", help="the VLLMDataParallel")
    restart.add_argument("-n", "--namespace", help="its namespace (default: kubectl's)")
    restart.add_argument("--kubectl", default=os.environ.get("KUBECTL") or "kubectl",
                         help="the kubectl to run (default: $KUBECTL or kubectl)")
    restart.set_defaults(func=cmd_restart)

    crd = sub.add_parser("crd", help="print the CustomResourceDefinition")
    crd.add_argument("-o", "--output", choices=("yaml", "json"), default="yaml")
    crd.set_defaults(func=cmd_crd)
    return parser


def cmd_restart(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Annotate the resource with the time now: the operator replaces its pods by its update
    strategy (docs/updates.md#operator-upgrades-and-restarts)."""
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    cmd = [args.kubectl, "annotate", f"{constants.PLURAL}.{constants.GROUP}", args.name,
           "--overwrite", f"{constants.ANNOTATION_RESTARTED_AT}={now}"]  # fmt: skip
    if args.namespace:
        cmd[1:1] = ["--namespace", args.namespace]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:
        print(f"error: {args.kubectl}: {exc}", file=err)
        return EXIT_ERROR
    if proc.returncode != 0:
        print(proc.stderr.strip() or f"error: kubectl exited {proc.returncode}", file=err)
        return EXIT_ERROR
    print(f"{constants.KIND} {args.name} restarting ({constants.ANNOTATION_RESTARTED_AT}={now})",
          file=out)  # fmt: skip
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `vllm-dp` command."""
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args, sys.stdout, sys.stderr)
        sys.stdout.flush()
    except BrokenPipeError:  # e.g. `vllm-dp render ... | head`: the reader left early
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_ERROR
    return code


if __name__ == "__main__":
    sys.exit(main())
