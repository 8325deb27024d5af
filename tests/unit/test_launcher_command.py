"""The engine command and environment, and --dry-run's JSON."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from vllm_dp_launcher import raycluster
from vllm_dp_launcher.cli import dry_run_ray_ip, dry_run_report, main, resolve_dry_run_address
from vllm_dp_launcher.command import build_command, engine_env, engine_env_overrides
from vllm_dp_launcher.errors import PlanError
from vllm_dp_launcher.plan import LaunchPlan, parse_plan

EXAMPLE = Path(__file__).resolve().parents[2] / "engine_image" / "example-plan.json"


def example(**changes: Any) -> dict[str, Any]:
    """A fresh copy of the example plan with top-level keys changed."""
    data: dict[str, Any] = copy.deepcopy(json.loads(EXAMPLE.read_text()))
    data.update(changes)
    return data


def plan(**changes: Any) -> LaunchPlan:
    """The example plan, parsed."""
    return parse_plan(example(**changes))


def test_command_is_the_plans_plus_the_dp_address() -> None:
    """Exactly one thing is added: --data-parallel-address <ip>, at the end."""
    p = plan()
    assert build_command(p, "10.0.0.7") == [*p.command, "--data-parallel-address", "10.0.0.7"]


@pytest.mark.parametrize("arg", ["--data-parallel-address", "-dpa", "--data-parallel-address=x"])
def test_command_that_already_sets_the_address_is_refused(arg: str) -> None:
    """The address belongs to the launcher; a plan setting it is a rendering bug."""
    p = plan(command=["vllm", "serve", "m", arg, "1.2.3.4"])
    with pytest.raises(PlanError, match="already sets"):
        build_command(p, "10.0.0.7")


def test_env_sets_host_ip_and_keeps_plan_env() -> None:
    """The plan's env, VLLM_HOST_IP, and the inherited environment all reach the engine."""
    env = engine_env(plan(), "10.0.0.7", {"PATH": "/usr/bin", "HF_TOKEN": "t"})
    assert env["VLLM_HOST_IP"] == "10.0.0.7"
    assert env["NCCL_SOCKET_IFNAME"] == "eth0"
    assert env["PATH"] == "/usr/bin"
    assert env["HF_TOKEN"] == "t"
    assert env["VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"] == "GLOO_,NCCL_,HF_,VLLM_"


def test_existing_host_ip_is_kept() -> None:
    """A VLLM_HOST_IP already set (by the pod, or the plan) is not overwritten."""
    assert engine_env(plan(), "10.0.0.7", {"VLLM_HOST_IP": "10.0.0.9"})["VLLM_HOST_IP"] == (
        "10.0.0.9"
    )
    p = plan(env={"VLLM_HOST_IP": "10.0.0.8"})
    assert engine_env(p, "10.0.0.7", {})["VLLM_HOST_IP"] == "10.0.0.8"


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (None, "GLOO_,NCCL_"),
        ("HF_,VLLM_", "HF_,VLLM_,GLOO_,NCCL_"),
        ("NCCL_, HF_", "NCCL_,HF_,GLOO_"),
        ("GLOO_,NCCL_", "GLOO_,NCCL_"),
    ],
)
def test_gloo_and_nccl_prefixes_are_always_copied(given: str | None, expected: str) -> None:
    """GLOO_* and NCCL_* must reach the Ray actors, whatever the plan said."""
    env = {} if given is None else {"VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY": given}
    result = engine_env(plan(env=env), "10.0.0.7", {})
    assert result["VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"] == expected


def test_overrides_hold_only_what_the_launcher_sets() -> None:
    """The inherited environment (secrets included) is not part of the overrides."""
    overrides = engine_env_overrides(plan(env={}), "10.0.0.7", {"HF_TOKEN": "secret"})
    assert overrides == {
        "VLLM_HOST_IP": "10.0.0.7",
        "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY": "GLOO_,NCCL_",
        "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "75",
    }


