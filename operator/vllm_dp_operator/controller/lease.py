"""Leader election on a coordination.k8s.io/v1 Lease, with client-go's semantics.

One process holds the Lease and writes; the others keep their caches warm and wait.
- **Acquire**: create the Lease, or update it (with its resourceVersion as precondition) once
  the holder's lease has expired *by this process's own clock*: expiry is counted from when
  this process last saw the record change, never from the record's renewTime, which another
  machine's clock wrote. A record with no holder (released on a clean shutdown) is free at once.
- **Renew**: the holder updates renewTime every retry period. When no renewal succeeded within
  the renew deadline, or the record names someone else, leadership is lost. As client-go's
  fast path does, a holder renews with one PUT on the record it last wrote, and reads the
  record first only when that PUT did not land (a 409, or no answer): at rest a leader makes
  one request per retry period, not two.
- **The write gate**: `may_write()` holds only while this process leads and its last renewal
  *began* within the renew deadline. The deadline (10 s) is shorter than the lease (15 s), so a
  process that cannot renew stops writing at least 5 s before any standby may take over.
- **Release**: on a clean shutdown the holder clears holderIdentity, so a standby leads at once.
- **Its own thread**: the loop runs on a thread of its own, with its own event loop and HTTP
  client (`lease_thread.py`), so a busy reconcile loop never delays a renewal. The gate is
  read from the controller's thread: the pair it reads (leading, last renewal sent) changes
  under one lock.

Times are monotonic seconds from `clock` (a fake one in the unit tests); the record's
timestamps are informational (RFC 3339 from `wall`), as in client-go.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from vllm_dp_operator.controller.kube import REQUEST_TIMEOUT, Kind, resession

log = logging.getLogger(__name__)

LEASE = Kind("coordination.k8s.io", "v1", "leases")
#: Longest one Lease request may take: a hung call must not outlive the renew deadline.
LEASE_REQUEST_TIMEOUT = 5.0


class Conflict(Exception):
    """A create or update of the Lease lost a race (HTTP 409)."""


class NotLeading(Exception):
    """A write was refused: this process does not hold the Lease, or has not renewed it within
    the renew deadline."""


@dataclass(frozen=True)
class ElectionConfig:
    """Where the Lease is, who this process is, and controller-runtime's default timings."""

    namespace: str
    name: str
    identity: str
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0


