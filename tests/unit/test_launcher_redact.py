"""The launcher never logs a secret-named flag's value."""

from __future__ import annotations

import logging
import sys

import pytest
from vllm_dp_launcher.redact import HIDDEN, redact_argv
from vllm_dp_launcher.supervise import run_engine


@pytest.mark.parametrize(("argv", "expected"), [
    (["vllm", "serve", "m", "--api-key", "sk-1", "--port", "8000"],
     ["vllm", "serve", "m", "--api-key", HIDDEN, "--port", "8000"]),
    (["vllm", "serve", "m", "--api-key=sk-1"], ["vllm", "serve", "m", f"--api-key={HIDDEN}"]),
    (["x", "--hf-token", "hf_1", "--hf_token=hf_2", "--db-password", "p"],
     ["x", "--hf-token", HIDDEN, f"--hf_token={HIDDEN}", "--db-password", HIDDEN]),
    (["x", "--max-num-batched-tokens", "8", "--ssl-keyfile", "/k"],
     ["x", "--max-num-batched-tokens", "8", "--ssl-keyfile", "/k"]),
    (["x", "--max-model-len", "8", "--model", "m"], ["x", "--max-model-len", "8", "--model", "m"]),
])  # fmt: skip
def test_secret_named_flags_lose_their_values(argv: list[str], expected: list[str]) -> None:
    assert redact_argv(argv) == expected


def test_the_started_engine_line_is_redacted(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    argv = [sys.executable, "-c", "pass", "--api-key", "sk-secret-1"]
    run_engine(argv, {})
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "started engine" in logged and "sk-secret-1" not in logged and HIDDEN in logged
