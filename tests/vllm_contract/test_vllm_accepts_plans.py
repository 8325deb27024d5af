"""vLLM 0.33.0 itself accepts what the operator plans and the launcher runs (opt-in: -m vllm).

For every example, the operator's CLI renders the head job (`vllm-dp render -o json`), the
launcher reads the plan from its entrypoint and builds the command it would run (with
`--data-parallel-address`), and `check_with_vllm.py` runs those cases inside a cached
virtualenv holding vllm==0.33.0 and ray==2.60.0 (`install_vllm.sh`, about 9.5 GB, first
run only). Negative controls prove the check can fail: a misspelt flag, an unknown VLLM_
variable, and DP=1 on the Ray backend (vLLM resets its master IP to 127.0.0.1: vllm#51712).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from vllm_dp_launcher.cli import build_parser, read_plan
from vllm_dp_launcher.command import build_command, engine_env_overrides
from vllm_dp_launcher.plan import LaunchPlan

pytestmark = pytest.mark.vllm

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
ADDRESS = "10.0.0.1"
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
VENV = Path(os.environ.get("VLLM_CONTRACT_VENV") or CACHE / "vllm-dp-operator" / "vllm-venv")


def run_in_vllm_venv(script: str, payload: Any) -> Any:
    """Install the vLLM virtualenv (once), run one of this tier's scripts in it: JSON in, out."""
    install = subprocess.run(
        [str(HERE / "install_vllm.sh")], capture_output=True, text=True, timeout=3600, check=False
    )
    if install.returncode != 0:
        pytest.fail(f"installing vllm failed:\n{install.stdout[-3000:]}\n{install.stderr[-3000:]}")
    run = subprocess.run(
        [str(VENV / "bin" / "python"), str(HERE / script)],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-5000:]
    return json.loads(run.stdout)


def render_items(example: Path) -> list[dict[str, Any]]:
    """Render an example with the operator's CLI (`vllm-dp render -o json`)."""
    result = subprocess.run(
        [sys.executable, "-m", "vllm_dp_operator.cli", "render", "-f", str(example), "-o", "json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, f"vllm-dp render -f {example.name} failed: {result.stderr}"
    items: list[dict[str, Any]] = json.loads(result.stdout)["items"]
    return items


def plan_in_head_job(items: list[dict[str, Any]]) -> LaunchPlan:
    """The launcher's reading of the plan in the rendered head job's entrypoint."""
    (job,) = [item for item in items if item["kind"] == "RayJob"]
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:3] == ["python", "-m", "vllm_dp_launcher"], argv
    return read_plan(build_parser().parse_args(argv[3:]))


def rendered_plan(example: Path) -> LaunchPlan:
    """Render an example; parse the plan in its head job's entrypoint."""
    return plan_in_head_job(render_items(example))


def case(name: str, plan: LaunchPlan) -> dict[str, Any]:
    """The launcher's command and environment for ``plan``, and what vLLM must read from them."""
    return {
        "name": name,
        "command": build_command(plan, ADDRESS),
        "env": engine_env_overrides(plan, ADDRESS, {}),
        "expect": {
            "model": plan.model,
            "data_parallel_size": plan.data_parallel_size,
            "data_parallel_size_local": plan.ranks_per_node,
            "data_parallel_address": ADDRESS,
            "data_parallel_backend": "ray",
            "tensor_parallel_size": plan.tensor_parallel_size,
            "port": plan.port,
            "pack_strategy": plan.pack_strategy,
        },
    }


def negative_controls(plan: LaunchPlan) -> list[dict[str, Any]]:
    """Cases vLLM must refuse, derived from a good one."""
    good = case("good", plan)
    typo = [a.replace("--data-parallel-size-local", "--data-parallel-size-locale") for a in
            good["command"]]  # fmt: skip
    dp1 = ["vllm", "serve", plan.model, "--data-parallel-backend", "ray",
           "--data-parallel-size", "1", "--data-parallel-size-local", "1",
           "--data-parallel-address", ADDRESS]  # fmt: skip
    return [
        {**good, "name": "control-misspelt-flag", "command": typo},
        {**good, "name": "control-unknown-env", "env": {**good["env"], "VLLM_RAY_DP_PAK": "x"}},
        {"name": "control-dp1-ray", "command": dp1, "env": {}, "expect": {}},
    ]


@pytest.fixture(scope="module")
def vllm_results() -> dict[str, dict[str, Any]]:
    """Install (once) vLLM in the cached venv, then check every case there in one process."""
    pytest.importorskip("vllm_dp_operator.cli", reason="the operator package is not installed")
    plans = {example.stem: rendered_plan(example) for example in EXAMPLES}
    cases = [case(name, plan) for name, plan in plans.items()]
    cases += negative_controls(next(iter(plans.values())))
    results = run_in_vllm_venv("check_with_vllm.py", cases)
    return {result["name"]: result for result in results}


@pytest.mark.parametrize("example", [e.stem for e in EXAMPLES])
def test_vllm_accepts_the_launch_command(
    example: str, vllm_results: dict[str, dict[str, Any]]
) -> None:
    """vLLM's parser, EngineArgs, ParallelConfig and envs accept the example's launch."""
    result = vllm_results[example]
    assert result["ok"], json.dumps(result, indent=2)
    assert result["facts"]["distributed_executor_backend"] == "ray"


def test_the_check_can_fail(vllm_results: dict[str, dict[str, Any]]) -> None:
    """Negative controls: each is refused, for the expected reason."""
    assert "unrecognized arguments: --data-parallel-size-locale" in " ".join(
        vllm_results["control-misspelt-flag"]["errors"]
    )
    assert "vLLM does not know: VLLM_RAY_DP_PAK" in " ".join(
        vllm_results["control-unknown-env"]["errors"]
    )
    assert "changed the DP master IP to 127.0.0.1" in " ".join(
        vllm_results["control-dp1-ray"]["errors"]
    )
