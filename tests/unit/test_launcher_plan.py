"""Parsing the launch plan: the typed form, unknown keys, and errors that name the key."""

from __future__ import annotations

import copy
import dataclasses
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from vllm_dp_launcher.errors import PlanError
from vllm_dp_launcher.plan import (
    LaunchPlan,
    PodPlan,
    decode_plan,
    encode_plan,
    load_plan,
    parse_plan,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "engine_image" / "example-plan.json"


def example() -> dict[str, Any]:
    """A fresh copy of the example plan (two pods of four GPUs, strict)."""
    return copy.deepcopy(json.loads(EXAMPLE.read_text()))


def test_example_plan_parses_into_typed_fields() -> None:
    """Every field lands in its typed attribute."""
    plan = load_plan(EXAMPLE.read_text())

    assert plan.model == "Qwen/Qwen2.5-7B-Instruct"
    assert (plan.data_parallel_size, plan.ranks_per_node, plan.tensor_parallel_size) == (8, 4, 1)
    assert plan.pack_strategy == "strict"
    assert (plan.gpu_pods, plan.gpus_per_pod, plan.total_gpus) == (2, 4, 8)
    assert plan.head_pod.ranks == (0, 1, 2, 3)
    assert plan.pods[1].role == "worker"
    assert plan.command[:2] == ("vllm", "serve")
    assert plan.env["VLLM_RAY_DP_PACK_STRATEGY"] == "strict"
    assert (plan.wait_timeout_seconds, plan.preflight_timeout_seconds) == (900.0, 30.0)


def test_round_trip_keeps_the_operators_camel_case() -> None:
    """to_json_dict gives back what was parsed."""
    data = example()
    assert parse_plan(data).to_json_dict() == data


def test_unknown_keys_are_ignored() -> None:
    """A newer operator may add keys; this launcher ignores them."""
    data = example()
    data["somethingNew"] = {"x": 1}
    data["pods"][0]["zone"] = "a"
    assert parse_plan(data).model == "Qwen/Qwen2.5-7B-Instruct"


def test_timeouts_and_env_are_optional() -> None:
    """Without them the defaults apply (900 s wait, 30 s preflight, no extra env)."""
    data = example()
    for key in ("env", "waitTimeoutSeconds", "preflightTimeoutSeconds"):
        del data[key]
    plan = parse_plan(data)
    assert (plan.wait_timeout_seconds, plan.preflight_timeout_seconds, plan.env) == (900, 30, {})


@pytest.mark.parametrize(
    "key",
    ["version", "model", "dataParallelSize", "ranksPerNode", "tensorParallelSize",
     "packStrategy", "gpuPods", "gpusPerPod", "totalGpus", "pods", "port", "command"],
)  # fmt: skip
def test_missing_required_key_is_named(key: str) -> None:
    """The error names the missing key."""
    data = example()
    del data[key]
    with pytest.raises(PlanError, match=f"missing required key '{key}'"):
        parse_plan(data)


def test_missing_pod_key_is_named_with_its_index() -> None:
    """Keys inside pods are named with their position."""
    data = example()
    del data["pods"][1]["gpus"]
    with pytest.raises(PlanError, match=r"missing required key 'pods\[1\]\.gpus'"):
        parse_plan(data)


@pytest.mark.parametrize("version", [0, 2, "1", None])
def test_other_versions_are_refused(version: object) -> None:
    """Only version 1 is understood."""
    data = example()
    data["version"] = version
    with pytest.raises(PlanError, match="unsupported 'version'"):
        parse_plan(data)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("packStrategy", "spread", "'packStrategy' must be one of strict, fill, span"),
        ("dataParallelSize", "8", "'dataParallelSize' must be an integer"),
        ("dataParallelSize", True, "'dataParallelSize' must be an integer"),
        ("ranksPerNode", 0, "'ranksPerNode' must be >= 1"),
        ("command", [], "'command' must be a non-empty list"),
        ("command", ["vllm", 8], r"'command\[1\]' must be a string"),
        ("env", {"A": 1}, "'env.A' must be a string"),
        ("waitTimeoutSeconds", -1, "'waitTimeoutSeconds' must be a positive number"),
        ("pods", [], "'pods' must be a non-empty list"),
    ],
)
def test_wrong_types_are_named(key: str, value: object, message: str) -> None:
    """A value of the wrong type or range is reported with its key."""
    data = example()
    data[key] = value
    with pytest.raises(PlanError, match=message):
        parse_plan(data)


def test_inconsistent_plan_is_refused() -> None:
    """Pods that contradict gpuPods/gpusPerPod, or lack a single head, are rendering bugs."""
    data = example()
    data["pods"][1]["gpus"] = 8
    with pytest.raises(PlanError, match=r"pods\[1\] uses 8 GPUs but 'gpusPerPod' is 4"):
        parse_plan(data)
    data = example()
    data["pods"][1]["role"] = "head"
    with pytest.raises(PlanError, match="exactly one head pod, found 2"):
        parse_plan(data)
    data = example()
    data["gpuPods"] = 3
    with pytest.raises(PlanError, match="'gpuPods' is 3 but 'pods' lists 2 pods"):
        parse_plan(data)


