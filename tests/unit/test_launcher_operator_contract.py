"""The operator's rendered head job, read by the launcher: one contract, checked from both ends.

Every example is rendered with the operator's CLI (`vllm-dp render -o json`, in process); the RayJob
entrypoint must be `python -m vllm_dp_launcher --plan-b64 <B64>` (from
`vllm_dp_launcher.plan.head_job_entrypoint`), the launcher must parse that plan,
run through `/bin/sh -c` it must print the operator's argv, and a Ray cluster shaped as the
plan says (gpuPods nodes of gpusPerPod GPUs) must pass the launcher's own wait and layout
checks.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest
from vllm_dp_launcher.cli import build_parser, dry_run_report, read_plan
from vllm_dp_launcher.cluster import GpuNode, layout_problems, progress

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def head_job_entrypoint(example: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """Render one example with the operator's CLI and return its RayJob entrypoint."""
    cli = pytest.importorskip("vllm_dp_operator.cli", reason="the operator is not installed")
    capsys.readouterr()
    assert cli.main(["render", "-f", str(example), "-o", "json"]) == 0
    items: list[dict[str, Any]] = json.loads(capsys.readouterr().out)["items"]
    (job,) = [item for item in items if item["kind"] == "RayJob"]
    return str(job["spec"]["entrypoint"])


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_rendered_plan_is_accepted_by_the_launcher(
    example: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Entrypoint shape, plan parsing, dry-run command, and the cluster checks all agree."""
    argv = shlex.split(head_job_entrypoint(example, capsys))
    assert argv[:4] == ["python", "-m", "vllm_dp_launcher", "--plan-b64"]
    plan = read_plan(build_parser().parse_args(argv[3:]))

    nodes = [
        GpuNode(f"{i:056x}", f"10.0.0.{i + 1}", plan.gpus_per_pod) for i in range(plan.gpu_pods)
    ]
    assert progress(plan, nodes).ready
    assert layout_problems(plan, nodes, own_ip=nodes[0].ip) == []

    report = dry_run_report(plan, "10.0.0.1", "--node-ip", {})
    assert report["command"] == [*plan.command, "--data-parallel-address", "10.0.0.1"]
    assert report["command"][:2] == ["vllm", "serve"]
    assert report["env"]["VLLM_RAY_DP_PACK_STRATEGY"] == plan.pack_strategy


def test_there_are_examples() -> None:
    """The parametrised test above must not pass by having nothing to check."""
    assert len(EXAMPLES) >= 3


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_render_and_launcher_dry_run_agree_on_the_command(
    example: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The real `python -m vllm_dp_launcher ... --dry-run` prints the operator plan's command."""
    import subprocess
    import sys

    import yaml
    from vllm_dp_operator.api.validation import validate
    from vllm_dp_operator.plan import build_plan

    doc = yaml.safe_load(example.read_text())
    want = build_plan(validate(doc["metadata"]["name"], doc["spec"]))
    argv = shlex.split(head_job_entrypoint(example, capsys))
    proc = subprocess.run(
        [sys.executable, *argv[1:], "--dry-run", "--node-ip", "10.1.2.3"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    report = json.loads(proc.stdout)
    assert report["command"] == [*want.command, "--data-parallel-address", "10.1.2.3"]
    assert {k: report["env"][k] for k, _ in want.env} == dict(want.env)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_rendered_entrypoint_runs_through_sh_as_ray_runs_it(
    example: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The entrypoint string, run by ``/bin/sh -c`` as Ray's job supervisor does, with
    ``--dry-run`` appended, prints exactly the operator plan's argv."""
    import os
    import subprocess
    import sys

    import yaml
    from vllm_dp_operator.api.validation import validate
    from vllm_dp_operator.plan import build_plan

    doc = yaml.safe_load(example.read_text())
    want = build_plan(validate(doc["metadata"]["name"], doc["spec"]))
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(
        ["/bin/sh", "-c", head_job_entrypoint(example, capsys) + " --dry-run --node-ip 10.1.2.3"],
        capture_output=True, timeout=60, check=True, env=env,
    )  # fmt: skip
    report = json.loads(proc.stdout.decode("utf-8"))
    assert report["command"] == [*want.command, "--data-parallel-address", "10.1.2.3"]