class LeaseApi(Protocol):
    """The three Lease calls an elector makes."""

    async def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The Lease, or None when there is none."""
        ...

    async def create(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        """Create the Lease; raise Conflict when it exists."""
        ...

    async def replace(self, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """Update the Lease (PUT, body's resourceVersion as precondition); Conflict on 409."""
        ...


class ApiLeases:
    """LeaseApi over a REST client: the one given, or with none given one of its own, made on
    the first call in the loop that calls (the election thread's) and closed by `close`."""

    def __init__(self, api: client.ApiClient | None = None, user_agent: str | None = None) -> None:
        self._api, self._own = api, api is None
        self._user_agent = user_agent

    def _client(self) -> client.ApiClient:
        if self._api is None:
            # The kubeconfig or in-cluster credentials the process loaded as its default.
            self._api = client.ApiClient()
            if self._user_agent:
                self._api.user_agent = self._user_agent
            resession(self._api)
        return self._api

    async def close(self) -> None:
        """Close the client this made for itself (a given one belongs to its giver)."""
        if self._own and self._api is not None:
            await self._api.close()
            self._api = None

    async def _call(self, method: str, path: str, body: Any = None) -> Any:
        try:
            return await self._client().call_api(
                path, method,
                header_params={"Accept": "application/json", "Content-Type": "application/json"},
                body=body, response_types_map={200: "object", 201: "object"},
                auth_settings=["BearerToken"], _return_http_data_only=True,
                _request_timeout=min(REQUEST_TIMEOUT, LEASE_REQUEST_TIMEOUT),
            )  # fmt: skip
        except ApiException as exc:
            if exc.status == 409:
                raise Conflict(path) from exc
            raise

    async def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The Lease, or None when there is none."""
        try:
            obj: dict[str, Any] = await self._call("GET", LEASE.path(namespace, name))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return obj

    async def create(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        """Create the Lease; raise Conflict when it exists."""
        obj: dict[str, Any] = await self._call("POST", LEASE.path(namespace), body)
        return obj

    async def replace(self, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """Update the Lease with its resourceVersion as precondition."""
        obj: dict[str, Any] = await self._call("PUT", LEASE.path(namespace, name), body)
        return obj


def _micro_time(now: datetime) -> str:
    # metav1.MicroTime: RFC 3339 with microseconds, in UTC.
    return now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    """One process's view of the Lease, the attempts to acquire and renew it, and the gate."""

    def __init__(
        self, api: LeaseApi, cfg: ElectionConfig,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:  # fmt: skip
        if not cfg.retry_period < cfg.renew_deadline < cfg.lease_duration:
            raise ValueError(
                "leader election: need retry period < renew deadline < lease duration, got "
                f"{cfg.retry_period} < {cfg.renew_deadline} < {cfg.lease_duration}"
            )
        self.api, self.cfg, self._clock, self._wall = api, cfg, clock, wall
        #: The gate's pair, written by the election thread and read by any: under `_lock`.
        self._lock = threading.Lock()
        self._leading = False
        #: When the last successful acquire or renewal was *sent* (monotonic).
        self._renewed_at = float("-inf")
        #: The record as last seen, and when this process saw it change (monotonic).
        self._observed: dict[str, Any] | None = None
        self._observed_at = float("-inf")
        #: The Lease object as this process last wrote it (its resourceVersion is the next
        #: renewal's precondition), or None when the next attempt must read the record first.
        self._written: dict[str, Any] | None = None
        #: When the Lease API last answered, and the last error when it did not.
        self._answered_at = float("-inf")
        self._api_error = "no Lease request made yet"
        self.transitions = 0

    @property
    def identity(self) -> str:
        """This process's holderIdentity."""
        return self.cfg.identity

    @property
    def holder(self) -> str:
        """The holder named by the record as last seen ("" for none)."""
        return str((self._observed or {}).get("holderIdentity") or "")

    # ------------------------------------------------------------------ the gate

    @property
    def leading(self) -> bool:
        """Whether this process holds the Lease by its last attempt."""
        with self._lock:
            return self._leading

    def may_write(self) -> bool:
        """Whether this process leads and renewed within the renew deadline."""
        with self._lock:
            leading, renewed_at = self._leading, self._renewed_at
        return leading and self._clock() - renewed_at < self.cfg.renew_deadline

    def _renewed(self, sent_at: float) -> None:
        with self._lock:
            self._leading, self._renewed_at = True, sent_at

    def _stop_leading(self) -> None:
        with self._lock:
            self._leading = False
        self._written = None

    def check(self) -> None:
        """Raise NotLeading unless this process may write now."""
        if not self.may_write():
            raise NotLeading(f"{self.identity} does not hold Lease {self.cfg.namespace}/"
                             f"{self.cfg.name} (holder: {self.holder or 'none'})")  # fmt: skip

    def healthy(self) -> tuple[bool, str]:
        """Whether the Lease API answered within one lease duration (so this could lead)."""
        age = self._clock() - self._answered_at
        if age <= self.cfg.lease_duration:
            role = "leader" if self.leading else f"standby (leader: {self.holder or 'none'})"
            return True, f"Lease API answers; {role}"
        return False, f"Lease API not answering: {self._api_error}"

    # ------------------------------------------------------------------ one attempt

    def _spec(self, old: dict[str, Any] | None, now: datetime) -> dict[str, Any]:
        mine = old is not None and old.get("holderIdentity") == self.identity
        stamp = _micro_time(now)
        transitions = int((old or {}).get("leaseTransitions") or 0)
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": round(self.cfg.lease_duration),
            "acquireTime": (old or {}).get("acquireTime") if mine else stamp,
            "renewTime": stamp,
            "leaseTransitions": transitions if mine or old is None else transitions + 1,
        }

    def _observe(self, spec: dict[str, Any], at: float) -> None:
        if spec != self._observed:
            self._observed, self._observed_at = dict(spec), at

    def _expired(self, spec: dict[str, Any], now: float) -> bool:
        duration = float(spec.get("leaseDurationSeconds") or self.cfg.lease_duration)
        return self._observed_at + duration <= now

    def _won(self, spec: dict[str, Any], sent_at: float) -> None:
        if not self.leading:
            self.transitions += 1
            log.info("Acquired Lease %s/%s as %s", self.cfg.namespace, self.cfg.name,
                     self.identity)  # fmt: skip
        self._observe(spec, sent_at)
        self._renewed(sent_at)

    def _lost(self, why: str) -> None:
        if self.leading:
            log.error("Lost Lease %s/%s: %s", self.cfg.namespace, self.cfg.name, why)
        self._stop_leading()

    async def try_acquire_or_renew(self) -> bool:
        """One attempt to take or keep the Lease; whether this process holds it after."""
        sent_at = self._clock()
        if self._written is not None and self.may_write() and await self._renew_blind(sent_at):
            return True
        try:
            current = await self.api.get(self.cfg.namespace, self.cfg.name)
        except Exception as exc:  # any failure to reach the API: not ready, try again
            self._api_error = repr(exc)[:300]
            return self.may_write()
        self._answered_at = self._clock()
        if current is None:
            spec = self._spec(None, self._wall())
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.cfg.name, "namespace": self.cfg.namespace},
                    "spec": spec}  # fmt: skip
            return await self._write(self.api.create(self.cfg.namespace, body), spec, sent_at)
        old = current.get("spec") or {}
        # Seen when the answer came (the later moment): another's lease never looks shorter.
        self._observe(old, self._answered_at)
        holder = old.get("holderIdentity") or ""
        if holder != self.identity:
            if self.leading:
                self._lost(f"the record names {holder or 'no holder'}")
                return False
            if holder and not self._expired(old, self._answered_at):
                return False
        spec = self._spec(old, self._wall())
        body = {**current, "spec": spec}  # metadata.resourceVersion: the precondition
        return await self._write(
            self.api.replace(self.cfg.namespace, self.cfg.name, body), spec, sent_at
        )

    async def _renew_blind(self, sent_at: float) -> bool:
        """Renew with one PUT on the record as last written; whether it landed. When it did
        not, the caller reads the record (the same attempt, as client-go does)."""
        last, self._written = self._written, None
        assert last is not None
        spec = self._spec(last.get("spec") or {}, self._wall())
        try:
            written = await self.api.replace(self.cfg.namespace, self.cfg.name,
                                             {**last, "spec": spec})  # fmt: skip
        except Conflict:
            return False  # changed since (another's takeover, or our timed-out renewal landed)
        except Exception as exc:
            self._api_error = repr(exc)[:300]
            return False
        self._answered_at = self._clock()
        self._won((written or {}).get("spec") or spec, sent_at)
        self._keep(written)
        return True

    def _keep(self, written: Any) -> None:
        has_version = isinstance(written, dict) and (written.get("metadata") or {}).get(
            "resourceVersion")
        self._written = written if has_version and self.leading else None

    async def _write(self, call: Any, spec: dict[str, Any], sent_at: float) -> bool:
        try:
            written = await call
        except Conflict:
            # The record changed since we read it (another's takeover, or an earlier renewal
            # of ours that timed out here but landed): read it again next time, and until then
            # the gate's clock alone decides.
            self._answered_at = self._clock()
            return self.may_write() if self.leading else False
        except Exception as exc:
            self._api_error = repr(exc)[:300]
            return self.may_write()
        self._answered_at = self._clock()
        self._won((written or {}).get("spec") or spec, sent_at)
        self._keep(written)
        return True

    # ------------------------------------------------------------------ the loop

    async def run(self, on_started: Callable[[], None], on_stopped: Callable[[], None]) -> None:
        """Acquire (retrying), call on_started, renew until lost, then call on_stopped."""
        while not await self.try_acquire_or_renew():
            # client-go's jitter (up to 1.2 x): standbys do not all ask at the same moment.
            await asyncio.sleep(self.cfg.retry_period * random.uniform(1.0, 1.2))
        on_started()
        while True:
            await asyncio.sleep(self.cfg.retry_period)
            left = self._renewed_at + self.cfg.renew_deadline - self._clock()
            if left <= 0 or not self.leading:
                break
            try:
                await asyncio.wait_for(self.try_acquire_or_renew(), timeout=left)
            except TimeoutError:
                self._api_error = "a renewal outlived the renew deadline"
            if not self.may_write():
                break
        self._lost(f"not renewed within {self.cfg.renew_deadline:g}s")
        on_stopped()

    async def release(self) -> None:
        """Clear holderIdentity if this process holds the Lease (a clean shutdown)."""
        if not self.leading:
            return
        self._stop_leading()  # the gate closes before the record says so
        try:
            current = await self.api.get(self.cfg.namespace, self.cfg.name)
            if current is None or (current.get("spec") or {}).get("holderIdentity") != \
                    self.identity:  # fmt: skip
                return
            now = _micro_time(self._wall())
            spec = {**current["spec"], "holderIdentity": "", "leaseDurationSeconds": 1,
                    "acquireTime": now, "renewTime": now}  # fmt: skip
            await self.api.replace(self.cfg.namespace, self.cfg.name, {**current, "spec": spec})
            log.info("Released Lease %s/%s", self.cfg.namespace, self.cfg.name)
        except Exception as exc:  # a standby then waits out the lease instead
            log.warning("Could not release Lease %s/%s: %r", self.cfg.namespace, self.cfg.name,
                        exc)  # fmt: skip
