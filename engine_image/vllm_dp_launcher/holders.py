"""Who holds the cluster's GPUs: placement groups and actors, attributed to their Ray jobs.

A ``vllm serve`` whose Ray job was never stopped keeps its placement groups (``dp_rank_<i>``),
so a new launch would pass the total-GPU gate and then wait forever in vLLM's placement.
The launcher therefore gates on available GPUs too, and when some are in use it names the
holder from Ray's state API. Everything here is pure: ``raycluster.gpu_holders`` fetches the
records (as plain dicts) and hands them to ``summarize``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# The job supervisor actor of a submission (it holds GPUs when entrypoint_num_gpus is set).
SUPERVISOR_ACTOR_PREFIX = "_ray_internal_job_actor_"
ENTRYPOINT_SHOWN = 100


@dataclass(frozen=True)
class GpuHolder:
    """One Ray job holding GPUs, and what it is known by."""

    job_id: str
    gpus: float
    node_ips: tuple[str, ...]
    placement_groups: tuple[str, ...] = ()
    actors: tuple[str, ...] = ()
    submission_id: str | None = None
    driver_alive: bool | None = None  # None: the job is not in Ray's job table
    driver: str | None = None  # e.g. "pid 4242 on 10.0.0.7"
    entrypoint: str | None = None  # the driver's command line

    @property
    def alive(self) -> bool:
        """True when the job's driver still runs: its GPUs will not come back by themselves."""
        return self.driver_alive is True

    def describe(self) -> str:
        """Return e.g. ``Ray job 02000000 (submission 'x', driver running as pid ...) ...``."""
        about = [f"submission '{self.submission_id}'"] if self.submission_id else []
        state = {True: "driver running", False: "driver exited", None: "not in Ray's job table"}
        about.append(state[self.driver_alive] + (f" as {self.driver}" if self.driver else ""))
        if self.entrypoint:
            shown = self.entrypoint[:ENTRYPOINT_SHOWN]
            about.append(f"entrypoint '{shown}{'...' if shown != self.entrypoint else ''}'")
        what = []
        if self.placement_groups:
            what.append(f"placement group(s) {_names(self.placement_groups)}")
        if self.actors:
            what.append(f"actor(s) {_names(self.actors)}")
        return (
            f"Ray job {self.job_id} ({', '.join(about)}) holds {_count(self.gpus)} GPU(s) on "
            f"{', '.join(self.node_ips) or 'unknown nodes'} through {' and '.join(what)}"
        )


@dataclass(frozen=True)
class HolderReport:
    """The GPU holders found, or why none could be listed."""

    holders: tuple[GpuHolder, ...] = ()
    error: str | None = None

    @property
    def live(self) -> tuple[GpuHolder, ...]:
        """The holders whose driver still runs."""
        return tuple(h for h in self.holders if h.alive)

    def describe(self) -> str:
        """Name every holder, or say why they are unknown."""
        if self.error:
            return f"the holders could not be listed ({self.error})"
        if not self.holders:
            return "no placement group or actor holds them (being released, or held by tasks)"
        return "; ".join(h.describe() for h in self.holders)


def _names(names: tuple[str, ...], shown: int = 4) -> str:
    """Return up to ``shown`` names and how many more."""
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")


def _count(gpus: float) -> str:
    """Show whole GPU counts without a decimal point."""
    return f"{gpus:g}"


def _gpus(resources: Mapping[str, Any] | None) -> float:
    """The GPU amount in a resource dict (0 when absent)."""
    return float((resources or {}).get("GPU", 0) or 0)


def summarize(
    placement_groups: Iterable[Mapping[str, Any]],
    actors: Iterable[Mapping[str, Any]],
    jobs: Iterable[Mapping[str, Any]],
    node_ips: Mapping[str, str],
    own_submission_id: str | None = None,
) -> HolderReport:
    """Attribute the GPUs held by created placement groups and alive actors to their jobs.

    ``placement_groups`` and ``actors`` are Ray state API records as dicts
    (``list_placement_groups(detail=True)``, ``list_actors(detail=True)``). ``jobs`` are
    Ray's job table, one dict per driver: ``job_id``, ``is_dead``, ``driver_pid``,
    ``driver_ip``, ``entrypoint``, ``submission_id``. ``node_ips`` maps node ids to IPs.
    Actors inside a placement group are counted with it.
    """
    held: dict[str, dict[str, Any]] = {}

    def entry(job_id: str) -> dict[str, Any]:
        return held.setdefault(job_id, {"gpus": 0.0, "nodes": set(), "pgs": [], "actors": []})

    for pg in placement_groups:
        if pg.get("state") != "CREATED":
            continue
        bundles = pg.get("bundles") or []
        gpus = sum(_gpus(b.get("unit_resources")) for b in bundles)
        if gpus <= 0:
            continue
        item = entry(str(pg.get("creator_job_id") or "unknown"))
        item["gpus"] += gpus
        item["pgs"].append(str(pg.get("name") or pg.get("placement_group_id")))
        item["nodes"].update(
            node_ips.get(str(b.get("node_id")), str(b.get("node_id")))
            for b in bundles
            if _gpus(b.get("unit_resources")) > 0 and b.get("node_id")
        )
    for actor in actors:
        gpus = _gpus(actor.get("required_resources"))
        name = str(actor.get("name") or "")
        if actor.get("state") != "ALIVE" or gpus <= 0 or actor.get("placement_group_id"):
            continue
        if own_submission_id and name == SUPERVISOR_ACTOR_PREFIX + own_submission_id:
            continue  # this launch's own job supervisor
        item = entry(str(actor.get("job_id") or "unknown"))
        item["gpus"] += gpus
        item["actors"].append(f"{actor.get('class_name')} (pid {actor.get('pid')})")
        if actor.get("node_id"):
            item["nodes"].add(node_ips.get(str(actor["node_id"]), str(actor["node_id"])))

    index = {str(job.get("job_id")): job for job in jobs}
    holders = []
    for job_id, item in sorted(held.items()):
        job = index.get(job_id)
        if job is None:
            job = {}
        submission = job.get("submission_id")
        if own_submission_id and submission == own_submission_id:
            continue
        holders.append(
            GpuHolder(
                job_id=job_id,
                gpus=item["gpus"],
                node_ips=tuple(sorted(item["nodes"])),
                placement_groups=tuple(sorted(item["pgs"], key=_natural)),
                actors=tuple(item["actors"]),
                submission_id=str(submission) if submission else None,
                driver_alive=None if "is_dead" not in job else not job["is_dead"],
                driver=(
                    f"pid {job['driver_pid']} on {job.get('driver_ip')}"
                    if job.get("driver_pid")
                    else None
                ),
                entrypoint=str(job["entrypoint"]) if job.get("entrypoint") else None,
            )
        )
    return HolderReport(tuple(holders))


def _natural(name: str) -> tuple[str, int]:
    """Sort ``dp_rank_10`` after ``dp_rank_9``."""
    head, _, tail = name.rpartition("_")
    return (head, int(tail)) if tail.isdigit() else (name, -1)
