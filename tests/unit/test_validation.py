"""Spec validation: one table of valid and invalid specs, each error pinned to field and rule."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from vllm_dp_operator import constants
from vllm_dp_operator.api.models import VLLMDataParallelSpec
from vllm_dp_operator.api.validation import (
    NAME_RULES,
    OWNED_FLAGS,
    RESERVED_ENV,
    RULES,
    SpecError,
    check_name,
    check_transition,
    validate,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DELETE = object()  # patch marker: remove the key

BASE: dict[str, Any] = {
    "model": "Qwen/Qwen2.5-7B-Instruct",
    "dataParallel": {"size": 4, "ranksPerNode": 2},
}
SPAN: dict[str, Any] = {
    "dataParallel": {"size": 2, "ranksPerNode": 1, "packStrategy": "span"},
    "tensorParallelSize": 16,
    "gpu": {"perPod": 8},
}


def merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge `patch` into a copy of `base`; DELETE removes a key."""
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if value is DELETE:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def dp(size: int, per_node: int, strategy: str = "strict") -> dict[str, Any]:
    return {"dataParallel": {"size": size, "ranksPerNode": per_node, "packStrategy": strategy}}


def env(*items: dict[str, Any]) -> dict[str, Any]:
    return {"env": list(items)}


def args(*flags: str) -> dict[str, Any]:
    return {"engineArgs": list(flags)}


def lora(*adapters: dict[str, Any], **limits: Any) -> dict[str, Any]:
    return {"lora": {**limits, "adapters": list(adapters)}}


def adapter(name: str, **source: str) -> dict[str, Any]:
    return {"name": name, "source": source}


VALID: list[Any] = [
    pytest.param({}, id="base"),
    pytest.param(env({"name": "HTTPS_PROXY", "value": "http://proxy.internal:3128"},
                     {"name": "NOTIFY", "value": "ops@example.com"}),
                 id="urls-and-addresses-without-credentials"),
    pytest.param(lora(adapter("sql", path="/adapters/sql"), adapter("chat", huggingFace="o/r"),
                      maxLoras=2, maxLoraRank=64, maxCpuLoras=4), id="lora"),
    pytest.param({"modelCache": {"claimName": "models"}, "apiServerCount": 1,
                  **lora(adapter("a-1.b_2", modelCache="adapters/sql-lora/"))},
                 id="lora-on-the-model-cache"),
    pytest.param({"lora": {}}, id="lora-limits-only"),
    pytest.param({"tensorParallelSize": 2}, id="tp2-default-per-pod"),
    pytest.param({"service": {"allowFrom": [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "clients"}},
         "podSelector": {"matchExpressions": [{"key": "example.com/role", "operator": "In",
                                               "values": ["gateway"]}]}},
        {"podSelector": {"matchExpressions": [{"key": "tier", "operator": "DoesNotExist"}]}},
    ]}}, id="allow-from"),
    pytest.param({"networkPolicy": {"enabled": False}}, id="network-policy-off"),
    pytest.param({"networkPolicy": {"egress": {"enabled": True, "allowTo": [
        {"cidr": "10.20.0.0/16", "ports": [443]}, {"cidr": "2001:db8::/64"},
        {"namespaceSelector": {"matchLabels": {"team": "models"}},
         "podSelector": {"matchExpressions": [{"key": "app", "operator": "In",
                                               "values": ["cache"]}]}}]}}},
                 id="egress"),
    pytest.param(dp(5, 2, "fill"), id="fill-partial-last-pod"),
    pytest.param(merge(dp(6, 2, "fill"), {"gpu": {"perPod": 4}}), id="fill-bigger-workers"),
    pytest.param(dp(2, 2), id="single-pod"),
    pytest.param(SPAN, id="span-two-pods-per-rank"),
    pytest.param(merge(SPAN, {"tensorParallelSize": 8}), id="span-one-pod-per-rank"),
    pytest.param({"gpu": {"perPod": 8}}, id="per-pod-larger-than-needed"),
    pytest.param(dp(1024, 64), id="largest-dp"),
    pytest.param({"service": {"port": 9000, "type": "NodePort"}}, id="other-port"),
    pytest.param({"service": {"port": 10000}}, id="port-below-ray-ranges"),
    pytest.param({"service": {"port": 20000}}, id="port-above-ray-worker-range"),
    pytest.param({"launch": {"timeoutSeconds": 600, "drainSeconds": 0}}, id="launch-deadlines"),
    pytest.param({"update": {"strategy": "Surge", "drainSeconds": 0}}, id="surge-no-drain"),
    pytest.param({"update": {"strategy": "Recreate", "drainSeconds": 3600}}, id="recreate"),
    pytest.param(
        args(
            "--max-model-len",
            "8192",
            "--model-loader-extra-config={}",
            "--data-parallel-hybrid-lb",
            "--enable-expert-parallel",
            "--hosts-file",
        ),
        id="unowned-flags-sharing-a-prefix",
    ),
    pytest.param(
        args("--seed", "1", "--dtype", "float32", "--max-num-batched-tokens", "8",
             "--data-parallel-hybrid-lb", "--disable-log-stats", "--api-server-countx",
             "--modelx", "-O3", "--model-impl", "vllm", "-q", "fp8", "-1"),
        id="flags-that-abbreviate-no-owned-flag",
    ),
    pytest.param(
        env({"name": "TOKENIZERS_PARALLELISM", "value": "false"},
            {"name": "VLLM_MAX_TOKENS_PER_STEP", "value": "8"},
            {"name": "HTTPS_PROXY", "value": "http://proxy.corp:3128"},
            {"name": "NO_PROXY", "value": "localhost,.svc,10.0.0.0/8"},
            {"name": "KEYWORDS", "value": "a@b"},
            {"name": "STORAGE_KEYRING_PATH", "value": "/etc/keys"},
            {"name": "VLLM_CONFIG_ROOT", "value": "/tmp/vllm"},
            {"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": "w", "key": "k"}}}),
        id="names-near-secret-words-and-secrets-from-a-secret",
    ),
    pytest.param({"apiKeySecretRef": {"name": "api", "key": "key"}}, id="api-key-from-a-secret"),
    pytest.param(
        env(
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
            {"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"},
            {"name": "EMPTY"},
        ),
        id="hf-token-from-secret",
    ),
    pytest.param(
        {
            "modelCache": {"claimName": "hf", "readOnly": True},
            "hfTokenSecretRef": {"name": "hf", "key": "token"},
            "tolerations": [{"key": "a", "operator": "Exists"}],
            "affinity": {"nodeAffinity": {}},
            "nodeSelector": {"pool": "gpu"},
            "resources": {"cpu": "16", "memory": "1.5Gi"},
            "shmSize": "1e9",
        },
        id="every-pod-option",
    ),
]


