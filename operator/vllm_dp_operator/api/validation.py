"""Cross-field rules of the spec: one table, rendered as CRD CEL rules and run in Python."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from vllm_dp_operator import constants
from vllm_dp_operator.api.models import (
    LORA_RANKS,
    PERCENT_PATTERN,
    EgressDestination,
    LoraAdapter,
    PackStrategy,
    RayAuth,
    Scheduler,
    SelectorOperator,
    TrafficSource,
    UpdateStrategy,
    VLLMDataParallelSpec,
    int_or_percent_ok,
)
from vllm_dp_operator.api.quantity import quantity_value


@dataclass(frozen=True)
class Rule:
    """A rule over the spec: a CEL expression for the API server, a predicate for Python."""

    field: str  # path below spec, as the API server reports it (fieldPath ".<field>")
    cel: str  # evaluated with self = spec
    message: str
    holds: Callable[[VLLMDataParallelSpec], bool]


@dataclass(frozen=True)
class FieldError:
    """One validation failure, naming the field and the rule."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class SpecError(ValueError):
    """A spec that breaks one or more rules."""

    def __init__(self, errors: list[FieldError]) -> None:
        self.errors = errors
        super().__init__("; ".join(str(e) for e in errors))


@dataclass(frozen=True)
class OwnedFlag:
    """A vllm serve flag the user may not pass, and where the user says it instead."""

    flag: str
    short: str | None
    use_instead: str
    #: The flag's own meaning for the message: "which the operator owns", or why not a literal.
    why: str = "which the operator owns"


OWNED_FLAGS: tuple[OwnedFlag, ...] = (
    OwnedFlag("--data-parallel-size", "-dp", "spec.dataParallel.size"),
    OwnedFlag("--data-parallel-size-local", "-dpl", "spec.dataParallel.ranksPerNode"),
    OwnedFlag("--data-parallel-address", "-dpa",
              "nothing: the launcher sets it to the head pod's Ray node IP"),
    OwnedFlag("--data-parallel-backend", "-dpb",
              "nothing: the operator always uses the ray backend"),
    OwnedFlag("--distributed-executor-backend", None,
              "nothing: the operator sets it to ray where one rank spans several pods"),
    OwnedFlag("--tensor-parallel-size", "-tp", "spec.tensorParallelSize"),
    OwnedFlag("--port", None, "spec.service.port"),
    OwnedFlag("--host", None, "nothing: the API server listens on all pod addresses"),
    OwnedFlag("--api-server-count", "-asc", "spec.apiServerCount"),
    OwnedFlag("--model", None, "spec.model"),
    OwnedFlag("--served-model-name", None, "spec.servedModelName"),
    OwnedFlag("--nnodes", "-n", "spec.dataParallel (multi-node is Ray's job)"),
    OwnedFlag("--data-parallel-rpc-port", "-dpp",
              "nothing: the ray backend does not need it, and it must never equal the HTTP "
              "port (vllm#20119)"),
    OwnedFlag("--api-key", None, "spec.apiKeySecretRef",
              why="a secret, which would be readable in the RayJob and the process list"),
    OwnedFlag("--hf-token", None, "spec.hfTokenSecretRef",
              why="a secret, which would be readable in the RayJob and the process list"),
    OwnedFlag("--config", None, "the flags themselves in engineArgs",
              why="a file that can set the flags the operator owns out of its sight"),
    OwnedFlag("--enable-lora", None, "spec.lora"),
    OwnedFlag("--max-loras", None, "spec.lora.maxLoras"),
    OwnedFlag("--max-lora-rank", None, "spec.lora.maxLoraRank"),
    OwnedFlag("--max-cpu-loras", None, "spec.lora.maxCpuLoras"),
    OwnedFlag("--lora-modules", None, "spec.lora.adapters"),
)  # fmt: skip


def _prefixes(spelled: str, shortest: int, dash: str = "-") -> str:
    """RE2 (and Python) for every prefix of `spelled` at least `shortest` characters long;
    each inner dash written as `dash`. Flags hold letters, digits and dashes only, so nothing
    needs a backslash (which a CEL string literal would take as its own escape)."""
    assert re.fullmatch(r"[a-z0-9-]+", spelled), spelled

    def char(ch: str) -> str:
        return dash if ch == "-" else ch

    head = "".join(char(ch) for ch in spelled[:shortest])
    tail = ""
    for ch in reversed(spelled[shortest:]):
        tail = f"({char(ch)}{tail})?"
    return head + tail


