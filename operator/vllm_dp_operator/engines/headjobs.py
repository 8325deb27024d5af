"""Head jobs on a ready RayCluster: launch one, watch it, stop it for real, relaunch.

A new head job starts only once no other head job of the resource can still run on the
cluster: each old one is stopped through the Ray job API and its end confirmed first (or it
died with its head pod). A head job that fails, ends, or does not serve by the launch
deadline counts as a failure and is relaunched after a backoff.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterable
from datetime import datetime, timedelta
from typing import Any

from vllm_dp_launcher.stages import ANSWERED, SERVING

from vllm_dp_operator import constants as c
from vllm_dp_operator.api import names
from vllm_dp_operator.api.models import VLLMDataParallelSpec
from vllm_dp_operator.config import Config
from vllm_dp_operator.controller.kube import RAYJOB, AlreadyExists, Kube
from vllm_dp_operator.engines.engine_metrics import missing_ranks, ranks_text
from vllm_dp_operator.engines.jobstate import (
    JobState,
    StopStep,
    annotation_time,
    deadline_passed,
    failure_reason,
    job_failure_detail,
    job_state,
    launch_stage,
    stop_step,
    submission_id,
)
from vllm_dp_operator.engines.launch_reports import Launch
from vllm_dp_operator.engines.load_summary import DWELL_SECONDS, level_of, summarize
from vllm_dp_operator.engines.lora import Adapter
from vllm_dp_operator.engines.probe import ProbeResult
from vllm_dp_operator.engines.prober import NOT_PROBED, EngineProbes, Target
from vllm_dp_operator.engines.ray_dashboard import RayJobs
from vllm_dp_operator.engines.transport import PROBES_OFF
from vllm_dp_operator.plan import Plan, lora_adapters
from vllm_dp_operator.reconcile.lora_status import replica_lora
from vllm_dp_operator.reconcile.outcome import Resource, StatusDoc
from vllm_dp_operator.reconcile.status import parse_rfc3339, rfc3339
from vllm_dp_operator.reconcile.update import drain_over
from vllm_dp_operator.render import build_head_job
from vllm_dp_operator.render.headjob import job_hash
from vllm_dp_operator.render.meta import owner_reference

#: While a head job is being stopped, how often the Ray job API is asked again: the dashboard
#: cannot be watched, so this one step is polled (it lasts at most the drain plus
#: VLLMDP_STOP_CONFIRM_SECONDS).
STOP_RECHECK_SECONDS = 2.0


def head_pod_of(pods: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    """The Ray head pod among a cluster's head pods: not terminating, running ones first."""
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    live.sort(key=lambda p: (p.get("status") or {}).get("phase") != "Running")
    return live[0] if live else None


