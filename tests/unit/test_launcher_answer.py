"""The launcher's own completion: sent once /health answers, with the engines' API key in a
header (never printed), retried until 200, then reported as the `answered` stage."""

from __future__ import annotations

import http.server
import json
import logging
import threading
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
from vllm_dp_launcher import health, stages
from vllm_dp_launcher.plan import LaunchPlan, PodPlan


class Engine(http.server.BaseHTTPRequestHandler):
    """Test double for vLLM's API server: /health, and /v1/completions wanting a key."""

    answers: ClassVar[list[int]] = []
    seen: ClassVar[list[dict[str, Any]]] = []

    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Engine.seen.append({"path": self.path, "body": body,
                            "auth": self.headers.get("Authorization")})  # fmt: skip
        code = Engine.answers.pop(0) if Engine.answers else 200
        if code == 200 and self.headers.get("Authorization") != "Bearer s3cret":
            code = 401
        self.send_response(code)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def engine() -> Iterator[int]:
    Engine.answers, Engine.seen = [], []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


def plan(port: int, *extra: str) -> LaunchPlan:
    return LaunchPlan(
        version=1, model="Qwen/Qwen2.5-0.5B", data_parallel_size=1, ranks_per_node=1,
        tensor_parallel_size=1, pack_strategy="strict", gpu_pods=1, gpus_per_pod=1,
        total_gpus=1, pods=(PodPlan(0, "head", (0,), 1),), port=port,
        command=("vllm", "serve", "Qwen/Qwen2.5-0.5B", "--host", "127.0.0.1", *extra),
    )  # fmt: skip


def test_the_completion_names_the_served_model_and_carries_the_key(engine: int) -> None:
    request = health.completion_request(plan(engine, "--served-model-name", "qwen"),
                                        {"VLLM_API_KEY": "s3cret"})  # fmt: skip
    assert health.complete(request, timeout=5) == 200
    [seen] = Engine.seen
    assert seen["path"] == "/v1/completions" and seen["body"]["model"] == "qwen"
    assert seen["body"]["max_tokens"] == 1 and seen["auth"] == "Bearer s3cret"
    no_key = health.completion_request(plan(engine), {})
    assert health.complete(no_key, timeout=5) == 401  # vLLM refuses it: not `answered`
    assert Engine.seen[-1]["body"]["model"] == "Qwen/Qwen2.5-0.5B"


def test_nothing_answers_is_none() -> None:
    request = health.completion_request(plan(1), {})  # port 1: refused
    assert health.complete(request, timeout=2) is None


def test_answered_follows_serving_after_retries_and_the_key_is_never_logged(
        engine: int, caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    Engine.answers = [503, 500]  # engines still warming: two refusals, then 200
    request = health.completion_request(plan(engine), {"VLLM_API_KEY": "s3cret"})
    caplog.set_level(logging.INFO)
    thread = health.watch(f"http://127.0.0.1:{engine}/health", alive=lambda: True,
                          completion=lambda: health.complete(request, timeout=5),
                          retry=0.01)  # fmt: skip
    thread.join(10)
    assert not thread.is_alive()
    lines = stages.parse_stage_lines("\n".join(
        f"x vllm-dp-launcher {r.getMessage()}" for r in caplog.records
        if r.name == "vllm_dp_launcher.stage"))  # fmt: skip
    assert [s.name for s in lines] == [stages.SERVING, stages.ANSWERED]
    assert lines[1].fields == {"status": "200", "tries": "3"}
    assert len(Engine.seen) == 3
    assert "s3cret" not in caplog.text


def test_no_answered_while_the_engine_is_not_alive(engine: int) -> None:
    calls: list[int] = []
    thread = health.watch(f"http://127.0.0.1:{engine}/health", alive=lambda: not calls,
                          completion=lambda: calls.append(1) or 500, retry=0.01)  # fmt: skip
    thread.join(5)
    assert not thread.is_alive() and calls == [1]
