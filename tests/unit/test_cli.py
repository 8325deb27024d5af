"""`vllm-dp plan | render | crd`, offline, on the examples and on broken input."""

from __future__ import annotations

import io
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from vllm_dp_operator.api.crd import build_crd
from vllm_dp_operator.api.validation import validate
from vllm_dp_operator.cli import build_parser, main
from vllm_dp_operator.plan import build_plan

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
INVALID = """\
apiVersion: vllmdp.io/v1alpha1
kind: VLLMDataParallel
metadata:
  name: broken
spec:
  model: Qwen/Qwen2.5-7B-Instruct
  dataParallel: {size: 6, ranksPerNode: 4}
  engineArgs: ["--tensor-parallel-size=2"]
  resources: {memory: 12GB}
"""


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def stdin(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))


def resource(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "vllmdp.io/v1alpha1",
        "kind": "VLLMDataParallel",
        "metadata": {"name": name},
        "spec": spec,
    }


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_plan_every_example(example: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "plan", "-f", str(example))
    assert (code, err) == (0, "")
    doc = yaml.safe_load(example.read_text())
    plan = build_plan(validate(doc["metadata"]["name"], doc["spec"]))
    assert f"default/{doc['metadata']['name']}" in out
    assert shlex.join(plan.command) in out
    for name, value in plan.env:
        assert f"{name}={value}" in out
    rows = [line.split() for line in out.splitlines() if line.strip().split(" ")[0].isdigit()]
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [
        (str(p.index), p.role, p.ranks_text(), f"{p.gpus}/{plan.gpus_per_pod}") for p in plan.pods
    ]
    # The API-server count is a plan value, and the head pod is sized for it.
    servers = doc["spec"].get("apiServerCount") or doc["spec"]["dataParallel"]["size"]
    assert f"api servers: {servers} on the head pod" in out
    assert f"--api-server-count {servers}" in out
    head = f"head pod:    cpu {plan.head_cpu or 'unset'}, memory {plan.head_memory or 'unset'}"
    assert head in out


def test_plan_shows_the_head_sized_for_its_api_servers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = yaml.safe_load((REPO / "examples" / "dp8-rpn4-tp1.yaml").read_text())
    doc["spec"]["resources"] = {"cpu": "8", "memory": "64Gi"}
    doc["spec"]["apiServerCount"] = 3
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(doc))
    code, out, _ = run(capsys, "plan", "-f", str(path))
    assert code == 0
    assert "api servers: 3 on the head pod" in out
    assert "head pod:    cpu 11, memory 70Gi" in out  # 8 + 3x1 CPU, 64Gi + 3x2Gi


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_render_every_example(example: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "render", "-f", str(example))
    assert (code, err) == (0, "")
    docs = list(yaml.safe_load_all(out))
    assert [d["kind"] for d in docs] == ["NetworkPolicy", "NetworkPolicy", "RayCluster", "Service",
                                         "EndpointSlice", "RayJob"]  # fmt: skip
    name = yaml.safe_load(example.read_text())["metadata"]["name"]
    for doc in docs:
        assert doc["metadata"]["namespace"] == "default"
        assert doc["metadata"]["labels"]["app.kubernetes.io/instance"] == name
        assert "ownerReferences" not in doc["metadata"]  # no uid without a cluster
    _api_policy, policy, cluster, service, eps, job = docs
    assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == name
    assert "selector" not in service["spec"]
    assert eps["metadata"]["labels"]["kubernetes.io/service-name"] == service["metadata"]["name"]
    assert eps["endpoints"] == []  # the head pod's address is known only once it runs
    assert job["spec"]["clusterSelector"]["ray.io/cluster"] == cluster["metadata"]["name"]
    assert job["metadata"]["name"] == f"{name}-j00001"
    # HTTPMode: the dashboard API takes the job; no submitter pod follows its logs.
    assert job["spec"]["submissionMode"] == "HTTPMode"
    assert "submitterPodTemplate" not in job["spec"] and "submitterConfig" not in job["spec"]


def test_render_json_is_a_list(capsys: pytest.CaptureFixture[str]) -> None:
    example = REPO / "examples" / "dp8-rpn4-tp1.yaml"
    code, out, _ = run(capsys, "render", "-f", str(example), "-o", "json")
    assert code == 0
    doc = json.loads(out)
    assert (doc["apiVersion"], doc["kind"]) == ("v1", "List")
    _, yaml_out, _ = run(capsys, "render", "-f", str(example))
    assert doc["items"] == list(yaml.safe_load_all(yaml_out))