@pytest.mark.parametrize("patch", VALID)
def test_valid_spec(patch: dict[str, Any]) -> None:
    spec = validate("ok", merge(BASE, patch))
    assert isinstance(spec, VLLMDataParallelSpec)


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.stem)
def test_examples_are_valid(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    assert len(doc["metadata"]["name"]) <= constants.MAX_NAME_LENGTH
    validate(doc["metadata"]["name"], doc["spec"])


def test_name_of_max_length_is_valid() -> None:
    validate("n" * constants.MAX_NAME_LENGTH, BASE)


OWNED_CASES = [
    pytest.param(
        args(arg),
        "spec.engineArgs",
        f"must not set {flag} or an abbreviation of it, ",
        id=f"owned{flag}",
    )
    for arg, flag in [
        ("--data-parallel-size=4", "--data-parallel-size"),
        ("-dpl", "--data-parallel-size-local"),
        ("--data_parallel_address=10.0.0.1", "--data-parallel-address"),
        ("-dpb", "--data-parallel-backend"),
        ("--distributed-executor-backend=mp", "--distributed-executor-backend"),
        ("-tp", "--tensor-parallel-size"),
        ("--port=9000", "--port"),
        ("--host", "--host"),
        ("-asc", "--api-server-count"),
        ("--model=other", "--model"),
        ("--served_model_name", "--served-model-name"),
        ("--nnodes=2", "--nnodes"),
        ("-dpp", "--data-parallel-rpc-port"),
        ("--api-key=sk-123", "--api-key"),
        ("--hf-token=hf_123", "--hf-token"),
        ("--config=/models/serve.yaml", "--config"),
        ("--enable-lora", "--enable-lora"),
        ("--max-loras=4", "--max-loras"),
        ("--max_lora_rank=64", "--max-lora-rank"),
        ("--max-cpu-loras=8", "--max-cpu-loras"),
        ("--lora-modules=a=/x", "--lora-modules"),
    ]
]

# Abbreviations vLLM's parser expands to a flag the operator owns (argparse's allow_abbrev),
# in its spellings: `=value`, a value in the next item, underscores, short-form prefixes, an
# attached value on a two-character short form.
ABBREVIATION_CASES = [
    pytest.param(args(*items), "spec.engineArgs", f"must not set {flag} or an abbreviation",
                 id=f"abbrev-{items[0]}")
    for items, flag in [
        (("--tensor-parallel-si=2",), "--tensor-parallel-size"),
        (("--api-server-c=1",), "--api-server-count"),
        (("--data-parallel-back", "mp"), "--data-parallel-backend"),
        (("--tensor_parallel_s", "8"), "--tensor-parallel-size"),
        (("--data-parallel-size-l=2",), "--data-parallel-size-local"),
        (("--distributed-exec=mp",), "--distributed-executor-backend"),
        (("--served-model", "x"), "--served-model-name"),
        (("--mod=other",), "--model"),
        (("--por", "9000"), "--port"),
        (("-t", "8"), "--tensor-parallel-size"),
        (("-as=1",), "--api-server-count"),
        (("-n2",), "--nnodes"),
        (("--api-k", "sk-1"), "--api-key"),
        (("--hf_tok", "hf_1"), "--hf-token"),
        (("--conf", "serve.yaml"), "--config"),
    ]
]  # fmt: skip

RESERVED_CASES = [
    pytest.param(
        env({"name": name, "value": "x"}), "spec.env", f"{name} (use ", id=f"reserved-env-{name}"
    )
    for name in RESERVED_ENV
]

INVALID: list[Any] = [
    # Cross-field rules (validation.RULES).
    pytest.param({"update": {"maxSurge": "lots"}}, "spec.update.maxSurge",
                 "or a percentage of spec.replicas", id="surge-not-a-percentage"),
    pytest.param({"update": {"maxUnavailable": 101}}, "spec.update.maxUnavailable",
                 "must be a count of replicas from 0 to 100", id="unavailable-too-many"),
    pytest.param({"update": {"strategy": "RollingUpdate", "maxUnavailable": "0%",
                             "maxSurge": 0}}, "spec.update.maxUnavailable",
                 "may not both be 0", id="rolling-both-zero-percent"),
    pytest.param(
        {"ray": {"auth": "disabled"}, "networkPolicy": {"enabled": False}},
        "spec.ray.auth",
        "may not be disabled with networkPolicy.enabled false",
        id="no-auth-no-policy",
    ),
    pytest.param(dp(1, 1), "spec.dataParallel.size", "must be at least 2", id="dp1"),
    pytest.param(
        dp(4, 0),
        "spec.dataParallel.ranksPerNode",
        "must be at least 1: vllm serve",
        id="cpu-only-head",
    ),
    pytest.param(
        dp(2, 4),
        "spec.dataParallel.ranksPerNode",
        "must not exceed dataParallel.size",
        id="ranks-per-node-above-size",
    ),
    pytest.param(
        dp(6, 4),
        "spec.dataParallel.size",
        "must be a multiple of dataParallel.ranksPerNode with packStrategy strict",
        id="strict-partial-pod",
    ),
    pytest.param(
        {"tensorParallelSize": 2, "gpu": {"perPod": 2}},
        "spec.gpu.perPod",
        "must be at least dataParallel.ranksPerNode x tensorParallelSize",
        id="per-pod-below-head-need",
    ),
    pytest.param(
        merge(SPAN, dp(2, 2, "span")),
        "spec.dataParallel.ranksPerNode",
        "must be 1 with packStrategy span",
        id="span-two-ranks-per-node",
    ),
    pytest.param(
        merge(SPAN, {"gpu": {"perPod": DELETE}}),
        "spec.gpu.perPod",
        "is required with packStrategy span",
        id="span-without-per-pod",
    ),
    pytest.param(
        merge(SPAN, {"tensorParallelSize": 12}),
        "spec.tensorParallelSize",
        "must be a multiple of gpu.perPod with packStrategy span",
        id="span-tp12-per-pod8",
    ),
    pytest.param(
        merge(SPAN, {"tensorParallelSize": 4}),
        "spec.tensorParallelSize",
        "must be a multiple of gpu.perPod",
        id="span-tp-below-per-pod",
    ),
    pytest.param(
        {"dataParallel": {"size": 8, "ranksPerNode": 4}, "resources": {"cpu": "3500m"}},
        "spec.resources.cpu",
        "at least one CPU per DP rank a pod holds",
        id="cpu-below-ranks-per-pod",
    ),
    pytest.param(
        merge(BASE, {"dataParallel": {"size": 6, "ranksPerNode": 2, "packStrategy": "fill"},
                     "gpu": {"perPod": 4}, "resources": {"cpu": "3"}}),
        "spec.resources.cpu",
        "at least one CPU per DP rank a pod holds",
        id="cpu-below-fill-worker-ranks",
    ),
    *[
        pytest.param(
            {"service": {"port": port}},
            "spec.service.port",
            owner,
            id=f"ray-port-{port}",
        )
        for low, high, owner in constants.RESERVED_PORTS
        for port in sorted({low, high})
    ],
    pytest.param(
        {"service": {"port": 8080}},
        "spec.service.port",
        "must not be 8080: that port belongs to Ray's metrics agent",
        id="kuberay-metrics-port-named",
    ),
    pytest.param(
        {"service": {"port": 52365}},
        "spec.service.port",
        "must not be 52365: that port belongs to the Ray dashboard agent",
        id="dashboard-agent-port-named",
    ),
    pytest.param(
        {"service": {"port": 40000}},
        "spec.service.port",
        "must not be 32768-60999: that port belongs to Linux's ephemeral ports",
        id="ephemeral-port",
    ),
    pytest.param(
        {"launch": {"timeoutSeconds": 1}},
        "spec.launch.timeoutSeconds",
        "greater than or equal to 5",
        id="launch-timeout-too-short",
    ),
    pytest.param({"update": {"drainSeconds": 3601}}, "spec.update.drainSeconds",
                 "less than or equal to 3600", id="update-drain-too-long"),
    pytest.param({"update": {"strategy": "BlueGreen"}}, "spec.update.strategy",
                 "'Recreate', 'Surge' or 'RollingUpdate'", id="update-strategy-unknown"),
    pytest.param({"update": {"strategy": "RollingUpdate", "maxUnavailable": 0}},
                 "spec.update.maxUnavailable", "may not both be 0",
                 id="rolling-update-that-never-moves"),
    pytest.param({"replicas": -1}, "spec.replicas", "greater than or equal to 0",
                 id="replicas-negative"),
    pytest.param({"replicas": 101}, "spec.replicas", "less than or equal to 100",
                 id="replicas-over-the-cap"),
    *OWNED_CASES,
    *ABBREVIATION_CASES,
    *RESERVED_CASES,
    *(pytest.param(env({"name": name, "value": "hf_x"}), "spec.env",
                   "must not hold a secret as a literal value", id=f"secret-literal-{name}")
      for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "hf_token", "WANDB_API_KEY",
                   "OPENAI_APIKEY", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD", "TOKEN",
                   "PGPASSWORD", "AZURE_STORAGE_KEY", "AZURE_STORAGE_CONNECTION_STRING",
                   "AZURE_STORAGE_ACCOUNT_KEY", "GCS_PRIVATE_KEY", "MYSQL_PASSWD")),
    pytest.param({"serviceAccountName": "Engines_SA"}, "spec.serviceAccountName",
                 "should match pattern", id="service-account-not-a-dns-name"),
    pytest.param({"imagePullSecrets": [{"name": "a b"}]}, "spec.imagePullSecrets[0].name",
                 "should match pattern", id="pull-secret-not-a-dns-name"),
    pytest.param({"imagePullSecrets": ["regcred"]}, "spec.imagePullSecrets[0]",
                 "valid dictionary", id="pull-secret-not-in-name-form"),
    pytest.param({"model": "--tensor-parallel-size=8"}, "spec.model", "must not begin with '-'",
                 id="model-is-a-flag"),
    pytest.param({"servedModelName": "-x"}, "spec.servedModelName",
                 "must not begin with '-'", id="served-name-is-a-flag"),
    pytest.param(
        env({"name": "A", "value": "1", "valueFrom": {"fieldRef": {}}}),
        "spec.env",
        "takes value or valueFrom, not both",
        id="value-and-value-from",
    ),
    pytest.param(
        env({"name": "A", "value": "1"}, {"name": "A", "value": "2"}),
        "spec.env",
        "must not name a variable twice",
        id="duplicate-env",
    ),
    # Schema-level (pydantic) errors, the same the API server's OpenAPI check reports.
    pytest.param({"model": DELETE}, "spec.model", "Field required", id="missing-model"),
    pytest.param({"model": ""}, "spec.model", "at least 1 character", id="empty-model"),
    pytest.param(
        {"dataParallel": DELETE}, "spec.dataParallel", "Field required", id="missing-data-parallel"
    ),
    pytest.param(
        {"replicaCount": 3}, "spec.replicaCount", "Extra inputs are not permitted",
        id="unknown-field"
    ),
    pytest.param(
        {"dataParallel": {"nodes": 2}},
        "spec.dataParallel.nodes",
        "Extra inputs are not permitted",
        id="unknown-nested-field",
    ),
    pytest.param(
        {"resources": {"memory": "12GB"}},
        "spec.resources.memory",
        "should match pattern",
        id="bad-memory-quantity",
    ),
    pytest.param(
        {"shmSize": "lots"}, "spec.shmSize", "should match pattern", id="bad-shm-quantity"
    ),
    pytest.param(
        {"dataParallel": {"packStrategy": "round-robin"}},
        "spec.dataParallel.packStrategy",
        "'strict', 'fill' or 'span'",
        id="unknown-pack-strategy",
    ),
    pytest.param(
        {"tensorParallelSize": 0}, "spec.tensorParallelSize", "greater than or equal to 1", id="tp0"
    ),
    pytest.param(
        {"dataParallel": {"size": "eight"}},
        "spec.dataParallel.size",
        "valid integer",
        id="dp-not-an-integer",
    ),
    pytest.param(
        env({"name": "1BAD", "value": "x"}),
        "spec.env[0].name",
        "should match pattern",
        id="bad-env-name",
    ),
    pytest.param(
        {"modelCache": {"claimName": "c", "mountPath": "cache"}},
        "spec.modelCache.mountPath",
        "should match pattern",
        id="relative-mount-path",
    ),
    pytest.param(
        {"service": {"type": "ExternalName"}},
        "spec.service.type",
        "'ClusterIP', 'NodePort' or 'LoadBalancer'",
        id="bad-service-type",
    ),
    pytest.param(
        {"service": {"port": 70000}},
        "spec.service.port",
        "less than or equal to 65535",
        id="port-out-of-range",
    ),
    pytest.param(
        {"gpu": {"perPod": 0}}, "spec.gpu.perPod", "greater than or equal to 1", id="per-pod-zero"
    ),
    # Scheduling: which scheduler reads which setting (validation.SCHEDULING_RULES).
    pytest.param({"scheduling": {"priorityClassName": "high"}}, "spec.scheduling.queueName",
                 "is required with schedulerName kueue", id="kueue-without-queue"),
    pytest.param({"scheduling": {"schedulerName": "kai-scheduler"}},
                 "spec.scheduling.queueName", "is required with schedulerName kueue",
                 id="kai-without-queue"),
    pytest.param({"scheduling": {"schedulerName": "scheduler-plugins", "queueName": "q"}},
                 "spec.scheduling.queueName", "is not read by schedulerName scheduler-plugins",
                 id="scheduler-plugins-with-queue"),
    pytest.param({"scheduling": {"queueName": "q" * 64}}, "spec.scheduling.queueName",
                 "at most 63 characters", id="queue-longer-than-a-label-value"),
    pytest.param({"scheduling": {"schedulerName": "yunikorn", "queueName": "q",
                                 "priorityClassName": "high"}},
                 "spec.scheduling.priorityClassName", "is read only with schedulerName kueue",
                 id="yunikorn-with-priority"),
    pytest.param({"scheduling": {"queueName": "Team_A"}}, "spec.scheduling.queueName",
                 "should match pattern", id="queue-not-dns-label"),
    pytest.param({"scheduling": {"schedulerName": "slurm", "queueName": "q"}},
                 "spec.scheduling.schedulerName", "Input should be", id="unknown-scheduler"),
    pytest.param(
        {"service": {"allowFrom": [{}]}}, "spec.service.allowFrom",
        "needs a namespaceSelector or a podSelector", id="allow-from-empty-entry",
    ),
    pytest.param(
        {"networkPolicy": {"enabled": False, "egress": {"enabled": True}}},
        "spec.networkPolicy.egress.enabled", "needs networkPolicy.enabled",
        id="egress-without-policies",
    ),
    pytest.param(
        {"networkPolicy": {"egress": {"allowTo": [{"cidr": "10.0.0.0/8", "podSelector": {}}]}}},
        "spec.networkPolicy.egress.allowTo", "names a cidr, or", id="egress-cidr-and-pods",
    ),
    pytest.param(
        {"networkPolicy": {"egress": {"allowTo": [{"podSelector": {"matchExpressions": [
            {"key": "a", "operator": "NotIn"}]}}]}}},
        "spec.networkPolicy.egress.allowTo", "takes values with In and NotIn",
        id="egress-not-in-no-values",
    ),
    pytest.param(
        {"networkPolicy": {"egress": {"allowTo": [{"cidr": "10.0.0.256/8"}]}}},
        "spec.networkPolicy.egress.allowTo[0].cidr", "should match pattern",
        id="egress-bad-cidr",
    ),
    pytest.param(
        {"service": {"allowFrom": [{"podSelector": {"matchExpressions": [
            {"key": "a", "operator": "In"}]}}]}},
        "spec.service.allowFrom", "takes values with In and NotIn", id="allow-from-in-no-values",
    ),
    pytest.param(
        {"service": {"allowFrom": [{"namespaceSelector": {"matchExpressions": [
            {"key": "a", "operator": "Exists", "values": ["b"]}]}}]}},
        "spec.service.allowFrom", "none with Exists", id="allow-from-exists-with-values",
    ),
    pytest.param(
        {"service": {"allowFrom": [{"podSelector": {"matchLabels": {"bad key!": "x"}}}]}},
        "spec.service.allowFrom[0].podSelector.matchLabels", "label keys must be",
        id="allow-from-bad-label-key",
    ),
    pytest.param(
        {"service": {"allowFrom": [{"podSelector": {"matchExpressions": [
            {"key": "/x", "operator": "Exists"}]}}]}},
        "spec.service.allowFrom[0].podSelector.matchExpressions[0].key", "should match pattern",
        id="allow-from-bad-expression-key",
    ),
    pytest.param(
        {"service": {"allowFrom": []}}, "spec.service.allowFrom", "at least 1 item",
        id="allow-from-empty-list",
    ),
    *(pytest.param(env({"name": name, "value": value}), "spec.env",
                   "must not hold a URL with '@' as a literal value", id=f"credential-url-{name}")
      for name, value in (("HTTPS_PROXY", "http://user:pw@proxy:3128"),
                          ("MODEL_STORE", "s3://key:secret@bucket/models"))),
    pytest.param(lora(adapter("a", path="/x", huggingFace="o/r")), "spec.lora.adapters",
                 "exactly one of modelCache, path and huggingFace", id="lora-two-sources"),
    pytest.param(lora(adapter("a")), "spec.lora.adapters",
                 "exactly one of modelCache, path and huggingFace", id="lora-no-source"),
    pytest.param(lora(adapter("a", path="/x"), adapter("a", path="/y")), "spec.lora.adapters",
                 "must not name an adapter twice", id="lora-name-twice"),
    pytest.param(lora(adapter("Qwen/Qwen2.5-7B-Instruct", path="/x")),
                 "spec.lora.adapters[0].name", "should match pattern", id="lora-name-slash"),
    pytest.param({"servedModelName": "base", **lora(adapter("base", path="/x"))},
                 "spec.lora.adapters", "as the base model is served", id="lora-base-name"),
    pytest.param(lora(adapter("a", modelCache="adapters/a")), "spec.lora.adapters",
                 "needs spec.modelCache", id="lora-cache-without-cache"),
    pytest.param(lora(adapter("a", modelCache="../a")),
                 "spec.lora.adapters[0].source.modelCache", "should match pattern",
                 id="lora-cache-climbs-out"),
    pytest.param(lora(adapter("a", path="relative/a")),
                 "spec.lora.adapters[0].source.path", "should match pattern",
                 id="lora-path-relative"),
    pytest.param(lora(adapter("a", huggingFace="https://user:pw@example.com/o/r")),
                 "spec.lora.adapters[0].source.huggingFace", "should match pattern",
                 id="lora-hf-url-with-credentials"),
    pytest.param(lora(maxLoraRank=24), "spec.lora.maxLoraRank",
                 "must be one of 1, 8, 16, 32, 64, 128, 256, 320, 512", id="lora-rank-choice"),
    pytest.param(lora(maxLoras=4, maxCpuLoras=2), "spec.lora.maxCpuLoras",
                 "must be at least maxLoras", id="lora-cpu-below-gpu"),
    pytest.param({"apiServerCount": 2, **lora()}, "spec.apiServerCount",
                 "must be 1 (or unset) with spec.lora", id="lora-two-api-servers"),
    pytest.param({"ray": {"auth": "disabled"}, **lora()}, "spec.lora",
                 "needs ray.auth token", id="lora-without-ray-auth"),
]  # fmt: skip