def _shortest(spelled: str, others: list[str], floor: int) -> int:
    # A prefix that is also another owned flag's prefix is that flag's to name (argparse
    # takes an exact match first): `--data-parallel-size` is not `-local` abbreviated.
    inside = [len(o) + 1 for o in others if o != spelled and spelled.startswith(o)]
    return max([floor, *inside])


def owned_pattern(owned: OwnedFlag) -> str:
    """Every argparse spelling of an owned flag as one engineArgs item: the flag or any prefix
    argparse would expand to it (vLLM's parser allows abbreviations), dashes or underscores,
    with or without `=value`; the short form and its prefixes; a two-character short form with
    its value attached (`-n2`)."""
    longs = [o.flag for o in OWNED_FLAGS]
    shorts = [o.short for o in OWNED_FLAGS if o.short]
    # `--` and one character at least; vLLM takes `_` for an inner `-` in long flags only.
    alternatives = ["--" + _prefixes(owned.flag[2:], _shortest(owned.flag, longs, 3) - 2,
                                     dash="[-_]")]  # fmt: skip
    if owned.short:
        if len(owned.short) == 2:  # argparse reads `-n2` as `-n 2`
            alternatives.append(owned.short + ".*")
        else:
            alternatives.append("-" + _prefixes(owned.short[1:],
                                                 _shortest(owned.short, shorts, 2) - 1))
    return f"^({'|'.join(alternatives)})(=.*)?$"


# Variables the operator sets, and what to use instead; HF_TOKEN only as a literal.
RESERVED_ENV = {
    "VLLM_HOST_IP": "nothing: each pod sets it from its own pod IP",
    "VLLM_PORT": "nothing: vLLM crashes when it holds a URI (vllm#34199)",
    "VLLM_RAY_DP_PACK_STRATEGY": "spec.dataParallel.packStrategy",
    "RAY_ADDRESS": "nothing: vllm serve joins the Ray cluster it runs in; ray:// addresses "
    "are not supported (vllm#14349)",
    "VLLM_API_KEY": "apiKeySecretRef",
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "spec.lora: the operator turns it on and keeps adapter "
    "changes its own",
}

#: Variable names that hold a secret: known ones, and any with one of these words as a part
#: (HF_TOKEN, HUGGING_FACE_HUB_TOKEN, WANDB_API_KEY, AWS_SECRET_ACCESS_KEY,
#: AZURE_STORAGE_KEY, AZURE_STORAGE_CONNECTION_STRING; not TOKENIZERS_PARALLELISM), or a
#: password anywhere in the name (PGPASSWORD). Such a variable comes from a Secret, never as
#: a literal: a literal travels in the head job's plan, readable by anyone who can read RayJobs.
SECRET_ENV_PATTERN = (
    "(?i)(PASSW(OR)?D|(^|_)(TOKEN|SECRET|CREDENTIALS?|API_?KEY|ACCESS_?KEY|STORAGE_?KEY|"
    "ACCOUNT_?KEY|PRIVATE_?KEY|CONNECTION_?STRING)(_|$))"
)


def _owned_flag_rule(owned: OwnedFlag) -> Rule:
    pattern = owned_pattern(owned)
    regex = re.compile(pattern)
    return Rule(
        field="engineArgs",
        cel=f"!self.engineArgs.exists(a, a.matches('{pattern}'))",
        message=f"must not set {owned.flag} or an abbreviation of it, {owned.why}; use "
        f"{owned.use_instead}",
        holds=lambda s: not any(regex.search(a) for a in s.engine_args),
    )


def _strategy(s: VLLMDataParallelSpec) -> str:
    return str(s.data_parallel.pack_strategy)