def _labels(obj: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = obj["metadata"].get("labels") or {}
    return labels


def adapters_settled(probes: EngineProbes, target: Target | None) -> bool:
    """Whether a head's adapters are synced to what its target asks (or LoRA is off)."""
    if target is None or target.adapters is None or target.token is None:
        return True
    state = probes.adapters(target)
    return state is not None and state.settled(target.adapters)


def probed_gone(health: ProbeResult, cfg: Config, now: datetime) -> bool:
    """Whether a head that served has failed its probes long enough to be taken as gone (a
    hung engine): failures in a row over a minimum time. One blink proves nothing."""
    since = health.failing_since or now
    return (health.failures >= cfg.unroute_after_failures
            and (now - since).total_seconds() >= cfg.unroute_after_seconds)  # fmt: skip


def _running(pod: dict[str, Any], container: str) -> bool:
    """Whether the pod's container of that name runs now."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return any(s.get("name") == container and "running" in (s.get("state") or {})
               for s in statuses)  # fmt: skip


class HeadJobs:
    """One reconcile's view of a resource's head jobs on its ready cluster."""

    def __init__(
        self, kube: Kube, probes: EngineProbes, ray_jobs: RayJobs, cfg: Config, res: Resource,
        spec: VLLMDataParallelSpec, plan: Plan, cluster: str, head_pod: dict[str, Any] | None,
        st: StatusDoc, route: Callable[[bool], Awaitable[bool]], complete: bool = False,
        keep_job: str | None = None, *, token: str | None, drain_first: bool = False,
    ) -> None:  # fmt: skip
        self.kube, self.probes, self.ray_jobs, self.cfg = kube, probes, ray_jobs, cfg
        self.res, self.spec, self.plan, self.cluster = res, spec, plan, cluster
        self.head_pod, self.st, self.ns = head_pod, st, res.namespace
        #: Writes the routing decision to the API Service's EndpointSlice (reconcile/routing.py).
        self.route = route
        #: Ask one completion once /health answers: a Surge's new generation proves it serves.
        self.complete = complete
        #: A head job hash kept besides the plan's (reconcile/update.py Decision.keep_job).
        self.keep_job = keep_job
        self.health: ProbeResult = NOT_PROBED
        self.target: Target | None = None
        #: The launcher's last reported stage for the latest head job, while it is followed.
        self.said: str | None = None
        #: The cluster's Ray token, derived again rather than read from its Secret
        #: (RayTokens.of_cluster).
        self.token = token
        #: A serving head job whose plan changed is stopped only once drained: its replica's
        #: turn in a rolling update across replicas, while the others serve its clients.
        self.drain_first = drain_first

    async def converge(self, jobs: list[dict[str, Any]]) -> None:
        """Jobs are the live head jobs on this cluster, oldest attempt first."""
        want = job_hash(self.plan, self.cluster)
        current = [j for j in jobs if _labels(j).get(c.LABEL_JOB_HASH) in (want, self.keep_job)]
        latest = current[-1] if current else None
        changed = [j for j in jobs if j not in current]
        retire = [(j, "what it runs has changed", self.drain_first and self._served(j))
                  for j in changed]  # fmt: skip
        retire += [(j, "a newer head job runs the same plan", False) for j in current[:-1]]
        if latest is not None and (why := await self._failure(latest)) is not None:
            retire.append((latest, why, False))
            latest = None
        # The API Service routes to the head once its vLLM has answered, and never while an
        # old head job drains: the slice's endpoint turns unready before any stop is sent, so
        # no new request reaches engines about to stop.
        routed = latest is not None and not retire and self._routable(latest)
        routed = await self.route(routed)
        waiting = [m for job, why, first in retire if (m := await self._retire(job, why, first))]
        if latest is None:
            await self._launch_or_wait(waiting)
        else:
            await self._report(latest, waiting, routed)

    async def retire_all(self, jobs: list[dict[str, Any]], why: str) -> list[str]:
        """Take one step towards stopping each of these head jobs (a replica that leaves);
        what is still under way, in words (empty once all are gone)."""
        waiting = [m for job in jobs if (m := await self._retire(job, why))]
        if waiting:
            self.st.recheck(STOP_RECHECK_SECONDS)
        return waiting

    async def _failure(self, job: dict[str, Any]) -> str | None:
        """Why the latest head job counts as failed, or None; probes /health when it runs."""
        name, doc = job["metadata"]["name"], self.st.doc
        if name == doc["lastFailedJob"]:
            return str(doc.get("lastFailureReason") or "it failed")
        if job_state(job) in (JobState.FAILED, JobState.ENDED):
            return self._record_failure(name, failure_reason(job), c.REASON_JOB_FAILED)
        # The pool's latest answer: a reconcile never waits on an engine (engines/prober.py).
        self.target = self._target(name)
        served = self._served(job)
        # Until it has served, the launcher's own report is followed too: its `serving` line
        # has the pool probe at once (or, with probes off, is the sign of serving itself).
        # Only once its Ray job runs on a head container that runs: before that no launcher
        # writes, and a follow asked of a container not started yet fails and waits longer
        # each time (launch_reports.py); one opened on a running container stays open.
        follow = (not served and self.head_pod is not None
                  and job_state(job) is JobState.RUNNING
                  and _running(self.head_pod, c.HEAD_CONTAINER))  # fmt: skip
        said = self.said = self.probes.reported(self._launch(job)) if follow else None
        if self.cfg.health_probe == PROBES_OFF and (served or said in (SERVING, ANSWERED)):
            self.health = ProbeResult(True, "the launcher reports that vLLM answers /health "
                                      "(healthProbe.mode off: the operator sends no probe)")
        elif self.cfg.health_probe == PROBES_OFF:
            self.health = ProbeResult(False, "healthProbe.mode off: waiting for the launcher "
                                      "to report that vLLM answers /health (its last stage: "
                                      f"{said or 'none yet'})")  # fmt: skip
        else:
            self.health = self.probes.health(self.target)
        if served and self._hung():
            since = rfc3339(self.health.failing_since or self.st.now)
            why = (f"it served, then its vLLM stopped answering /health ({self.health.failures} "
                   f"probes failed in a row since {since}; {self.health.detail}): taken as hung "
                   f"after {self.cfg.relaunch_hung_after_seconds:.0f}s, stopped and relaunched")
            return self._record_failure(name, why, c.REASON_JOB_HUNG)
        timeout = self.spec.launch.timeout_seconds
        if (
            not self.health.ok
            and doc.get("servedJob") != name
            and deadline_passed(job, self.st.now, timeout)
        ):
            why = (f"it did not serve within spec.launch.timeoutSeconds ({timeout}s); stuck "
                   f"where {launch_stage(job, self.health.detail)}")  # fmt: skip
            return self._record_failure(name, why, c.REASON_JOB_TIMED_OUT)
        return None

    def _target(self, job: str, draining: bool = False) -> Target:
        """The probe target of one head job of this cluster. A draining one asks no completion
        and syncs no adapter: it has a slot of its own, read after the unroute."""
        model = (self.spec.served_model_name or self.spec.model) \
            if self.complete and not draining else None  # fmt: skip
        return Target(self.ns, self.res.name, names.head_service(self.cluster),
                      self.spec.service.port, job, model,
                      self.spec.api_key_secret_ref is not None, self.res.replica, draining,
                      head=self._head_uid() or "", ranks=self.plan.data_parallel_size,
                      complete_check=self.plan.check,
                      adapters=None if draining else self._adapters(), token=self.token)

    def _adapters(self) -> tuple[Adapter, ...] | None:
        """spec.lora's adapters, synced through the probes' pool (none with probes off: the
        operator then sends nothing to the engines, and no adapter is loaded)."""
        return lora_adapters(self.spec) if self.cfg.health_probe != PROBES_OFF else None

    def _hung(self) -> bool:
        """Whether a head job that served has failed its probes in a row long enough to be
        taken as hung: past the unroute threshold, and for relaunch_hung_after_seconds. A dead
        engine ends its head job on its own; a hung one would hold its GPUs for ever."""
        after = self.cfg.relaunch_hung_after_seconds
        if after <= 0 or self.health.ok or self.health.failing_since is None:
            return False
        failing = (self.st.now - self.health.failing_since).total_seconds()
        return probed_gone(self.health, self.cfg, self.st.now) and failing >= after

    def _launch(self, job: dict[str, Any]) -> Launch:
        assert self.head_pod is not None
        meta = job["metadata"]
        # A Surge's new generation is followed on to the launcher's own completion (`answered`).
        return Launch(self.ns, self.res.name, self.head_pod["metadata"]["name"],
                      c.HEAD_CONTAINER, meta["name"],
                      parse_rfc3339(meta.get("creationTimestamp")) or self.st.now,
                      ANSWERED if self.complete else SERVING, self.res.replica)  # fmt: skip

    def _served(self, job: dict[str, Any]) -> bool:
        """Whether this head job has served on the head pod it runs on now. KubeRay submits a
        head job again when its head pod is replaced (a new Ray head, the same name, still
        RUNNING): that run has not served yet. A status without `servedHeadPod` (written by an
        earlier version) takes the job's name alone, as that version did."""
        doc = self.st.doc
        if doc.get("servedJob") != job["metadata"]["name"]:
            return False
        served_on = doc.get("servedHeadPod")
        return served_on is None or served_on == self._head_uid()

    def _head_uid(self) -> str | None:
        return self.head_pod["metadata"]["uid"] if self.head_pod else None

    def _routable(self, job: dict[str, Any]) -> bool:
        """Whether the Service may route to this running head job: its vLLM answers now, or
        it has served and the operator's probes have not failed long enough to prove it gone."""
        doc = self.st.doc
        if self.health.ok:
            doc.update(probeFailures=None, probeFailingSince=None)
            # A head that has not served yet is routed once every adapter of spec.lora was
            # tried on it (loaded, or failed with its error kept): clients never meet a new
            # replica, or a relaunch, that lacks an adapter the others serve.
            return self._served(job) or adapters_settled(self.probes, self.target)
        if not self._served(job):
            return False  # never routed before its first answer on this head pod
        if self.health.failures == 0:
            return True  # not probed since this operator started: what served stays routed
        # A failed probe may only mean the operator could not ask (a timeout, a DNS or network
        # blink, its own busy loop). A dead engine ends the head job, which unroutes at once;
        # here only a hung engine is left, and it takes failures in a row over a minimum time.
        failures, since = self.health.failures, self.health.failing_since or self.st.now
        doc.update(probeFailures=failures, probeFailingSince=rfc3339(since))
        return not probed_gone(self.health, self.cfg, self.st.now)

    def _record_failure(self, name: str, why: str, reason: str) -> str:
        doc = self.st.doc
        doc["consecutiveFailures"] += 1
        doc.update(lastFailedJob=name, lastFailureTime=rfc3339(self.st.now), lastFailureReason=why)
        self.st.event(c.EVENT_WARNING, reason, f"Head job {name} failed: {why} (failure "
                      f"{doc['consecutiveFailures']} in a row)")  # fmt: skip
        return why

    def _drained(self, job: dict[str, Any], since: datetime) -> tuple[bool, str]:
        """Whether a serving head job that its replica's turn replaces has drained since its
        unroute: read by a probe target of its own, whose first call tells its head to close
        kept-alive connections (engines/drain.py), as a replica that leaves drains."""
        reading = self.probes.reading(self._target(job["metadata"]["name"], draining=True))
        running, idle = (None, None) if reading is None else (reading.in_flight(), reading.idle)
        return drain_over(rfc3339(since), self.spec.update.drain_seconds, running, self.st.now,
                          idle)  # fmt: skip

    async def _retire(self, job: dict[str, Any], why: str, drain_first: bool = False
                      ) -> str | None:  # fmt: skip
        """Take one step towards a stopped head job; None once it is gone, else where it is.
        `drain_first`: it serves, unrouted now; it is stopped once drained
        (spec.update.drainSeconds at most)."""
        name, sid = job["metadata"]["name"], submission_id(job)
        annotations = job["metadata"].get("annotations") or {}
        started = annotation_time(job, c.ANNOTATION_RETIRE_STARTED)
        requested = annotation_time(job, c.ANNOTATION_STOP_REQUESTED)
        draining = annotation_time(job, c.ANNOTATION_DRAIN_STARTED)
        if drain_first and requested is None and self.head_pod is not None:
            over, detail = self._drained(job, draining or self.st.now)
            if not over:
                if draining is None:
                    await self.kube.patch(RAYJOB, self.ns, name, {"metadata": {"annotations": {
                        c.ANNOTATION_DRAIN_STARTED: rfc3339(self.st.now)}}})
                    self.st.event(c.EVENT_NORMAL, c.REASON_JOB_STOPPING,
                                  f"Draining head job {name} because {why}: the API Service "
                                  "stopped routing to it, the other replicas serve; it is "
                                  "stopped once drained, in at most "
                                  f"{self.spec.update.drain_seconds}s")  # fmt: skip
                self.st.recheck(min(self.spec.update.drain_seconds + 1, c.DRAIN_PROBE_SECONDS))
                return f"draining head job {name} before its stop because {why} ({detail})"
        head_uid = self.head_pod["metadata"]["uid"] if self.head_pod else None
        lookup = (await self.ray_jobs.lookup(self.ns, self.cluster, sid, self.token)
                  if head_uid else None)  # fmt: skip
        drain = self.spec.launch.drain_seconds
        step, detail = stop_step(
            head_uid, annotations.get(c.ANNOTATION_HEAD_POD_UID), lookup, started, requested,
            self.st.now, drain, self.cfg.stop_confirm_seconds,
        )  # fmt: skip
        if step is StopStep.STOP:
            result = await self.ray_jobs.stop(self.ns, self.cluster, sid, self.token)
            requested = self.st.now if result.delivered else None
            detail = result.detail
        if step in (StopStep.DELETE, StopStep.GIVE_UP):
            await self.kube.delete(RAYJOB, self.ns, name)
            if step is StopStep.GIVE_UP:
                self.st.event(c.EVENT_WARNING, c.REASON_JOB_STOP_UNCONFIRMED,
                              f"Could not confirm that Ray job {sid} of head job {name} ended "
                              f"({detail}); deleted the RayJob and going ahead: a next launch "
                              "fails at once if old engines still hold the GPUs")  # fmt: skip
            else:
                self.st.event(c.EVENT_NORMAL, c.REASON_JOB_STOPPED,
                              f"Head job {name} has ended ({detail}); deleted its RayJob")
            return None
        marks = {}
        if started is None:
            marks[c.ANNOTATION_RETIRE_STARTED] = rfc3339(self.st.now)
            self.st.event(c.EVENT_NORMAL, c.REASON_JOB_STOPPING,
                          f"Stopping head job {name} because {why}: the API Service stops "
                          f"routing to it, and in-flight requests get {drain}s ({detail})")
        if requested is not None and c.ANNOTATION_STOP_REQUESTED not in annotations:
            marks[c.ANNOTATION_STOP_REQUESTED] = rfc3339(requested)
        if marks:
            await self.kube.patch(RAYJOB, self.ns, name, {"metadata": {"annotations": marks}})
        return f"stopping head job {name} because {why} ({detail})"

    async def _read_engines(self) -> None:
        """status.load from the head's /metrics, and which planned ranks did not report."""
        assert self.target is not None
        reading = self.probes.reading(self.target)
        expected = self.plan.data_parallel_size
        if reading is None:  # not read yet: the pool wakes this resource once it is
            self.st.doc["load"] = self.st.prev.get("load")
            return
        if reading.loads is None:
            self.st.doc["load"] = self.st.prev.get("load")  # what it last was, until read again
            self.st.cond(c.COND_ENGINES_REPORTING, False, c.REASON_METRICS_UNAVAILABLE,
                         f"vLLM's /metrics could not be read: {reading.detail}")  # fmt: skip
            return
        missing = missing_ranks(reading.loads, expected)
        load = summarize(reading.loads, self.st.prev.get("load"), self.st.now)
        self.st.doc["load"] = load
        since = parse_rfc3339(load.get("since"))
        if level_of(reading.loads) != load.get("level") and since is not None:
            # A new level waits out the last one's dwell; the pool does not wake for a level
            # it already told of, so look again when the dwell ends.
            self.st.recheck(DWELL_SECONDS - (self.st.now - since).total_seconds() + 1)
        if missing:
            self.st.cond(c.COND_ENGINES_REPORTING, False, c.REASON_RANKS_MISSING,
                         f"DP rank(s) {ranks_text(missing)} of 0-{expected - 1} report "
                         f"nothing in vLLM's /metrics ({reading.detail})")  # fmt: skip
        else:
            self.st.cond(c.COND_ENGINES_REPORTING, True, c.REASON_RANKS_REPORTING,
                         f"All {expected} DP ranks report in vLLM's /metrics")

    def _backoff_left(self) -> float:
        failures = self.st.doc["consecutiveFailures"]
        failed_at = parse_rfc3339(self.st.doc.get("lastFailureTime"))
        if failures <= 0 or failed_at is None:
            return 0.0
        return self.cfg.backoff(failures) - (self.st.now - failed_at).total_seconds()

    def _not_running(self, reason: str, phase: str, message: str) -> None:
        self.st.cond(c.COND_HEAD_JOB_RUNNING, False, reason, message)
        self.st.cond(c.COND_READY, False, reason, message)
        self.st.phase(phase, message)

    async def _launch_or_wait(self, waiting: list[str]) -> None:
        doc = self.st.doc
        failures, left = doc["consecutiveFailures"], self._backoff_left()
        failed = (f"Head job {doc['lastFailedJob']} failed ({doc.get('lastFailureReason')}); "
                  if failures and doc.get("lastFailedJob") else "")  # fmt: skip
        if waiting:
            phase = c.PHASE_BACKOFF if failures else c.PHASE_LAUNCHING
            self._not_running(c.REASON_JOB_STOPPING, phase,
                              f"{failed}{'; '.join(waiting)}; the next launch waits for that")
            self.st.recheck(STOP_RECHECK_SECONDS)
            return
        if left > 0:
            # A time, not a countdown: the message (and so the status) stays the same until
            # something happens, and `kubectl` can show the time as an age.
            at = rfc3339(self.st.now + timedelta(seconds=left))
            doc["nextLaunchTime"] = at
            self.st.recheck(left)
            self._not_running(c.REASON_JOB_BACKOFF, c.PHASE_BACKOFF,
                              f"{failed}relaunching at {at} (failure {failures} in a row,"
                              f" backoff {self.cfg.backoff(failures):.0f}s)")  # fmt: skip
            return
        if self.head_pod is None:
            self._not_running(c.REASON_WAITING_FOR_NODES, c.PHASE_PROVISIONING,
                              f"Waiting for the Ray head pod of {self.cluster}")
            return
        attempt = doc["launchAttempts"] + 1
        body = build_head_job(
            self.res.name, self.ns, self.spec, self.plan, self.cluster, attempt,
            owner_reference(self.res.name, self.res.uid), self.head_pod["metadata"]["uid"],
            self.res.replica,
        )  # fmt: skip
        with contextlib.suppress(AlreadyExists):  # an earlier, interrupted reconcile made it
            await self.kube.create(RAYJOB, self.ns, body)
        name = body["metadata"]["name"]
        reason = c.REASON_JOB_RELAUNCH if attempt > 1 else c.REASON_JOB_CREATED
        self.st.event(c.EVENT_NORMAL, reason, f"Created head job {name} on {self.cluster}")
        doc.update(headJob=name, launchAttempts=attempt)
        self._not_running(c.REASON_JOB_PENDING, c.PHASE_LAUNCHING,
                          f"Head job {name} submitted; waiting for vLLM to load {self.plan.model}")

    async def _report(self, job: dict[str, Any], waiting: list[str], routed: bool) -> None:
        name, st = job["metadata"]["name"], self.st
        st.doc["headJob"] = name
        lora = (self.probes.adapters(self.target)
                if self.target is not None and self.target.adapters is not None else None)
        st.doc["lora"] = (replica_lora(lora.loaded, lora.failed(), lora.detail)
                          if lora is not None else None)  # fmt: skip
        running = job_state(job) is JobState.RUNNING
        st.cond(c.COND_HEAD_JOB_RUNNING, running,
                c.REASON_JOB_RUNNING if running else c.REASON_JOB_PENDING,
                f"Head job {name}: {job_failure_detail(job)}")  # fmt: skip
        serving = f"Serving {self.plan.model} with DP={self.plan.data_parallel_size}"
        if routed and (self.health.ok or self.health.failures == 0):
            if self.res.status.get("phase") != c.PHASE_SERVING:
                st.event(c.EVENT_NORMAL, c.REASON_HEALTHY, f"vLLM answers /health: "
                         f"{self.health.detail}")  # fmt: skip
            st.doc.update(consecutiveFailures=0, servedJob=name, servedHeadPod=self._head_uid())
            if self.health.ok:  # else not probed yet since a restart: the condition stands
                st.cond(c.COND_READY, True, c.REASON_HEALTHY, self.health.detail)
            st.phase(c.PHASE_SERVING, serving)
            await self._read_engines()
            return
        if routed:  # served, and its probes have not failed for long enough to unroute it
            failing = (f"the operator's /health probes fail since {st.doc['probeFailingSince']} "
                       f"({self.health.detail}); still routed until "
                       f"{self.cfg.unroute_after_failures} fail in a row over "
                       f"{self.cfg.unroute_after_seconds:.0f}s")  # fmt: skip
            st.cond(c.COND_READY, True, c.REASON_PROBE_FAILING, failing)
            st.phase(c.PHASE_SERVING, f"{serving}; {failing}")
            return
        if waiting:
            message = f"Head job {name} waits: {'; '.join(waiting)}"
            st.recheck(STOP_RECHECK_SECONDS)
        elif st.doc.get("servedJob") == name:
            since = st.doc.get("probeFailingSince")
            message = (f"Head job {name} served, but /health has not answered "
                       + (f"since {since}" if since else "on this head pod yet")
                       + f" ({self.health.detail}); not routed")  # fmt: skip
        elif self.health.ok and self.target is not None and self.target.adapters is not None:
            # Not routed yet for its adapters alone (_routable).
            detail = lora.detail if lora is not None and lora.detail else "under way"
            message = (f"Head job {name}: vLLM answers /health; loading its LoRA adapters "
                       f"before it is routed ({detail})")  # fmt: skip
        else:
            created = parse_rfc3339(job["metadata"].get("creationTimestamp")) or st.now
            deadline = created + timedelta(seconds=self.spec.launch.timeout_seconds)
            st.recheck((deadline - st.now).total_seconds() + 1)  # +1: timestamps are whole s
            st.doc["launchDeadline"] = rfc3339(deadline)  # a time, not a countdown
            message = (f"Head job {name} is starting vLLM; /health not answering yet (launch "
                       f"deadline {rfc3339(deadline)}); now "
                       f"{launch_stage(job, self.health.detail)}")  # fmt: skip
        st.cond(c.COND_READY, False, c.REASON_NOT_HEALTHY, message)
        st.phase(c.PHASE_LAUNCHING, message)