@pytest.mark.parametrize(("patch", "path", "fragment"), INVALID)
def test_invalid_spec(patch: dict[str, Any], path: str, fragment: str) -> None:
    with pytest.raises(SpecError) as info:
        validate("bad", merge(BASE, patch))
    found = [(e.path, e.message) for e in info.value.errors]
    assert any(p == path and fragment in m for p, m in found), found
    # Every error names a field under spec (the name here is valid).
    assert all(p.startswith("spec.") for p, _ in found), found


def test_name_too_long() -> None:
    with pytest.raises(SpecError) as info:
        validate("n" * (constants.MAX_NAME_LENGTH + 1), BASE)
    [error] = info.value.errors
    assert error.path == "metadata.name"
    assert f"at most {constants.MAX_NAME_LENGTH} characters" in error.message


@pytest.mark.parametrize(
    "name", ["qwen2.5-dp8", "7b-dp", "Qwen-dp8", "dp8-", "-dp8", "dp_8", "llama.3", "a b"]
)
def test_name_must_be_a_dns_1035_label(name: str) -> None:
    with pytest.raises(SpecError) as info:
        validate(name, BASE)
    [error] = info.value.errors
    assert error.path == "metadata.name"
    assert "DNS-1035 label" in error.message and "no dots" in error.message
    assert "RayJob" in error.message  # says why: the children are named after it