def busiest_pod_ranks(s: VLLMDataParallelSpec) -> int:
    """The most DP ranks one pod may hold: each needs one Ray CPU for its control bundle."""
    if _strategy(s) == PackStrategy.SPAN:
        return 1
    if _strategy(s) == PackStrategy.FILL and s.gpu.per_pod is not None:
        return max(s.data_parallel.ranks_per_node, s.gpu.per_pod // s.tensor_parallel_size)
    return s.data_parallel.ranks_per_node


# busiest_pod_ranks in CEL (with gpu.perPod / TP never above ranksPerNode unless fill).
_BUSIEST_CEL = (
    "(self.dataParallel.packStrategy == 'span' ? 1 : "
    "(self.dataParallel.packStrategy == 'fill' && has(self.gpu.perPod) && "
    "self.gpu.perPod / self.tensorParallelSize > self.dataParallel.ranksPerNode ? "
    "self.gpu.perPod / self.tensorParallelSize : self.dataParallel.ranksPerNode))"
)


def _enough_cpus(s: VLLMDataParallelSpec) -> bool:
    if s.resources.cpu is None:
        return True
    try:
        return quantity_value(s.resources.cpu) >= busiest_pod_ranks(s)
    except ValueError:
        return True  # the schema's pattern reports a malformed quantity


def _reserved_port_rule(low: int, high: int, owner: str) -> Rule:
    ports = str(low) if low == high else f"{low}-{high}"
    cel = (
        f"self.service.port != {low}"
        if low == high
        else f"self.service.port < {low} || self.service.port > {high}"
    )
    return Rule(
        field="service.port",
        cel=cel,
        message=f"must not be {ports}: that port belongs to {owner}, so vllm serve could not "
        "bind it on the head pod",
        holds=lambda s: not low <= s.service.port <= high,
    )


_SECRET_ENV = re.compile(SECRET_ENV_PATTERN)


def _reserved_list() -> str:
    return "[" + ", ".join(f"'{n}'" for n in RESERVED_ENV) + "]"


def _scheduler_of(spec: VLLMDataParallelSpec) -> str | None:
    return spec.scheduling.scheduler_name if spec.scheduling is not None else None


#: CEL for "scheduling is set and its scheduler is one of these" (its default is kueue).
def _scheduler_in(*names: str) -> str:
    listed = ", ".join(f"'{n}'" for n in names)
    default = "!has(self.scheduling.schedulerName)" if Scheduler.KUEUE in names else "false"
    return f"({default} || self.scheduling.schedulerName in [{listed}])"


def _int_or_percent_holds(attr: str) -> Callable[[VLLMDataParallelSpec], bool]:
    """The Python side of an int-or-percent field's rule: update.<attr>."""
    return lambda s: int_or_percent_ok(getattr(s.update, attr))


def _zero(cel: str) -> str:
    """CEL: an int-or-percent field is 0 or 0%."""
    return f"(type({cel}) == string ? {cel}.matches('^0+%$') : {cel} == 0)"


def _is_zero(value: int | str) -> bool:
    return value == 0 or (isinstance(value, str) and re.fullmatch(r"0+%", value) is not None)


# Which scheduler reads which setting: KubeRay v1.6.2's plugins and Kueue (docs/scheduling.md).
SCHEDULING_RULES: tuple[Rule, ...] = (
    *(Rule(
        field=f"update.{name}",
        cel=f"type(self.update.{name}) == string ? "
        f"self.update.{name}.matches('{PERCENT_PATTERN}') : "
        f"(self.update.{name} >= 0 && self.update.{name} <= {constants.MAX_REPLICAS})",
        message=f"must be a count of replicas from 0 to {constants.MAX_REPLICAS}, or a "
        "percentage of spec.replicas such as 25%",
        holds=_int_or_percent_holds(attr),
    ) for name, attr in (("maxUnavailable", "max_unavailable"), ("maxSurge", "max_surge"))),
    Rule(
        field="update.maxUnavailable",
        cel="self.update.strategy != 'RollingUpdate' || "
        "!(" + _zero("self.update.maxUnavailable") + " && " + _zero("self.update.maxSurge")
        + ")",
        message="maxUnavailable and maxSurge may not both be 0 with strategy RollingUpdate: "
        "no replica could ever update",
        holds=lambda s: s.update.strategy != UpdateStrategy.ROLLING_UPDATE
        or not (_is_zero(s.update.max_unavailable) and _is_zero(s.update.max_surge)),
    ),
    Rule(
        field="scheduling.queueName",
        cel="!has(self.scheduling) || has(self.scheduling.queueName) || "
        f"!{_scheduler_in(Scheduler.KUEUE, Scheduler.KAI_SCHEDULER)}",
        message="is required with schedulerName kueue (a LocalQueue in this namespace) and "
        "kai-scheduler (KubeRay's KAI plugin refuses a cluster without a queue)",
        holds=lambda s: s.scheduling is None or s.scheduling.queue_name is not None
        or _scheduler_of(s) not in (Scheduler.KUEUE, Scheduler.KAI_SCHEDULER),
    ),
    Rule(
        field="scheduling.queueName",
        cel="!has(self.scheduling) || !has(self.scheduling.queueName) || "
        f"!{_scheduler_in(Scheduler.SCHEDULER_PLUGINS)}",
        message="is not read by schedulerName scheduler-plugins, which has no queues: leave it "
        "unset",
        holds=lambda s: s.scheduling is None or s.scheduling.queue_name is None
        or _scheduler_of(s) != Scheduler.SCHEDULER_PLUGINS,
    ),
    Rule(
        field="scheduling.priorityClassName",
        cel="!has(self.scheduling) || !has(self.scheduling.priorityClassName) || "
        f"{_scheduler_in(Scheduler.KUEUE, Scheduler.VOLCANO)}",
        message="is read only with schedulerName kueue or volcano; for the others set "
        "spec.priorityClassName, the pods' PriorityClass",
        holds=lambda s: s.scheduling is None or s.scheduling.priority_class_name is None
        or _scheduler_of(s) in (Scheduler.KUEUE, Scheduler.VOLCANO),
    ),
)  # fmt: skip


def _adapters(s: VLLMDataParallelSpec) -> list[LoraAdapter]:
    return s.lora.adapters if s.lora is not None else []


def _sources(a: LoraAdapter) -> int:
    src = a.source
    return sum(x is not None for x in (src.model_cache, src.path, src.hugging_face))


_ADAPTERS = "has(self.lora) && has(self.lora.adapters)"
_BASE_NAME = "(has(self.servedModelName) ? self.servedModelName : self.model)"

# spec.lora: each adapter's source, its name, and the limits vLLM checks at start.
LORA_RULES: tuple[Rule, ...] = (
    Rule(
        field="lora.adapters",
        cel=f"!({_ADAPTERS}) || self.lora.adapters.all(a, "
        "(has(a.source.modelCache) ? 1 : 0) + (has(a.source.path) ? 1 : 0) + "
        "(has(a.source.huggingFace) ? 1 : 0) == 1)",
        message="each adapter's source takes exactly one of modelCache, path and huggingFace",
        holds=lambda s: all(_sources(a) == 1 for a in _adapters(s)),
    ),
    Rule(
        field="lora.adapters",
        cel=f"!({_ADAPTERS}) || self.lora.adapters.all(a, "
        "self.lora.adapters.exists_one(b, b.name == a.name))",
        message="must not name an adapter twice",
        holds=lambda s: len({a.name for a in _adapters(s)}) == len(_adapters(s)),
    ),
    Rule(
        field="lora.adapters",
        cel=f"!({_ADAPTERS}) || !self.lora.adapters.exists(a, a.name == {_BASE_NAME})",
        message="must not name an adapter as the base model is served (servedModelName, or "
        "model where it is unset): clients could not ask for the one or the other",
        holds=lambda s: all(a.name != (s.served_model_name or s.model) for a in _adapters(s)),
    ),
    Rule(
        field="lora.adapters",
        cel=f"!({_ADAPTERS}) || has(self.modelCache) || "
        "!self.lora.adapters.exists(a, has(a.source.modelCache))",
        message="an adapter on the model cache (source.modelCache) needs spec.modelCache",
        holds=lambda s: s.model_cache is not None
        or all(a.source.model_cache is None for a in _adapters(s)),
    ),
    Rule(
        field="lora.maxLoraRank",
        cel="!has(self.lora) || !has(self.lora.maxLoraRank) || self.lora.maxLoraRank in ["
        + ", ".join(str(r) for r in LORA_RANKS) + "]",
        message="must be one of " + ", ".join(str(r) for r in LORA_RANKS)
        + " (vLLM's --max-lora-rank choices)",
        holds=lambda s: s.lora is None or s.lora.max_lora_rank in LORA_RANKS,
    ),
    Rule(
        field="lora.maxCpuLoras",
        cel="!has(self.lora) || !has(self.lora.maxCpuLoras) || "
        "self.lora.maxCpuLoras >= (has(self.lora.maxLoras) ? self.lora.maxLoras : 1)",
        message="must be at least maxLoras: vLLM refuses to start otherwise",
        holds=lambda s: s.lora is None or s.lora.max_cpu_loras is None
        or s.lora.max_cpu_loras >= s.lora.max_loras,
    ),
    Rule(
        field="apiServerCount",
        cel="!has(self.lora) || !has(self.apiServerCount) || self.apiServerCount == 1",
        message="must be 1 (or unset) with spec.lora: vLLM refuses runtime LoRA updates beside "
        "several API servers, each of which would keep its own list of adapters",
        holds=lambda s: s.lora is None or s.api_server_count in (None, 1),
    ),
    Rule(
        field="lora",
        cel="!has(self.lora) || !has(self.ray) || !has(self.ray.auth) || "
        "self.ray.auth != 'disabled'",
        message="needs ray.auth token: the engines take runtime LoRA loads only from a caller "
        "that holds the Ray cluster's token (the operator), and there is none with disabled",
        holds=lambda s: s.lora is None or s.ray.auth != RayAuth.DISABLED,
    ),
)


_SELECTORS = ("namespaceSelector", "podSelector")
_WITH_VALUES = (SelectorOperator.IN, SelectorOperator.NOT_IN)


def _allow_from(s: VLLMDataParallelSpec) -> list[TrafficSource]:
    return s.service.allow_from or []


def _allow_to(s: VLLMDataParallelSpec) -> list[EgressDestination]:
    return s.network_policy.egress.allow_to


def _expressions_rule(field: str, guard: str, peers: str,
                      of: Callable[[VLLMDataParallelSpec], list[Any]]) -> Rule:  # fmt: skip
    """Every matchExpressions entry of every selector of the peers at CEL path `peers` (present
    when `guard` holds), which `of` gives in Python, takes values with In and NotIn only."""
    expr_ok = ("(!has({sel}.matchExpressions) || {sel}.matchExpressions.all(e, "
               "(e.operator in ['In', 'NotIn']) == (has(e.values) && size(e.values) > 0)))")
    per_peer = " && ".join(f"(!has(p.{f}) || {expr_ok.format(sel=f'p.{f}')})"
                           for f in _SELECTORS)  # fmt: skip
    return Rule(
        field=field,
        cel=f"!({guard}) || {peers}.all(p, {per_peer})",
        message="a matchExpressions entry takes values with In and NotIn (at least one), and "
        "none with Exists and DoesNotExist",
        holds=lambda s: all((e.operator in _WITH_VALUES) == bool(e.values)
                            for p in of(s) for sel in (p.namespace_selector, p.pod_selector)
                            if sel for e in sel.match_expressions),
    )


_ALLOW_FROM_RULES = (
    Rule(
        field="service.allowFrom",
        cel="!has(self.service.allowFrom) || "
        "self.service.allowFrom.all(p, has(p.namespaceSelector) || has(p.podSelector))",
        message="each entry needs a namespaceSelector or a podSelector: an entry with neither "
        "would admit every source",
        holds=lambda s: all(p.namespace_selector or p.pod_selector
                            for p in s.service.allow_from or []),
    ),
    _expressions_rule("service.allowFrom", "has(self.service.allowFrom)",
                      "self.service.allowFrom", _allow_from),
)


_EGRESS = "has(self.networkPolicy) && has(self.networkPolicy.egress)"
_ALLOW_TO = f"{_EGRESS} && has(self.networkPolicy.egress.allowTo)"


_EGRESS_RULES = (
    Rule(
        field="networkPolicy.egress.enabled",
        cel=f"!({_EGRESS} && has(self.networkPolicy.egress.enabled) && "
        "self.networkPolicy.egress.enabled) || !has(self.networkPolicy.enabled) || "
        "self.networkPolicy.enabled",
        message="needs networkPolicy.enabled: the egress policy is one of the resource's "
        "NetworkPolicies, and with them off none is made",
        holds=lambda s: not s.network_policy.egress.enabled or s.network_policy.enabled,
    ),
    Rule(
        field="networkPolicy.egress.allowTo",
        cel=f"!({_ALLOW_TO}) || self.networkPolicy.egress.allowTo.all(d, "
        "has(d.cidr) != (has(d.namespaceSelector) || has(d.podSelector)))",
        message="each entry names a cidr, or a namespaceSelector and/or a podSelector: not "
        "both, and not neither (which would allow every destination)",
        holds=lambda s: all((d.cidr is not None)
                            != (d.namespace_selector is not None or d.pod_selector is not None)
                            for d in _allow_to(s)),
    ),
    _expressions_rule("networkPolicy.egress.allowTo", _ALLOW_TO,
                      "self.networkPolicy.egress.allowTo", _allow_to),
)


RULES: tuple[Rule, ...] = (
    Rule(
        field="dataParallel.size",
        cel="self.dataParallel.size >= 2",
        message="must be at least 2: with --data-parallel-backend ray vLLM resets the DP master "
        "address to 127.0.0.1 at DP=1 (vllm#51712); serve one replica without this operator",
        holds=lambda s: s.data_parallel.size >= 2,
    ),
    Rule(
        field="dataParallel.ranksPerNode",
        cel="self.dataParallel.ranksPerNode >= 1",
        message="must be at least 1: vllm serve runs on the head pod, which must hold DP ranks "
        "and see a GPU (a CPU-only head fails, production-stack#1056)",
        holds=lambda s: s.data_parallel.ranks_per_node >= 1,
    ),
    Rule(
        field="dataParallel.ranksPerNode",
        cel="self.dataParallel.ranksPerNode <= self.dataParallel.size",
        message="must not exceed dataParallel.size",
        holds=lambda s: s.data_parallel.ranks_per_node <= s.data_parallel.size,
    ),
    Rule(
        field="dataParallel.size",
        # ranksPerNode 0 is reported by its own rule; guard so CEL never divides by zero.
        cel="self.dataParallel.packStrategy != 'strict' || self.dataParallel.ranksPerNode == 0 "
        "|| self.dataParallel.size % self.dataParallel.ranksPerNode == 0",
        message="must be a multiple of dataParallel.ranksPerNode with packStrategy strict "
        "(every pod holds exactly ranksPerNode ranks); use fill for a partial last pod",
        holds=lambda s: _strategy(s) != PackStrategy.STRICT
        or s.data_parallel.ranks_per_node == 0
        or s.data_parallel.size % s.data_parallel.ranks_per_node == 0,
    ),
    Rule(
        field="gpu.perPod",
        cel="self.dataParallel.packStrategy == 'span' || !has(self.gpu.perPod) || "
        "self.dataParallel.ranksPerNode * self.tensorParallelSize <= self.gpu.perPod",
        message="must be at least dataParallel.ranksPerNode x tensorParallelSize: the head pod "
        "must hold all of its ranks",
        holds=lambda s: _strategy(s) == PackStrategy.SPAN
        or s.gpu.per_pod is None
        or s.data_parallel.ranks_per_node * s.tensor_parallel_size <= s.gpu.per_pod,
    ),
    Rule(
        field="dataParallel.ranksPerNode",
        cel="self.dataParallel.packStrategy != 'span' || self.dataParallel.ranksPerNode == 1",
        message="must be 1 with packStrategy span: each rank spans several pods",
        holds=lambda s: _strategy(s) != PackStrategy.SPAN or s.data_parallel.ranks_per_node == 1,
    ),
    Rule(
        field="gpu.perPod",
        cel="self.dataParallel.packStrategy != 'span' || has(self.gpu.perPod)",
        message="is required with packStrategy span: it decides how many pods one rank spans",
        holds=lambda s: _strategy(s) != PackStrategy.SPAN or s.gpu.per_pod is not None,
    ),
    Rule(
        field="tensorParallelSize",
        cel="self.dataParallel.packStrategy != 'span' || !has(self.gpu.perPod) || "
        "self.tensorParallelSize % self.gpu.perPod == 0",
        message="must be a multiple of gpu.perPod with packStrategy span: vLLM spans a rank "
        "over whole identical pods",
        holds=lambda s: _strategy(s) != PackStrategy.SPAN
        or s.gpu.per_pod is None
        or s.tensor_parallel_size % s.gpu.per_pod == 0,
    ),
    Rule(
        field="resources.cpu",
        cel="!has(self.resources.cpu) || !isQuantity(self.resources.cpu) || "
        f"quantity(self.resources.cpu).asApproximateFloat() >= double({_BUSIEST_CEL})",
        message="must be at least one CPU per DP rank a pod holds: vLLM gives every rank a Ray "
        "placement group with a CPU bundle, and without the CPUs the launch waits forever (the "
        "head pod gets one more CPU per API server on top of this)",
        holds=_enough_cpus,
    ),
    *(_reserved_port_rule(low, high, owner) for low, high, owner in constants.RESERVED_PORTS),
    *(_owned_flag_rule(f) for f in OWNED_FLAGS),
    Rule(
        field="env",
        cel=f"self.env.all(e, !(e.name in {_reserved_list()}))",
        message="must not set "
        + ", ".join(f"{name} (use {instead})" for name, instead in RESERVED_ENV.items()),
        holds=lambda s: all(e.name not in RESERVED_ENV for e in s.env),
    ),
    Rule(
        field="env",
        cel=f"self.env.all(e, !has(e.value) || !e.name.matches('{SECRET_ENV_PATTERN}'))",
        message="must not hold a secret as a literal value (a name with TOKEN, SECRET, "
        "PASSWORD, CREDENTIALS, API_KEY, ACCESS_KEY, STORAGE_KEY, ACCOUNT_KEY, PRIVATE_KEY or "
        "CONNECTION_STRING in it): it would be readable in the "
        "RayJob; use valueFrom.secretKeyRef, or hfTokenSecretRef for HF_TOKEN and "
        "apiKeySecretRef for the API key",
        holds=lambda s: all(e.value is None or not _SECRET_ENV.search(e.name) for e in s.env),
    ),
    Rule(
        field="env",
        # contains, not a regex: the API server prices a regex by the longest value times the
        # pattern, over 128 variables of 32 KiB, far past its budget.
        cel="self.env.all(e, !has(e.value) || !(e.value.contains('://') && "
        "e.value.contains('@')))",
        message="must not hold a URL with '@' as a literal value (user:password@host, as a "
        "proxy or store URL carries credentials): it would be readable in the RayJob; put "
        "the URL in a Secret and use valueFrom.secretKeyRef",
        holds=lambda s: all(e.value is None or not ("://" in e.value and "@" in e.value)
                            for e in s.env),
    ),
    Rule(
        field="model",
        cel="!self.model.startsWith('-')",
        message="must not begin with '-': vllm serve would read it as a flag",
        holds=lambda s: not s.model.startswith("-"),
    ),
    Rule(
        field="servedModelName",
        cel="!has(self.servedModelName) || !self.servedModelName.startsWith('-')",
        message="must not begin with '-': vllm serve would read it as a flag",
        holds=lambda s: not (s.served_model_name or "").startswith("-"),
    ),
    Rule(
        field="env",
        cel="self.env.all(e, !(has(e.value) && has(e.valueFrom)))",
        message="each variable takes value or valueFrom, not both",
        holds=lambda s: all(e.value is None or e.value_from is None for e in s.env),
    ),
    Rule(
        field="env",
        cel="self.env.all(e, self.env.exists_one(f, f.name == e.name))",
        message="must not name a variable twice",
        holds=lambda s: len({e.name for e in s.env}) == len(s.env),
    ),
    Rule(
        field="ray.auth",
        cel="!has(self.ray) || !has(self.ray.auth) || self.ray.auth != 'disabled' || "
        "!has(self.networkPolicy) || !has(self.networkPolicy.enabled) || "
        "self.networkPolicy.enabled",
        message="may not be disabled with networkPolicy.enabled false: anyone who reaches the "
        "head's Ray ports could run code on the GPU pods; keep one of the two",
        holds=lambda s: s.ray.auth != RayAuth.DISABLED or s.network_policy.enabled,
    ),
    *SCHEDULING_RULES,
    *_ALLOW_FROM_RULES,
    *_EGRESS_RULES,
    *LORA_RULES,
)

@dataclass(frozen=True)
class TransitionRule:
    """A rule over a change of the spec: CEL with `oldSelf` (the API server checks it on
    updates only), and a predicate over (old, new)."""

    field: str
    cel: str
    message: str
    holds: Callable[[VLLMDataParallelSpec, VLLMDataParallelSpec], bool]


TRANSITION_RULES: tuple[TransitionRule, ...] = (
    TransitionRule(
        field="service.port",
        cel="self.service.port == oldSelf.service.port || "
        "(self.replicas <= 1 && oldSelf.replicas <= 1)",
        message="may change only while spec.replicas is at most 1, before and after: every "
        "replica's endpoint is in the Service's one EndpointSlice, which has one port, so two "
        "replicas on two ports cannot both be routed (scale to 1, change the port, scale back)",
        holds=lambda old, new: (new.service.port == old.service.port
                                or (new.replicas <= 1 and old.replicas <= 1)),
    ),
)


def check_transition(old: VLLMDataParallelSpec, new: VLLMDataParallelSpec) -> list[FieldError]:
    """Every broken rule of a change from `old` to `new`, as the API server checks it."""
    return [FieldError(f"spec.{r.field}", r.message) for r in TRANSITION_RULES
            if not r.holds(old, new)]  # fmt: skip


@dataclass(frozen=True)
class NameRule:
    """A rule on metadata.name: a CEL expression (self = the object) and a predicate."""

    cel: str
    message: str
    holds: Callable[[str], bool]


_DNS1035 = re.compile(constants.DNS1035_PATTERN)
NAME_RULES: tuple[NameRule, ...] = (
    NameRule(
        cel=f"self.metadata.name.size() <= {constants.MAX_NAME_LENGTH}",
        message=f"must be at most {constants.MAX_NAME_LENGTH} characters: the head RayJob "
        f"<name>-j<attempt> must fit KubeRay's {constants.KUBERAY_MAX_RAYJOB_NAME}-character "
        "limit, and the RayCluster, its head Service and the API Service are named after it too",
        holds=lambda n: len(n) <= constants.MAX_NAME_LENGTH,
    ),
    NameRule(
        cel=f"self.metadata.name.matches('{constants.DNS1035_PATTERN}')",
        message="must be a DNS-1035 label: lowercase letters, digits and '-', starting with a "
        "letter and ending with a letter or digit (no dots), because the API Service, the "
        "RayCluster and the head RayJob are named after it and Kubernetes and KubeRay accept "
        "only such names for them (e.g. qwen2-5-dp8, not qwen2.5-dp8 or 7b-dp)",
        holds=lambda n: bool(_DNS1035.fullmatch(n)),
    ),
)


def check_name(name: str) -> list[FieldError]:
    """Every broken rule of a resource name."""
    return [FieldError("metadata.name", r.message) for r in NAME_RULES if not r.holds(name)]


def _pydantic_errors(err: ValidationError) -> list[FieldError]:
    out = []
    for item in err.errors():
        # Kubernetes spelling: list indexes in brackets (spec.env[0].name).
        path = "spec" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in item["loc"])
        out.append(FieldError(path, item["msg"]))
    return out


def check_rules(spec: VLLMDataParallelSpec) -> list[FieldError]:
    """Every broken rule of a parsed spec, in table order."""
    return [FieldError(f"spec.{r.field}", r.message) for r in RULES if not r.holds(spec)]


def validate(name: str, raw_spec: Mapping[str, Any] | None) -> VLLMDataParallelSpec:
    """Parse and check a spec as the API server would; raise SpecError naming each field."""
    errors = check_name(name)
    try:
        spec = VLLMDataParallelSpec.model_validate(raw_spec or {})
    except ValidationError as err:
        raise SpecError(errors + _pydantic_errors(err)) from None
    errors += check_rules(spec)
    if errors:
        raise SpecError(errors)
    return spec
