"""The plan's shell-safe transport: ``--plan-b64``, through the shells that run the entrypoint.

The head job's entrypoint reaches the launcher through ``/bin/sh -c`` (Ray's job supervisor,
which KubeRay's HTTPMode uses) or through bash, ``list2cmdline`` and ``/bin/sh -c``
(K8sJobMode). Values with ``$HOME``, backticks, ``;``, ``(`` or non-ASCII text must arrive
untouched: the entrypoint run that way with ``--dry-run`` prints exactly the planned argv.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_dp_launcher.cli import main
from vllm_dp_launcher.errors import PlanError
from vllm_dp_launcher.plan import (
    LaunchPlan,
    PodPlan,
    decode_plan,
    encode_plan,
    head_job_entrypoint,
)

HOSTILE = [
    "$HOME",
    "${PATH}",
    "`id`",
    "$(id)",
    "a;b",
    "x && y || z",
    "(sub)",
    "'single' \"double\"",
    "back\\slash",
    "*.glob?",
    "tab\tnew\nline",
    "Qwen/Qwen2.5-7B-Instruct-é-模型-🚀",
    "",
]
NODE_IP = "10.9.8.7"


def hostile_plan() -> LaunchPlan:
    """A valid plan whose model, engine args and env hold every awkward value."""
    model = "org/$HOME`id`;(x)-模型"
    command = (
        *("vllm", "serve", model, "--port", "8000", "--data-parallel-backend", "ray"),
        *("--served-model-name", *HOSTILE[:-1], "--chat-template", "{{ $x }}; `y` (z)"),
    )
    return LaunchPlan(
        version=1,
        model=model,
        data_parallel_size=2,
        ranks_per_node=1,
        tensor_parallel_size=1,
        pack_strategy="strict",
        gpu_pods=2,
        gpus_per_pod=1,
        total_gpus=2,
        pods=(PodPlan(0, "head", (0,), 1), PodPlan(1, "worker", (1,), 1)),
        port=8000,
        command=command,
        env={f"VAR_{i}": value for i, value in enumerate(HOSTILE)},
    )


def test_encoding_is_standard_base64_of_the_utf8_json() -> None:
    """The contract: RFC 4648 standard alphabet, no line breaks, of to_json_dict's JSON."""
    plan = hostile_plan()
    text = encode_plan(plan)
    assert "\n" not in text
    assert set(text) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=")
    assert json.loads(base64.b64decode(text).decode("utf-8")) == plan.to_json_dict()
    assert decode_plan(text) == plan


def test_entrypoint_is_the_launcher_with_the_encoded_plan() -> None:
    """One function renders the whole entrypoint; nothing in it needs quoting."""
    plan = hostile_plan()
    assert head_job_entrypoint(plan) == f"python -m vllm_dp_launcher --plan-b64 {encode_plan(plan)}"


def _run_sh(command: str, env: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
    """Run a command string the way Ray's job supervisor does (``/bin/sh -c``)."""
    return subprocess.run(
        ["/bin/sh", "-c", command], env=env, capture_output=True, timeout=60, check=False
    )


def _shell_env(tmp_path: Path) -> dict[str, str]:
    """An environment where ``python`` is this interpreter and no UTF-8 locale is set."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # A wrapper, not a symlink: a virtual environment's python finds it from its own path.
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (bin_dir / "python").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LC_", "LANG"))}
    env.pop("PYTHONIOENCODING", None)
    env.pop("VLLM_HOST_IP", None)
    return {**env, "PATH": f"{bin_dir}{os.pathsep}{env['PATH']}", "LANG": "C", "HOME": "/nohome"}


def _k8s_job_mode(entrypoint: str, env: dict[str, str]) -> str:
    """K8sJobMode: bash splits the entrypoint, ``ray job submit`` re-joins it (list2cmdline)."""
    joiner = "import subprocess, sys; sys.stdout.write(subprocess.list2cmdline(sys.argv[1:]))"
    result = subprocess.run(
        ["bash", "-c", f"python -c '{joiner}' {entrypoint}"],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return result.stdout


@pytest.mark.parametrize("mode", ["HTTPMode", "K8sJobMode"])
def test_entrypoint_through_the_shell_prints_the_planned_argv(tmp_path: Path, mode: str) -> None:
    """``<entrypoint> --dry-run`` under /bin/sh -c prints the plan's argv byte for byte."""
    plan = hostile_plan()
    env = _shell_env(tmp_path)
    entrypoint = head_job_entrypoint(plan) + f" --dry-run --node-ip {NODE_IP}"
    if mode == "K8sJobMode":
        entrypoint = _k8s_job_mode(entrypoint, env)

    result = _run_sh(entrypoint, env)

    assert result.returncode == 0, result.stderr.decode(errors="replace")
    report = json.loads(result.stdout.decode("utf-8"))
    assert report["command"] == [*plan.command, "--data-parallel-address", NODE_IP]
    assert report["plan"] == plan.to_json_dict()
    assert {k: report["env"][k] for k in plan.env} == dict(plan.env)
    assert "模型" in result.stdout.decode("utf-8"), "non-ASCII is printed as itself"


def test_the_old_quoted_json_is_not_shell_safe_through_k8s_job_mode(tmp_path: Path) -> None:
    """Why base64: the same plan as shell-quoted JSON fails or is mangled on that path."""
    import shlex

    plan = hostile_plan()
    env = _shell_env(tmp_path)
    doc = json.dumps(plan.to_json_dict(), sort_keys=True, separators=(",", ":"))
    entrypoint = (
        f"python -m vllm_dp_launcher --plan {shlex.quote(doc)} --dry-run --node-ip {NODE_IP}"
    )
    result = _run_sh(_k8s_job_mode(entrypoint, env), env)
    want = [*plan.command, "--data-parallel-address", NODE_IP]
    assert result.returncode != 0 or json.loads(result.stdout)["command"] != want


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("not base64!", "not valid base64"),
        ("eyJ", "not valid base64"),  # bad padding
        ("eyJ9-_", "not valid base64"),  # URL-safe alphabet
        ("eyJ2\nIjoxfQ==", "not valid base64"),  # a line break
        ("ZsO8cg==\u00e9", "not valid base64"),  # non-ASCII
        (_b64(b"\xff\xfe{}"), "the decoded bytes are not UTF-8"),
        (_b64(b"{version: 1"), "the decoded text is not JSON"),
        ("", "the decoded text is not JSON"),
        (_b64(b"[1, 2]"), "launch plan: must be a JSON object"),
        (_b64(b'{"version": 1}'), "missing required key"),
    ],
)
def test_bad_plan_b64_is_named(
    value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every way --plan-b64 can be wrong exits 2 with an error naming the flag and the rule."""
    with pytest.raises(PlanError, match=message) as err:
        decode_plan(value)
    assert str(err.value).startswith("--plan-b64: ")

    assert main(["--plan-b64", value, "--dry-run", "--node-ip", NODE_IP]) == 2
    stderr = capsys.readouterr().err
    assert "--plan-b64: " in stderr
    assert message.split(":")[0] in stderr


def test_plan_b64_and_plan_are_exclusive(capsys: pytest.CaptureFixture[str]) -> None:
    """One source of the plan only."""
    with pytest.raises(SystemExit) as exit_:
        main(["--plan-b64", encode_plan(hostile_plan()), "--plan", "{}"])
    assert exit_.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