@pytest.mark.parametrize("name", ["a", "qwen2-5-dp8", "x7b", "a-b-c9", "n" * 40])
def test_dns_1035_names_pass(name: str) -> None:
    assert check_name(name) == []


def test_name_rules_come_with_cel() -> None:
    assert [r.cel.split("(")[0] for r in NAME_RULES] == [
        "self.metadata.name.size", "self.metadata.name.matches"]  # fmt: skip


def test_name_error_reported_with_spec_errors() -> None:
    with pytest.raises(SpecError) as info:
        validate("n" * 64, merge(BASE, {"model": DELETE}))
    assert [e.path for e in info.value.errors] == ["metadata.name", "spec.model"]


def test_empty_spec_names_required_fields() -> None:
    with pytest.raises(SpecError) as info:
        validate("x", None)
    assert {e.path for e in info.value.errors} == {"spec.model", "spec.dataParallel"}


def test_every_broken_rule_reported_in_table_order() -> None:
    raw = merge(BASE, {**dp(1, 0), **args("--port=1"), **{"service": {"port": 6379}}})
    with pytest.raises(SpecError) as info:
        validate("x", raw)
    paths = [e.path for e in info.value.errors]
    assert paths == [
        "spec.dataParallel.size",
        "spec.dataParallel.ranksPerNode",
        "spec.service.port",
        "spec.engineArgs",
    ]
    assert "; " in str(info.value)  # one message naming every field


