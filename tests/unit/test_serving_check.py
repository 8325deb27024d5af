"""The serving check that proves new engines serve (issue 38, item 8): a model that does not
generate (an embedding or another pooling model) answers no completion, so a Surge that
waited for one held twice the GPUs until its deadline, then failed, every time."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from test_launcher_answer import Engine, engine, plan  # noqa: F401  (the fixture)
from vllm_dp_launcher import health, servecheck
from vllm_dp_launcher.plan import parse_plan
from vllm_dp_operator.api.validation import SpecError, validate
from vllm_dp_operator.plan import build_plan
from world import World, serving, spec


@pytest.mark.parametrize(("args", "check"), [
    ((), servecheck.COMPLETION),
    (("--convert", "embed"), servecheck.EMBEDDING),
    (("--task=embed",), servecheck.EMBEDDING),
    (("--runner", "pooling"), servecheck.MODELS),
    (("--convert=classify",), servecheck.MODELS),
    (("--task", "score"), servecheck.MODELS),
    (("--runner", "generate"), servecheck.COMPLETION),
])  # fmt: skip
def test_auto_derives_the_check_from_vllms_own_flags(args: tuple[str, ...], check: str) -> None:
    assert servecheck.resolve(servecheck.AUTO, ("vllm", "serve", "m", *args)) == check
    assert servecheck.resolve(servecheck.MODELS, ("vllm", "serve", "m", *args)) == "Models"


def test_the_launcher_sends_an_embedding_for_an_embedding_model(engine: int) -> None:  # noqa: F811
    request = health.completion_request(plan(engine, "--convert", "embed"),
                                        {"VLLM_API_KEY": "s3cret"})  # fmt: skip
    assert health.complete(request, timeout=5) == 200
    [seen] = Engine.seen
    assert seen["path"] == "/v1/embeddings" and seen["body"]["input"] == "ping"


def test_a_named_check_travels_in_the_plan_and_none_leaves_the_plan_as_it_was() -> None:
    raw = spec(engineArgs=["--max-model-len", "512"])
    auto = build_plan(validate("demo", raw))
    assert "servingCheck" not in auto.launch_spec()  # no head job hash moves for Auto
    named = build_plan(validate("demo", {**raw, "update": {"servingCheck": "Models"}}))
    doc = named.launch_spec()
    assert doc["servingCheck"] == "Models" and named.check == "Models"
    assert parse_plan(doc).serving_check == "Models"


def test_an_unknown_check_is_refused_naming_the_field() -> None:
    with pytest.raises(SpecError, match=r"update\.servingCheck"):
        validate("demo", spec(update={"servingCheck": "Ping"}))


def surge(**over: Any) -> dict[str, Any]:
    return spec(update={"strategy": "Surge", "drainSeconds": 30},
                launch={"timeoutSeconds": 300}, **over)  # fmt: skip


async def test_a_surge_of_an_embedding_model_asks_an_embedding_and_switches() -> None:
    w: World = await serving(surge(engineArgs=["--convert", "embed"]))
    w.update(surge(engineArgs=["--convert", "embed", "--max-model-len", "512"]))
    await w.step()
    new = w.status["update"]["to"]
    w.cluster_ready()
    await w.step(5)
    w.run("demo-j00002")
    await w.step(5)
    assert w.probe.checks and set(w.probe.checks) == {servecheck.EMBEDDING}
    assert w.status["update"]["phase"] == "Draining" and w.status["rayCluster"] == new


def test_the_plan_check_is_a_field_of_the_plan() -> None:
    p = build_plan(validate("demo", spec()))
    assert dataclasses.replace(p, serving_check="Embedding").check == "Embedding"
