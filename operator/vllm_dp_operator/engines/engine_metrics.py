"""vLLM's /metrics read down to the load per DP rank (status.load, the vllmdp_engine_* gauges).

Pure, no I/O.

vLLM 0.33 labels every engine series with `model_name` and `engine` (the DP rank), and with
vLLM balancing load one API server reports every rank. Of the whole exposition (hundreds of
histogram buckets per rank, about 290 KiB for 8 ranks) only three gauge families are read.
The text is searched for the lines that start with one of their names (`str.find`, in C), so
the thousands of other lines are never split out or looked at in Python: about 0.1 ms per
8-rank exposition where splitting every line cost 1.6 ms, at one read per resource per probe.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_CACHE = "vllm:kv_cache_usage_perc"
#: The series read (exposition name -> field).
WANTED: Mapping[str, str] = {RUNNING: "running", WAITING: "waiting", KV_CACHE: "kv"}
_PREFIXES = tuple(WANTED)


@dataclass(frozen=True)
class EngineLoad:
    """What one DP rank reports: requests running and waiting, KV-cache use (0..1)."""

    rank: int
    running: int
    waiting: int
    kv_cache_usage: float


class ExpositionError(ValueError):
    """A wanted line that does not parse as Prometheus text exposition."""


def _labels(text: str) -> dict[str, str]:
    """Parse `k="v",k2="v2"` (the part between braces), with the format's escapes."""
    labels: dict[str, str] = {}
    i, n = 0, len(text)
    while i < n:
        while i < n and text[i] in " ,":
            i += 1
        if i >= n:
            break
        eq = text.find("=", i)
        if eq < 0 or eq + 1 >= n or text[eq + 1] != '"':
            raise ExpositionError(f"label without a quoted value in {{{text}}}")
        key = text[i:eq].strip()
        j, value = eq + 2, []
        while j < n and text[j] != '"':
            if text[j] == "\\" and j + 1 < n:
                j += 1
                value.append({"n": "\n"}.get(text[j], text[j]))
            else:
                value.append(text[j])
            j += 1
        if j >= n:
            raise ExpositionError(f"unterminated label value in {{{text}}}")
        labels[key] = "".join(value)
        i = j + 1
    return labels


def _sample(line: str) -> tuple[str, dict[str, str], float]:
    """Name, labels and value of one sample line (a timestamp after the value is ignored)."""
    brace = line.find("{")
    if brace >= 0:
        close = line.rfind("}")
        if close < brace:
            raise ExpositionError(f"unbalanced braces: {line[:200]}")
        name, labels, rest = line[:brace], _labels(line[brace + 1 : close]), line[close + 1 :]
    else:
        name, _, rest = line.partition(" ")
        labels = {}
    fields = rest.split()
    if not fields:
        raise ExpositionError(f"sample without a value: {line[:200]}")
    try:
        return name.strip(), labels, float(fields[0])
    except ValueError as exc:
        raise ExpositionError(f"sample value is not a number: {line[:200]}") from exc


def _wanted_lines(text: str) -> Iterator[str]:
    """The lines that start with a wanted family's name, in order within each family."""
    for prefix in _PREFIXES:
        needle = "\n" + prefix
        if text.startswith(prefix):
            start = 0
        else:
            hit = text.find(needle)
            start = hit + 1 if hit >= 0 else -1
        while start >= 0:
            end = text.find("\n", start)
            if end < 0:
                end = len(text)
            yield text[start:end]
            hit = text.find(needle, end)
            start = hit + 1 if hit >= 0 else -1


def _beyond(line: str, ranks: int) -> bool:
    """Whether a line's `engine="N"` names a rank at or above `ranks`: skipped before its
    labels are parsed, so an exposition of made-up ranks costs a `find` per line, in C."""
    at = line.find('engine="')
    if at < 0:
        return False
    end = line.find('"', at + 8)
    digits = line[at + 8 : end] if end > 0 else ""
    return digits.isdigit() and int(digits) >= ranks


def series_cap(ranks: int) -> int:
    """The most series of one wanted family read for a DP size: one per rank and API server
    process (at most one per rank, or 4) and some slack; 0 (no cap) without a DP size."""
    return ranks * max(ranks, 4) + 16 if ranks else 0


def parse_engine_loads(text: str, ranks: int = 0) -> dict[int, EngineLoad]:
    """Per DP rank, the three wanted gauges; ranks that report none of them are absent, and
    with `ranks` (the DP size) so are ranks at or above it.

    With `ranks`, a family with more series than `series_cap(ranks)` is no vLLM exposition
    (a tenant's made-up ranks): ExpositionError after that many lines, so the work per read
    is bounded by the DP size, not by the text's length.

    A rank missing one of the three reads 0 for it. When a family has several series for a
    rank (another label), the last one wins: vLLM reports these gauges once per engine.
    """
    found: dict[int, dict[str, float]] = {}
    cap = series_cap(ranks)
    seen: dict[str, int] = {}
    for raw in _wanted_lines(text):
        if cap:
            family = raw[: raw.find("{")] if "{" in raw else raw.partition(" ")[0]
            seen[family] = seen.get(family, 0) + 1
            if seen[family] > cap:
                raise ExpositionError(f"more than {cap} series of {family} for {ranks} ranks: "
                                      "not read further")  # fmt: skip
        if ranks and _beyond(raw, ranks):
            continue
        name, labels, value = _sample(raw)
        field = WANTED.get(name)
        engine = labels.get("engine")
        if field is None or engine is None or not engine.isdigit():
            continue  # e.g. vllm:num_requests_running_total, or a series of no engine
        if ranks and int(engine) >= ranks:
            continue
        found.setdefault(int(engine), {})[field] = value
    return {
        rank: EngineLoad(rank, int(v.get("running", 0)), int(v.get("waiting", 0)),
                         round(v.get("kv", 0.0), 4))
        for rank, v in sorted(found.items())
    }  # fmt: skip


def complete_lines(text: str) -> str:
    """The text up to its last newline: a response cut at the size limit loses its last,
    partial line rather than reading a wrong number from it."""
    cut = text.rfind("\n")
    return text[: cut + 1] if cut >= 0 else ""


def ranks_text(ranks: Iterable[int]) -> str:
    """Ranks as '0, 2-5'."""
    out: list[str] = []
    run: list[int] = []
    for r in sorted(set(ranks)):
        if run and r == run[-1] + 1:
            run.append(r)
            continue
        if run:
            out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [r]
    if run:
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ", ".join(out)


def missing_ranks(loads: Mapping[int, EngineLoad], data_parallel_size: int) -> list[int]:
    """The planned ranks 0..size-1 that one /metrics reading has nothing for."""
    return [r for r in range(data_parallel_size) if r not in loads]