def test_every_rule_is_exercised_by_an_invalid_case() -> None:
    broken: set[int] = set()
    for case in INVALID:
        try:
            spec = VLLMDataParallelSpec.model_validate(merge(BASE, case.values[0]))
        except ValueError:
            continue  # a schema-level case
        broken |= {i for i, rule in enumerate(RULES) if not rule.holds(spec)}
    missing = [
        f"{RULES[i].field}: {RULES[i].message}" for i in range(len(RULES)) if i not in broken
    ]
    assert not missing, missing


def test_every_owned_flag_has_a_case() -> None:
    tested = {case.id for case in OWNED_CASES}
    assert tested == {f"owned{f.flag}" for f in OWNED_FLAGS}


def test_table_has_thirty_cases_at_least() -> None:
    assert len(VALID) + len(INVALID) >= 30


# Found by the reliability tier's fuzzed specs (tests/reliability/test_fuzz_specs.py): the API
# server takes only JSON integers and booleans there, while pydantic's lax mode read "2", true,
# "false" and 0 as numbers and booleans, so Python accepted what admission refuses.
@pytest.mark.parametrize(("path", "value"), [
    ("dataParallel.ranksPerNode", "2"), ("dataParallel.size", True), ("tensorParallelSize", "1"),
    ("gpu.perPod", "4"), ("apiServerCount", False), ("service.port", "8000"),
    ("launch.timeoutSeconds", "60"), ("suspend", "false"), ("suspend", 0),
    ("modelCache.readOnly", "yes"),
])  # fmt: skip
def test_wrong_json_type_rejected_as_the_api_server_does(path: str, value: Any) -> None:
    spec = copy.deepcopy(BASE)
    if path.startswith("modelCache"):
        spec["modelCache"] = {"claimName": "models"}
    node = spec
    *parents, leaf = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    with pytest.raises(SpecError) as err:
        validate("a", spec)
    assert [e.path for e in err.value.errors] == [f"spec.{path}"]


