"""The head job's entrypoint survives the shells that run it.

Ray's job supervisor runs a job's entrypoint with `/bin/sh -c` (HTTPMode); KubeRay's
K8sJobMode first put it, unquoted, into a bash script whose `ray job submit` re-joins the
words for that same `/bin/sh -c`. Values with `$HOME`, a backtick, `;`, `(` or non-ASCII text in
engineArgs, env or the model must reach `vllm serve` unchanged. The plan travels as base64, so
the entrypoint holds no character any shell or quoting layer treats specially, and each path,
run for real with ` --dry-run` appended, prints exactly the planned argv and environment.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from vllm_dp_operator.api.validation import validate
from vllm_dp_operator.plan import Plan, build_plan
from vllm_dp_operator.render import build_head_job

NASTY = "$HOME `id` ; (echo pwned > x) 'q' \"dq\" \\ ünïcødé 模型 $(uname) && | *"
RAW: dict[str, Any] = {
    "model": f"/models/{NASTY}",
    "servedModelName": "モデル (v1); `whoami`",
    "dataParallel": {"size": 4, "ranksPerNode": 2},
    "engineArgs": [f"--chat-template={NASTY}", "--some-flag", "$HOME;`x`(y)"],
    "env": [{"name": "NASTY", "value": NASTY}, {"name": "HOME_REF", "value": "${HOME:-x}"}],
}
# What KubeRay's K8sJobMode submitter did with the entrypoint: `ray job submit ... -- <it> ;`
# in a bash script; Ray's CLI then shlex-joins the words it got for the supervisor's sh -c.
RAY_JOB_SUBMIT = (
    "import shlex, subprocess, sys; words = sys.argv[2:]; "  # argv[1] is the "--"
    "sys.exit(subprocess.call(shlex.join(words), shell=True))"
)


def _rendered() -> tuple[str, Plan]:
    spec = validate("demo", RAW)
    plan = build_plan(spec)
    job = build_head_job("demo", "ns", spec, plan, "demo-abcde", 1, None)
    return str(job["spec"]["entrypoint"]), plan


def test_entrypoint_holds_nothing_a_shell_would_touch() -> None:
    entrypoint, _ = _rendered()
    # Words of letters, digits and base64's + / =: no quote, $, `, ;, (, space run or non-ASCII.
    assert re.fullmatch(r"[A-Za-z0-9_.+/=-]+( [A-Za-z0-9_.+/=-]+)*", entrypoint), entrypoint


def _argv(path: str, entrypoint: str) -> list[str]:
    line = f"{entrypoint} --dry-run"
    if path == "sh":  # HTTPMode: the job supervisor's Popen(shell=True)
        return ["/bin/sh", "-c", line]
    return ["/bin/bash", "-ce", f"{shlex.quote(sys.executable)} -c {shlex.quote(RAY_JOB_SUBMIT)}"
            f" -- {line} ;"]  # fmt: skip


@pytest.mark.parametrize("path", ["sh", "k8s-job-mode"])
def test_shells_run_the_entrypoint_and_the_launcher_sees_the_exact_argv(
    path: str, tmp_path: Path
) -> None:
    entrypoint, plan = _rendered()
    # `python` in the entrypoint is this interpreter, as it is the engine image's on the head.
    bindir = tmp_path / "bin"
    bindir.mkdir()
    wrapper = bindir / "python"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(PATH=f"{bindir}{os.pathsep}{env.get('PATH', '')}", HOME=str(tmp_path))
    proc = subprocess.run(_argv(path, entrypoint), capture_output=True, env=env, timeout=120,
                          check=False, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-3000:]
    report = json.loads(proc.stdout.decode("utf-8"))
    command = report["command"]
    assert command[:-2] == list(plan.command)  # exactly the planned vllm serve argv
    assert command[:3] == ["vllm", "serve", RAW["model"]]
    assert command[-2] == "--data-parallel-address"
    for name, value in plan.env:
        assert report["env"][name] == value
    assert report["env"]["NASTY"] == NASTY
    assert not (tmp_path / "x").exists()  # nothing in it was run by a shell
