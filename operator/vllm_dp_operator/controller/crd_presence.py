"""Whether the API server serves an optional kind, from one watch of its CRD.

Kueue's Workloads are watched only where Kueue is installed. Where it is not, their reflector
used to LIST them once a minute to notice an install: at rest, the operator's only request
that came back on a timer. Instead, one more reflector follows that one CRD (a field selector
on its name) into the cache, slimmed to its versions and conditions; whether it is
Established and serves the version the operator reads is derived from there, and the
Workloads' reflector waits on it (`until_served`), at no request, and lists the moment Kueue's
CRD serves Workloads.

A CRD that cannot be read (403: RBAC without `customresourcedefinitions`) makes this blind:
`until_served` then answers False at once, and the Workloads' reflector asks every minute, as
before.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from vllm_dp_operator.controller.cache import Obj, ObjectCache
from vllm_dp_operator.controller.informer import Reflector, WatchApi
from vllm_dp_operator.controller.kube import CRD, Kind

log = logging.getLogger(__name__)


def crd_name(kind: Kind) -> str:
    """The CRD that defines a custom kind: `workloads.kueue.x-k8s.io`."""
    return f"{kind.plural}.{kind.group}"


def serves(crd: dict[str, Any], version: str) -> bool:
    """Whether a CRD is Established and serves `version`."""
    conditions = (crd.get("status") or {}).get("conditions") or []
    established = any(c.get("type") == "Established" and c.get("status") == "True"
                      for c in conditions)  # fmt: skip
    versions = (crd.get("spec") or {}).get("versions") or []
    return established and any(v.get("name") == version and v.get("served") for v in versions)


class CrdPresence:
    """Follows one CRD: `served` is set while it serves the kind's version."""

    def __init__(self, api: WatchApi, cache: ObjectCache, kind: Kind) -> None:
        self.cache, self.kind = cache, kind
        self.served = asyncio.Event()
        #: Set while the CRD cannot be read (403): nobody can wait on it then.
        self.blind = asyncio.Event()
        self.reflector = Reflector(api, cache, CRD, None, "", self._changed,
                                   on_health=self._health, optional=True,
                                   fields=f"metadata.name={crd_name(kind)}")  # fmt: skip

    def __repr__(self) -> str:
        return f"CrdPresence({crd_name(self.kind)})"

    async def until_served(self) -> bool:
        """Return True once the kind is served (at once if it is), False if that cannot be
        known (the CRD is not readable)."""
        if not self.served.is_set() and not self.blind.is_set():
            waits = {asyncio.ensure_future(self.served.wait()),
                     asyncio.ensure_future(self.blind.wait())}  # fmt: skip
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
        return self.served.is_set()

    def _changed(self, _crd: Obj) -> None:
        serving = any(serves(crd, self.kind.version) for _, crd in self.cache.items(CRD))
        if serving != self.served.is_set():
            log.info("%r: %s", self, f"serves {self.kind.version}" if serving else "not served")
        (self.served.set if serving else self.served.clear)()

    def _health(self) -> None:
        problem = self.reflector.problem
        (self.blind.set if problem is not None and problem.blocks else self.blind.clear)()