def test_integral_number_accepted_for_an_integer_as_the_api_server_does() -> None:
    spec = validate("a", {**BASE, "dataParallel": {"size": 4.0, "ranksPerNode": 2}})
    assert spec.data_parallel.size == 4 and isinstance(spec.data_parallel.size, int)


@pytest.mark.parametrize("owned", OWNED_FLAGS, ids=lambda o: o.flag)
def test_every_prefix_of_an_owned_flag_is_refused_in_every_spelling(owned: Any) -> None:
    # argparse expands any unique prefix (allow_abbrev), and vLLM takes `_` for `-` in long
    # flags: each such item, bare, with `=value` or before its value, overrides the operator.
    spellings = [owned.flag[:n] for n in range(3, len(owned.flag) + 1)]
    spellings += ["--" + s[2:].replace("-", "_") for s in spellings]
    if owned.short:
        spellings += [owned.short[:n] for n in range(2, len(owned.short) + 1)]
    for item in spellings:
        for engine_args in ([item], [f"{item}=1"], [item, "1"]):
            with pytest.raises(SpecError) as info:
                validate("bad", merge(BASE, args(*engine_args)))
            assert any(e.path == "spec.engineArgs" and "abbreviation" in e.message
                       for e in info.value.errors), (engine_args, info.value.errors)