def test_render_engine_image_and_namespace(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    doc = resource("q", model="m", dataParallel={"size": 2, "ranksPerNode": 1})
    doc["metadata"]["namespace"] = "serving"
    stdin(monkeypatch, yaml.safe_dump(doc))
    code, out, _ = run(capsys, "render", "-f", "-", "--engine-image", "reg/engine:7")
    assert code == 0
    api_policy, policy, cluster, service, eps, job = yaml.safe_load_all(out)
    docs = (api_policy, policy, cluster, service, eps, job)
    assert {d["metadata"]["namespace"] for d in docs} == {"serving"}
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["image"] == "reg/engine:7"


def test_stdin_with_several_documents_and_other_kinds(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = [
        resource("one", model="m", dataParallel={"size": 2, "ranksPerNode": 1}),
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf"}},
        None,
        resource("two", model="m", dataParallel={"size": 4, "ranksPerNode": 2}, suspend=True),
    ]
    stdin(monkeypatch, yaml.safe_dump_all(docs))
    code, out, err = run(capsys, "render", "-f", "-")
    assert code == 0
    kinds = [
        (d["kind"], d["metadata"]["labels"]["app.kubernetes.io/instance"])
        for d in yaml.safe_load_all(out)
    ]
    # A suspended resource gets its (suspended) cluster, and no Service, slice or head job.
    assert kinds == [
        ("NetworkPolicy", "one"),
        ("NetworkPolicy", "one"),
        ("RayCluster", "one"),
        ("Service", "one"),
        ("EndpointSlice", "one"),
        ("RayJob", "one"),
        ("NetworkPolicy", "two"),
        ("NetworkPolicy", "two"),
        ("RayCluster", "two"),
    ]
    assert "skipped Secret default/hf" in err

    stdin(monkeypatch, yaml.safe_dump_all(docs))
    code, out, _ = run(capsys, "plan", "-f", "-")
    assert code == 0
    assert "default/one" in out and "default/two" in out


@pytest.mark.parametrize("command", ["plan", "render"])
def test_invalid_file_exits_2_naming_fields(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(INVALID)
    code, out, err = run(capsys, command, "-f", str(path))
    assert code == 2
    assert out == ""
    lines = err.splitlines()
    assert lines[0] == "error: VLLMDataParallel default/broken is invalid:"
    assert any(line.startswith("spec.resources.memory: ") for line in lines)
    path.write_text(INVALID.replace("memory: 12GB", "memory: 12Gi"))
    code, _, err = run(capsys, command, "-f", str(path))
    assert code == 2
    assert err.splitlines()[1:] == [
        "spec.dataParallel.size: must be a multiple of dataParallel.ranksPerNode with "
        "packStrategy strict (every pod holds exactly ranksPerNode ranks); use fill for a "
        "partial last pod",
        "spec.engineArgs: must not set --tensor-parallel-size or an abbreviation of it, which the "
        "operator owns; use "
        "spec.tensorParallelSize",
    ]


def test_invalid_among_valid_renders_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(INVALID)
    code, out, err = run(capsys, "render", "-f", str(EXAMPLES[0]), "-f", str(bad))
    assert (code, out) == (2, "")
    assert "broken is invalid" in err


def test_name_kind_and_api_version_checked(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    doc = resource("x" * 41, model="m", dataParallel={"size": 2, "ranksPerNode": 1})
    doc["apiVersion"] = "vllmdp.io/v2"
    stdin(monkeypatch, yaml.safe_dump(doc))
    code, _, err = run(capsys, "plan", "-f", "-")
    assert code == 2
    assert "apiVersion: must be vllmdp.io/v1alpha1" in err
    assert "metadata.name: must be at most 40 characters" in err


def test_unreadable_input_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "plan", "-f", str(tmp_path / "missing.yaml"))
    assert code == 1 and "missing.yaml" in err
    broken = tmp_path / "broken.yaml"
    broken.write_text("spec: [unclosed\n")
    code, _, err = run(capsys, "render", "-f", str(broken))
    assert code == 1 and "broken.yaml" in err
    empty = tmp_path / "empty.yaml"
    empty.write_text("---\n")
    code, _, err = run(capsys, "render", "-f", str(empty))
    assert code == 1 and "no VLLMDataParallel" in err


@pytest.mark.parametrize("output", ["yaml", "json"])
def test_crd(output: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "crd", "-o", output)
    assert code == 0
    assert (json.loads(out) if output == "json" else yaml.safe_load(out)) == build_crd()


def test_console_script_runs_without_a_cluster(tmp_path: Path) -> None:
    """The installed entry point, in a fresh process with no kubeconfig."""
    script = Path(sys.executable).with_name("vllm-dp")
    if not script.exists():
        pytest.skip("vllm-dp console script not installed in this environment")
    example = REPO / "examples" / "span.yaml"
    result = subprocess.run(
        [str(script), "plan", "-f", "-"],
        input=example.read_text(),
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "4 x 8 nvidia.com/gpu = 32 GPUs" in result.stdout


def test_restart_annotates_the_resource_through_kubectl(tmp_path: Path) -> None:
    # A test double for kubectl: it records its arguments.
    seen = tmp_path / "argv"
    kubectl = tmp_path / "kubectl"
    kubectl.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {seen}\n')
    kubectl.chmod(0o755)
    out, err = io.StringIO(), io.StringIO()
    args = build_parser().parse_args(["restart", "demo", "-n", "team-a",
                                      "--kubectl", str(kubectl)])  # fmt: skip
    assert args.func(args, out, err) == 0, err.getvalue()
    argv = seen.read_text().split("\n")
    assert argv[:5] == ["--namespace", "team-a", "annotate", "vllmdataparallels.vllmdp.io",
                        "demo"]
    assert "--overwrite" in argv
    [stamp] = [a for a in argv if a.startswith("vllmdp.io/restartedAt=")]
    assert re.fullmatch(r"vllmdp\.io/restartedAt=\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", stamp)
    assert "restarting" in out.getvalue()


def test_restart_says_what_kubectl_said_when_it_fails(tmp_path: Path) -> None:
    kubectl = tmp_path / "kubectl"
    kubectl.write_text('#!/bin/sh\necho "Error from server (NotFound): not found" >&2\nexit 1\n')
    kubectl.chmod(0o755)
    out, err = io.StringIO(), io.StringIO()
    args = build_parser().parse_args(["restart", "gone", "--kubectl", str(kubectl)])
    assert args.func(args, out, err) == 1
    assert "NotFound" in err.getvalue()
