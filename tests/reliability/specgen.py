"""Hypothesis strategies for VLLMDataParallel manifests, valid and not.

Every value is drawn near a rule's edge: sizes around each bound, ports around the reserved
ranges, quantities valid and malformed, flags the operator owns in engineArgs, reserved and
repeated env names, names around 40 characters and off DNS-1035, and values of the wrong JSON
type (a string for an integer, 2.0 for 2, a number for a string), as a hand-written manifest
may hold them. Biased towards valid specs, so that the renderers see many shapes too.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st
from vllm_dp_operator import constants

Spec = dict[str, Any]

# A value a YAML author might type where another type belongs.
WRONG_TYPE = st.sampled_from(["2", "true", 2.0, 2.5, True, None, [], {}, "", -1])


def _mostly(valid: st.SearchStrategy[Any], odd: st.SearchStrategy[Any],
            one_in: int = 8) -> st.SearchStrategy[Any]:
    """`valid`, and `odd` about once in `one_in` draws (one_of alone picks unevenly)."""
    return st.sampled_from(range(one_in)).flatmap(lambda k: odd if k == one_in - 1 else valid)


def _int(valid: st.SearchStrategy[int], edges: tuple[int, ...]) -> st.SearchStrategy[Any]:
    return _mostly(valid, st.one_of(st.sampled_from(edges), st.sampled_from(edges), WRONG_TYPE))


NAMES = st.one_of(
    st.from_regex(r"[a-z][a-z0-9]{0,6}(-[a-z0-9]{1,8}){0,3}", fullmatch=True),
    st.from_regex(r"[a-z]([-a-z0-9]{36,42}[a-z0-9])", fullmatch=True),
    st.sampled_from(["qwen2.5-dp8", "7b-dp", "a-", "q" * 40, "q" * 41, "Upper", "a.b"]),
)

QUANTITIES = st.one_of(
    st.sampled_from(["1", "2", "4", "16", "0.5", "500m", "1500m", "2k", "1e3", "1E1", "2Gi",
                     "128Gi", ".5", "1.", "+2", "3M", "0"]),
    st.sampled_from(["-1", "abc", "1.2.3", "2 Gi", "1e", "Gi", "1ki", "0x10", "1_000", "1e400"]),
    st.from_regex(r"[0-9]{1,4}(\.[0-9]{1,3})?(m|k|Ki|Mi|Gi|e[0-9])?", fullmatch=True),
)  # fmt: skip

OWNED = [
    "--data-parallel-size=4", "-dp", "--data_parallel_size", "--data-parallel-size-local",
    "-dpl=2", "--data-parallel-address", "--data-parallel-backend=mp", "-dpb",
    "--distributed-executor-backend", "--tensor-parallel-size", "-tp=2", "--port=9000",
    "--host", "--api-server-count", "-asc", "--model", "--served-model-name=x", "--nnodes",
    "-n", "--data-parallel-rpc-port", "--data-parallel-size-x",
]  # fmt: skip
FREE_ARGS = st.sampled_from([
    "--max-model-len=4096", "--max-model-len", "4096", "--enable-expert-parallel",
    "--gpu-memory-utilization=0.9", "--trust-remote-code", "-q", "awq", "--port9000",
    "--hosted", "x --port=1", "",
])  # fmt: skip
ENGINE_ARGS = st.lists(st.one_of(FREE_ARGS, FREE_ARGS, st.sampled_from(OWNED)), max_size=4)

ENV_NAMES = st.one_of(
    st.sampled_from(["FOO", "NCCL_DEBUG", "HF_TOKEN", "VLLM_PORT", "VLLM_HOST_IP", "RAY_ADDRESS",
                     "VLLM_RAY_DP_PACK_STRATEGY", "a.b", "-x", "1X", "", "X Y"]),
    st.from_regex(r"[A-Z_][A-Z0-9_]{0,10}", fullmatch=True),
)  # fmt: skip
ENV_VAR = st.fixed_dictionaries(
    {"name": ENV_NAMES},
    optional={
        "value": st.one_of(st.text(max_size=8), st.sampled_from([1, True])),
        "valueFrom": st.sampled_from([
            {"secretKeyRef": {"name": "s", "key": "k"}},
            {"fieldRef": {"fieldPath": "status.podIP"}},
            {"configMapKeyRef": {"name": "c", "key": "k"}},
        ]),
    },
)  # fmt: skip

RESERVED_PORT_EDGES = tuple(sorted({
    p + d for low, high, _ in constants.RESERVED_PORTS for p in (low, high) for d in (-1, 0, 1)
}))
PORTS = _int(st.sampled_from([8000, 8001, 443, 30000]), (0, 1, 65535, 65536, *RESERVED_PORT_EDGES))

DATA_PARALLEL = st.fixed_dictionaries(
    {
        "size": _int(st.sampled_from([2, 3, 4, 6, 8, 16]), (0, 1, 1024, 1025)),
        "ranksPerNode": _int(st.sampled_from([1, 2, 4]), (0, 3, 8, 64, 65)),
    },
    optional={"packStrategy": st.one_of(st.sampled_from(["strict", "fill", "span"]),
                                        st.sampled_from(["spread", "STRICT", 1]))},
)  # fmt: skip

GPU = st.fixed_dictionaries(
    {},
    optional={
        "perPod": _int(st.sampled_from([1, 2, 4, 8]), (0, 3, 16, 64, 65)),
        "resourceName": st.sampled_from(["nvidia.com/gpu", "amd.com/gpu", "", "x" * 254]),
    },
)
RESOURCES = st.fixed_dictionaries({}, optional={"cpu": QUANTITIES, "memory": QUANTITIES})

SPEC = st.fixed_dictionaries(
    {
        "model": _mostly(st.sampled_from(["m", "meta-llama/Llama-3.1-8B-Instruct"]),
                         st.sampled_from(["", 7, "x" * 1025])),
        "dataParallel": DATA_PARALLEL,
    },
    optional={
        "tensorParallelSize": _int(st.sampled_from([1, 2, 4]), (0, 3, 8, 64, 65)),
        "apiServerCount": _int(st.sampled_from([1, 2, 4]), (0, 64, 65)),
        "gpu": GPU,
        "resources": RESOURCES,
        "shmSize": QUANTITIES,
        "servedModelName": st.sampled_from(["served", "", "a/b"]),
        "image": st.sampled_from(["vllm-dp-engine:0.1.0",
                                  "registry.example.com/e@sha256:" + "a" * 64]),
        "engineArgs": ENGINE_ARGS,
        "env": st.lists(ENV_VAR, max_size=3),
        "hfTokenSecretRef": st.one_of(
            st.fixed_dictionaries({"name": st.sampled_from(["hf", "hf-token"]),
                                   "key": st.sampled_from(["token", "HF_TOKEN"])}),
            st.sampled_from([{"name": ""}, {"name": "hf", "key": ""}, {"name": "hf", "key": "t",
                                                                       "extra": 1}]),
        ),
        "modelCache": st.fixed_dictionaries(
            {"claimName": st.sampled_from(["models", ""])},
            optional={"mountPath": st.sampled_from(["/models", "models", "/"]),
                      "readOnly": st.sampled_from([True, False, "yes"])}),
        "service": st.fixed_dictionaries({}, optional={
            "port": PORTS,
            "type": st.sampled_from(["ClusterIP", "NodePort", "LoadBalancer", "ExternalName"]),
            "annotations": st.sampled_from([{"a": "b"}, {"a": 1}, {}])}),
        "launch": st.fixed_dictionaries({}, optional={
            "timeoutSeconds": _int(st.sampled_from([60, 3600]), (4, 5, 604800, 604801)),
            "drainSeconds": _int(st.sampled_from([0, 30]), (-1, 3600, 3601))}),
        "suspend": st.sampled_from([False, True, "false", 0]),
        "nodeSelector": st.sampled_from([{"pool": "gpu"}, {"pool": 1}, {}]),
        "tolerations": st.sampled_from([[{"key": "k", "operator": "Exists"}], [], [1]]),
        "priorityClassName": st.sampled_from(["high", "x" * 254]),
    },
)  # fmt: skip

# One spec in ten carries a field the schema does not know.
MANIFESTS = st.tuples(_mostly(NAMES.filter(lambda n: len(n) <= 40), NAMES),
                      _mostly(SPEC, SPEC.map(lambda s: {**s, "bogusField": 1}), one_in=10))
