"""The OCI runtime the kind tier's dockerd hands containers to: runc, after dropping from the
container's (or an exec'd process's) capability sets what this host's bounding set lacks.
Starts nothing itself; kinddocker.py writes the shim dockerd runs (`write_shim`).

Docker 20.10 grants a `--privileged` container every capability it knows, and kind's nodes are
privileged. Where root itself lacks one (CAP_SYS_RESOURCE on some hosts), runc refuses the
whole container ("unable to apply caps"). containerd 1.6, in the nodes, already grants only
what it has. Standard library only: the shim runs it under the host's python3.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

NAME = "vllmdp-runc"
# Linux's capabilities by number (capability.h); one the kernel does not name here is left as
# it is, for runc to judge.
CAPS = (
    "CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID",
    "SETPCAP", "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST", "NET_ADMIN", "NET_RAW",
    "IPC_LOCK", "IPC_OWNER", "SYS_MODULE", "SYS_RAWIO", "SYS_CHROOT", "SYS_PTRACE", "SYS_PACCT",
    "SYS_ADMIN", "SYS_BOOT", "SYS_NICE", "SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "MKNOD",
    "LEASE", "AUDIT_WRITE", "AUDIT_CONTROL", "SETFCAP", "MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG",
    "WAKE_ALARM", "BLOCK_SUSPEND", "AUDIT_READ", "PERFMON", "BPF", "CHECKPOINT_RESTORE",
)  # fmt: skip


def bounding_set(status: str | None = None) -> set[str]:
    """The capabilities in this process's bounding set (from /proc/self/status)."""
    status = status if status is not None else Path("/proc/self/status").read_text()
    bnd = int(next(ln for ln in status.splitlines() if ln.startswith("CapBnd:")).split()[1], 16)
    return {"CAP_" + c for i, c in enumerate(CAPS) if bnd >> i & 1}


def trim(doc: dict[str, Any], have: set[str]) -> dict[str, Any]:
    """`doc`'s capability sets (a runtime spec's `process`, or a process spec) without the
    known capabilities outside `have`."""
    for key, caps in (doc.get("capabilities") or {}).items():
        doc["capabilities"][key] = [c for c in caps
                                    if c in have or c.removeprefix("CAP_") not in CAPS]  # fmt: skip
    return doc


def _trim_file(path: str, in_process: bool, have: set[str]) -> None:
    with open(path) as f:
        doc = json.load(f)
    trim(doc.get("process", {}) if in_process else doc, have)
    with open(path, "w") as f:
        json.dump(doc, f)


def main(runc: str, args: list[str]) -> None:
    """Trim the bundle's or the process file's capabilities, then exec runc with `args`."""
    have = bounding_set()
    for i, a in enumerate(args):
        if a in ("--bundle", "-b") and i + 1 < len(args):
            _trim_file(os.path.join(args[i + 1], "config.json"), True, have)
        elif a.startswith("--bundle="):
            _trim_file(os.path.join(a.split("=", 1)[1], "config.json"), True, have)
        elif a in ("--process", "-p") and i + 1 < len(args):
            _trim_file(args[i + 1], False, have)
    os.execv(runc, ["runc", *args])


def write_shim(path: Path, runc: str, python: str) -> Path:
    """The executable dockerd runs as its runtime: `python` running this module's `main`."""
    here = str(Path(__file__).resolve().parent)
    path.write_text(f"#!{python}\nimport sys\nsys.path.insert(0, {here!r})\nimport kindruntime\n"
                    f"kindruntime.main({runc!r}, sys.argv[1:])\n")  # fmt: skip
    path.chmod(0o755)
    return path


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