def test_an_exact_owned_flag_is_named_alone_not_as_a_longer_flags_abbreviation() -> None:
    with pytest.raises(SpecError) as info:
        validate("bad", merge(BASE, args("--data-parallel-size=4")))
    assert [e.message.split(" or ")[0] for e in info.value.errors] == [
        "must not set --data-parallel-size"]


@pytest.mark.parametrize(("old", "new", "ok"), [
    ({"replicas": 1}, {"replicas": 1, "service": {"port": 9000}}, True),
    ({"replicas": 0}, {"replicas": 1, "service": {"port": 9000}}, True),
    ({"replicas": 2}, {"replicas": 2, "service": {"port": 9000}}, False),
    ({"replicas": 2}, {"replicas": 1, "service": {"port": 9000}}, False),
    ({"replicas": 1}, {"replicas": 3, "service": {"port": 9000}}, False),
    ({"replicas": 2}, {"replicas": 5}, True),  # scaling alone
])
def test_the_port_changes_only_at_one_replica(old: dict[str, Any], new: dict[str, Any],
                                              ok: bool) -> None:  # fmt: skip
    """Issue 38: every replica shares one EndpointSlice with one port; the API server checks
    the same rule (its CEL with oldSelf) on updates."""
    base = {"model": "m", "dataParallel": {"size": 2, "ranksPerNode": 1}}
    errors = check_transition(VLLMDataParallelSpec.model_validate({**base, **old}),
                              VLLMDataParallelSpec.model_validate({**base, **new}))  # fmt: skip
    assert (errors == []) == ok
    if not ok:
        assert errors[0].path == "spec.service.port" and "at most 1" in errors[0].message