def test_span_plan_with_repeated_ranks_parses() -> None:
    """For span, one rank's TP group covers several pods: the rank repeats across pods."""
    data = example()
    data.update(packStrategy="span", dataParallelSize=1, ranksPerNode=1, tensorParallelSize=8)
    data["pods"][0]["ranks"] = data["pods"][1]["ranks"] = [0]
    plan = parse_plan(data)
    assert [p.ranks for p in plan.pods] == [(0,), (0,)]


def test_invalid_json_is_a_plan_error() -> None:
    """Bad JSON text is reported as such."""
    with pytest.raises(PlanError, match="not valid JSON"):
        load_plan("{")
    with pytest.raises(PlanError, match="must be a JSON object"):
        load_plan("[]")


# One definition of the plan: the operator builds a LaunchPlan and calls to_json_dict().
TEXT = ["a", "Qwen/Qwen2.5-7B", "$HOME", "`id`", "a;b", "(x)", "é模型🚀", "", " ", "\\", '"']


def random_plan(rng: random.Random) -> LaunchPlan:
    """A valid plan with random shape, strings and optional fields."""
    gpus_per_pod = rng.randint(1, 8)
    pods = rng.randint(1, 5)
    strategy = rng.choice(["strict", "fill", "span"])
    word = lambda: "".join(rng.choice(TEXT) for _ in range(rng.randint(1, 4))) or "x"  # noqa: E731
    return LaunchPlan(
        version=1,
        model=word(),
        data_parallel_size=rng.randint(1, 64),
        ranks_per_node=rng.randint(1, 8),
        tensor_parallel_size=rng.randint(1, 8),
        pack_strategy=strategy,
        gpu_pods=pods,
        gpus_per_pod=gpus_per_pod,
        total_gpus=pods * gpus_per_pod,
        pods=[
            PodPlan(
                i,
                "head" if i == 0 else "worker",
                list(range(i, i + rng.randint(0, 3))),
                rng.randint(1, gpus_per_pod),
            )
            for i in range(pods)
        ],
        port=rng.randint(1, 65535),
        command=["vllm", "serve", *(word() for _ in range(rng.randint(0, 6)))],
        env={word(): word() for _ in range(rng.randint(0, 4))},
        wait_timeout_seconds=rng.choice([900, 0.5, 60.0]),
        preflight_timeout_seconds=rng.choice([30, 2.5]),
        drain_grace_seconds=rng.choice([None, 30, 7.5]),
    )


def test_round_trip_is_the_identity_for_any_valid_plan() -> None:
    """parse_plan(p.to_json_dict()) == p, and through the base64 transport, for 500 plans."""
    rng = random.Random(20260801)
    for _ in range(500):
        plan = random_plan(rng)
        assert parse_plan(plan.to_json_dict()) == plan
        assert parse_plan(json.loads(json.dumps(plan.to_json_dict()))) == plan
        assert decode_plan(encode_plan(plan)) == plan


def test_keyword_construction_takes_lists_and_defaults() -> None:
    """The operator may pass lists; optional fields default; the result equals the parsed plan."""
    plan = LaunchPlan(
        version=1, model="m", data_parallel_size=2, ranks_per_node=1, tensor_parallel_size=1,
        pack_strategy="strict", gpu_pods=2, gpus_per_pod=1, total_gpus=2,
        pods=[PodPlan(0, "head", [0], 1), PodPlan(1, "worker", [1], 1)],
        port=8000, command=["vllm", "serve", "m"],
    )  # fmt: skip
    assert plan.command == ("vllm", "serve", "m")
    assert plan.pods[1].ranks == (1,)
    assert (plan.env, plan.drain_grace_seconds) == ({}, None)
    assert "drainGraceSeconds" not in plan.to_json_dict()
    assert parse_plan(plan.to_json_dict()) == plan


def test_drain_grace_is_optional_and_checked() -> None:
    """drainGraceSeconds: absent or null is None; otherwise a positive number."""
    data = example()
    assert parse_plan(data).drain_grace_seconds is None
    data["drainGraceSeconds"] = None
    assert parse_plan(data).drain_grace_seconds is None
    data["drainGraceSeconds"] = 45
    assert parse_plan(data).drain_grace_seconds == 45.0
    data["drainGraceSeconds"] = 0
    with pytest.raises(PlanError, match="'drainGraceSeconds' must be a positive number"):
        parse_plan(data)


def test_encode_refuses_a_plan_the_launcher_would_refuse() -> None:
    """The operator learns at render time, with the key named, not at launch time."""
    plan = parse_plan(example())
    with pytest.raises(PlanError, match="'port' must be >= 1"):
        encode_plan(dataclasses.replace(plan, port=0))
    with pytest.raises(PlanError, match=r"'command\[2\]' must be a string"):
        encode_plan(dataclasses.replace(plan, command=("vllm", "serve", 8)))  # type: ignore[arg-type]


def test_plan_module_needs_neither_ray_nor_zmq() -> None:
    """The operator imports the schema without the engine's dependencies."""
    code = (
        "import sys; sys.modules['ray'] = None; sys.modules['zmq'] = None\n"
        "from vllm_dp_launcher import plan, stages\n"
        "print(plan.LaunchPlan.__name__, stages.STAGES[0])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["LaunchPlan", "connecting"]