def test_idle_connections_are_kept_75_s_unless_set() -> None:
    """vLLM keeps an idle connection 75 s, not its own 5 s; a setting of the plan's or the
    pod's own wins."""
    assert engine_env(plan(), None, {})["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"] == "75"
    assert engine_env(plan(env={"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "9"}), None, {})[
        "VLLM_HTTP_TIMEOUT_KEEP_ALIVE"] == "9"
    assert "VLLM_HTTP_TIMEOUT_KEEP_ALIVE" not in engine_env_overrides(
        plan(), None, {"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "20"})


@pytest.mark.parametrize(
    ("node_ip", "ray_ip", "env", "expected"),
    [
        ("10.0.0.1", "10.0.0.2", {"VLLM_HOST_IP": "10.0.0.3"}, ("10.0.0.1", "--node-ip")),
        (None, "10.0.0.2", {"VLLM_HOST_IP": "10.0.0.3"}, ("10.0.0.2", "ray")),
        (None, None, {"VLLM_HOST_IP": "10.0.0.3"}, ("10.0.0.3", "VLLM_HOST_IP")),
        (None, None, {}, ("$(VLLM_HOST_IP)", "placeholder")),
    ],
)
def test_dry_run_address_order(
    node_ip: str | None, ray_ip: str | None, env: dict[str, str], expected: tuple[str, str]
) -> None:
    """--node-ip, else Ray, else VLLM_HOST_IP, else the $(VLLM_HOST_IP) placeholder."""
    assert resolve_dry_run_address(node_ip, lambda: ray_ip, env) == expected


@pytest.mark.parametrize(
    ("ray_address", "env", "asks"),
    [
        (None, {}, False),
        ("10.0.0.9:6379", {}, True),
        (None, {"RAY_ADDRESS": "10.0.0.9:6379"}, True),
    ],
)
def test_dry_run_asks_ray_only_when_told_where_it_is(
    ray_address: str | None, env: dict[str, str], asks: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No `auto` discovery: it scans local processes and may find an unrelated cluster."""
    asked: list[str | None] = []
    monkeypatch.setattr(raycluster, "try_own_node_ip", lambda a: asked.append(a) or "10.0.0.2")
    assert dry_run_ray_ip(ray_address, env) == ("10.0.0.2" if asks else None)
    assert asked == ([ray_address] if asks else [])


def test_dry_run_with_placeholder_sets_no_host_ip() -> None:
    """The placeholder goes into the command but not into VLLM_HOST_IP."""
    report = dry_run_report(plan(), "$(VLLM_HOST_IP)", "placeholder", {})
    assert report["command"][-2:] == ["--data-parallel-address", "$(VLLM_HOST_IP)"]
    assert "VLLM_HOST_IP" not in report["env"]


def test_dry_run_cli_prints_plan_command_and_env(capsys: pytest.CaptureFixture[str]) -> None:
    """--dry-run --node-ip prints JSON and exits 0 without touching Ray or vLLM."""
    status = main(["--plan", EXAMPLE.read_text(), "--dry-run", "--node-ip", "10.1.2.3"])

    assert status == 0
    report = json.loads(capsys.readouterr().out)
    assert report["plan"] == example()
    assert report["dataParallelAddress"] == "10.1.2.3"
    assert report["dataParallelAddressSource"] == "--node-ip"
    assert report["command"] == [*example()["command"], "--data-parallel-address", "10.1.2.3"]
    assert report["env"]["VLLM_HOST_IP"] == "10.1.2.3"
    assert report["env"]["VLLM_RAY_DP_PACK_STRATEGY"] == "strict"


def test_dry_run_reads_plan_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--plan-file works the same as --plan."""
    path = tmp_path / "plan.json"
    path.write_text(EXAMPLE.read_text())
    assert main(["--plan-file", str(path), "--dry-run", "--node-ip", "10.1.2.3"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["model"] == "Qwen/Qwen2.5-7B-Instruct"


def test_bad_plan_exits_2_with_the_key(capsys: pytest.CaptureFixture[str]) -> None:
    """A plan error is a clear message and exit status 2."""
    data = example()
    del data["ranksPerNode"]
    assert main(["--plan", json.dumps(data), "--dry-run", "--node-ip", "10.1.2.3"]) == 2
    assert "missing required key 'ranksPerNode'" in capsys.readouterr().err


def test_ray_client_address_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """ray:// is refused before any connection is tried (vllm#14349)."""
    status = main(["--plan", EXAMPLE.read_text(), "--ray-address", "ray://head:10001"])
    assert status == 1
    assert "ray:// (Ray Client) address is not supported" in capsys.readouterr().err


def test_ray_client_address_in_env_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """RAY_ADDRESS=ray://... is refused too: vLLM would read it."""
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    assert main(["--plan", EXAMPLE.read_text()]) == 1
    assert "RAY_ADDRESS=ray://head:10001" in capsys.readouterr().err


def test_node_ip_outside_dry_run_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """In a launch, the address comes from Ray, never from a flag."""
    assert main(["--plan", EXAMPLE.read_text(), "--node-ip", "10.1.2.3"]) == 1
    assert "--node-ip only applies to --dry-run" in capsys.readouterr().err
