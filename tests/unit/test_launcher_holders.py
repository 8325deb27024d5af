"""Naming who holds the GPUs, from Ray state API records and Ray's job table (Ray 2.60 shapes)."""

from __future__ import annotations

from typing import Any

from vllm_dp_launcher.holders import HolderReport, summarize

NODES = {"n1" * 28: "127.0.0.2", "n2" * 28: "127.0.0.3"}
N1, N2 = NODES


def pg(name: str, job: str, node: str, state: str = "CREATED", gpus: float = 1) -> dict[str, Any]:
    """A placement group like vLLM's: one GPU bundle pinned to a node, plus a CPU bundle."""
    return {
        "placement_group_id": f"pg-{name}",
        "name": name,
        "creator_job_id": job,
        "state": state,
        "bundles": [
            {"bundle_id": 0, "node_id": node, "unit_resources": {"GPU": gpus, "node:x": 0.001}},
            {"bundle_id": 1, "node_id": node, "unit_resources": {"CPU": 1.0}},
        ],
    }  # fmt: skip


def driver(job_id: str, dead: bool = False, submission: str | None = None) -> dict[str, Any]:
    """One row of Ray's job table, as raycluster.job_table returns it."""
    return {
        "job_id": job_id, "is_dead": dead, "driver_pid": 4242, "driver_ip": "127.0.0.2",
        "entrypoint": "/usr/bin/vllm serve Qwen/Qwen2.5-7B " + "--x " * 50,
        "submission_id": submission,
    }  # fmt: skip


# A submission has two drivers: the launcher's own connection (ended), then vllm serve.
LAUNCHER = driver("04000000", dead=True, submission="qwen-launch-00003")
SERVE = driver("05000000", submission="qwen-launch-00003")
JOBS = [LAUNCHER, SERVE]


def test_placement_groups_are_attributed_to_the_submission_that_made_them() -> None:
    """vLLM's dp_rank_<i> groups name the Ray job, its submission, driver and entrypoint."""
    groups = [pg(f"dp_rank_{i}", "05000000", N1 if i < 2 else N2) for i in (10, 0, 1, 2, 3, 9)]
    report = summarize(groups, [], JOBS, NODES)

    (holder,) = report.holders
    assert holder.alive
    assert holder.gpus == 6
    assert holder.node_ips == ("127.0.0.2", "127.0.0.3")
    assert holder.placement_groups[:3] == ("dp_rank_0", "dp_rank_1", "dp_rank_2")
    text = report.describe()
    assert text.startswith(
        "Ray job 05000000 (submission 'qwen-launch-00003', driver running as pid 4242 on "
        "127.0.0.2, entrypoint '/usr/bin/vllm serve Qwen/Qwen2.5-7B --x"
    )
    assert "...') holds 6 GPU(s) on 127.0.0.2, 127.0.0.3 through placement group(s) " in text
    assert "dp_rank_0, dp_rank_1, dp_rank_2, dp_rank_3 and 2 more" in text


def test_groups_not_yet_created_and_cpu_groups_hold_nothing() -> None:
    """Only CREATED groups with GPU bundles count."""
    groups = [pg("pending", "05000000", N1, state="PENDING"), pg("cpu", "05000000", N1, gpus=0)]
    assert summarize(groups, [], JOBS, NODES) == HolderReport(())


def test_exited_driver_is_not_alive() -> None:
    """A driver that has exited: its groups are being removed, so the launch waits."""
    report = summarize([pg("dp_rank_0", "05000000", N1)], [], [{**SERVE, "is_dead": True}], NODES)
    assert report.holders and not report.live
    assert "driver exited as pid 4242" in report.describe()


def test_plain_driver_and_unknown_job() -> None:
    """A driver run by hand counts by its own liveness; an unknown job is not live."""
    report = summarize(
        [pg("dp_rank_0", "06000000", N2), pg("x", "07000000", N1)], [], [driver("06000000")], NODES
    )
    by_job = {h.job_id: h for h in report.holders}
    assert by_job["06000000"].alive and by_job["06000000"].submission_id is None
    assert not by_job["07000000"].alive
    assert "Ray job 07000000 (not in Ray's job table) holds 1 GPU(s)" in report.describe()


def test_gpu_actors_outside_groups_count_and_own_supervisor_does_not() -> None:
    """An actor with GPUs of its own is a holder; this launch's job supervisor is not."""
    actors = [
        {"actor_id": "a1", "class_name": "Trainer", "state": "ALIVE", "job_id": "05000000",
         "node_id": N2, "pid": 9, "required_resources": {"GPU": 2.0}, "placement_group_id": None},
        {"actor_id": "a2", "class_name": "EngineCoreActor", "state": "ALIVE", "job_id": "05000000",
         "node_id": N1, "pid": 8, "required_resources": {"GPU": 1.0}, "placement_group_id": "pg"},
        {"actor_id": "a3", "class_name": "JobSupervisor", "state": "ALIVE", "job_id": "01000000",
         "name": "_ray_internal_job_actor_mine", "node_id": N1, "pid": 7,
         "required_resources": {"GPU": 1.0}, "placement_group_id": None},
    ]  # fmt: skip
    report = summarize([], actors, JOBS, NODES, own_submission_id="mine")
    (holder,) = report.holders
    assert (holder.gpus, holder.actors, holder.node_ips) == (
        2.0,
        ("Trainer (pid 9)",),
        ("127.0.0.3",),
    )


def test_own_submission_is_never_a_holder() -> None:
    """GPUs held under this launch's own submission are not a stale driver."""
    report = summarize([pg("dp_rank_0", "05000000", N1)], [], JOBS, NODES,
                       own_submission_id="qwen-launch-00003")  # fmt: skip
    assert report.holders == ()


def test_unlisted_holders_are_explained() -> None:
    """No records, or no answer from Ray, is said as such."""
    assert "being released" in HolderReport(()).describe()
    assert HolderReport(error="Ray's state API: boom").describe() == (
        "the holders could not be listed (Ray's state API: boom)"
    )
