"""The request that proves new engines serve: the launcher's `answered` stage and the
operator's check of a Surge's new generation send the same one.

A model that generates answers one completion of one token; an embedding model answers no
completion (vLLM says 400 or 404 there), so it is asked one embedding; another pooling model
(classify, score, reward) is asked for the model list, which vLLM's API server answers once
its engines are up. `spec.update.servingCheck` names one; `Auto` derives it from the engine
args vLLM itself reads (`--runner`, `--convert`, `--task`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

AUTO, COMPLETION, EMBEDDING, MODELS = "Auto", "Completion", "Embedding", "Models"
CHECKS = (AUTO, COMPLETION, EMBEDDING, MODELS)
_EMBED = ("embed", "embedding")
_POOLING = ("classify", "score", "reward", "token_classify", "token_embed")


def flag(command: Sequence[str], name: str) -> str | None:
    """The value of `--name VALUE` or `--name=VALUE` in a command, or None."""
    for i, arg in enumerate(command):
        if arg == name and i + 1 < len(command):
            return command[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def derive(command: Sequence[str]) -> str:
    """The check `Auto` picks from vLLM's own flags in the serve command."""
    convert, task = flag(command, "--convert"), flag(command, "--task")
    if convert in _EMBED or task in _EMBED:
        return EMBEDDING
    if flag(command, "--runner") == "pooling" or convert in _POOLING or task in _POOLING:
        return MODELS
    return COMPLETION


def resolve(check: str | None, command: Sequence[str]) -> str:
    """The check to send: the one named, or for `Auto` (or none) the one derived."""
    return derive(command) if check in (None, "", AUTO) else str(check)


def request(check: str, model: str) -> tuple[str, str, dict[str, Any] | None]:
    """(method, path, JSON body) of the check for the served model's name."""
    if check == EMBEDDING:
        return "POST", "/v1/embeddings", {"model": model, "input": "ping"}
    if check == MODELS:
        return "GET", "/v1/models", None
    return "POST", "/v1/completions", {"model": model, "prompt": "ping", "max_tokens": 1}
