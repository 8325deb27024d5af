#!/usr/bin/env python3
"""What the test beds and the project's scripts need from the host: one table of every host
command they call, with the Debian package that provides it. Checked before anything is built.

    python3 tests/testbed/hostreqs.py check [USE ...]    print what is missing; exit 1 if any
    python3 tests/testbed/hostreqs.py install [USE ...]  apt-get install what is missing (root)
    python3 tests/testbed/hostreqs.py ensure [USE ...]   as root: install; else: check (make)
    python3 tests/testbed/hostreqs.py list [USE ...]     the table

USE is a column of the table (`base`, `build`, `kwok`, `cluster`, ...; `list` shows them);
without one, every use but the opt-in ones (`docker`). A kwok bed needs less than the
real-node bed, but each command has one row.

Which commands are host commands. This is the rule `tests/unit/test_hostreqs.py` enforces on
every module of tests/testbed/ and hack/ (and the scripts and test helpers that start beds):
- A host command is one the code runs by a bare name, resolved on PATH (`["nft", ...]`,
  `shutil.which("go")`, `command -v zstd`), or by an absolute path outside the cache
  (`/usr/bin/containerd`, `/usr/lib/cni/bridge`). It must be a row here, with its package.
- A program the project builds or installs itself is not one: kubelet, kube-apiserver,
  kubectl, kwok, KubeRay, CoreDNS, helm (from the Go module proxy), the venv's Python and
  what pip put there. The code runs those by a path computed at run time from the cache or
  the interpreter (`bd / "kubelet"`, `helm_binary()`, `sys.executable`), never by a bare name.
Go is a host command that Debian does not provide in a new enough version: it comes from the
Go toolchain's own release archive, found as `go` on PATH (or in /usr/local/go/bin, which
`check` then names).

Standard library only: `make venv` runs it before the venv exists.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

# What needs a row, by column. `install` is apt-get itself: only `install` needs it.
USES = {
    "base": "make, its shell scripts, `make venv`",
    "build": "Go builds: the beds' binaries (make testbed-build, cluster-build) and helm",
    "chart": "tests/chart/ensure_helm.sh (the pinned helm; chart tests, `cluster operator`)",
    "kwok": "the control-plane bed (testbed-up, test-controlplane, test-reliability, dev SIM=1)",
    "cluster": "the real-node bed (cluster-up, test-cluster, make dev)",
    "images": "test images with no Docker (make images, make dev, test-cluster)",
    "ray": "the Ray tier (test-ray: cutting one Ray node off)",
    "observability": "a real Prometheus scraping the operator (test-controlplane, test-cluster)",
    "docker": "opt-in: make image, engine-image (the user's Docker)",
    "kind": "the kind tier (make e2e-kind, kind-build, make test): its own Docker engine",
    "install": "apt-get, for `install` itself",
}
OPT_IN = ("docker", "install")
DEFAULT_USES = tuple(u for u in USES if u not in OPT_IN)
GO = "the Go toolchain, `go` on PATH"
GO_HINT = ("install Go from its release archive, at least the `go` line of tests/testbed/go.mod "
           "(Debian's golang is older)")
# Where a command may be installed but off PATH (root's PATH without sbin, Go's archive).
USUAL_DIRS = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin",
              "/usr/local/go/bin")  # fmt: skip


@dataclass(frozen=True)
class Need:
    """One host command (or a file the beds use at a fixed path) and where it comes from."""

    name: str  # a command on PATH; an absolute path; or a Python module (`module=True`)
    package: str | None  # the Debian package; None: see `source`
    uses: tuple[str, ...]
    why: str
    module: bool = False  # a module of the python3 that runs `make venv`
    source: str = ""  # where it comes from when Debian does not provide it
    override: str = ""  # an environment variable that may name the binary instead

    @property
    def origin(self) -> str:
        return f"Debian package {self.package}" if self.package else self.source


def _n(name: str, package: str | None, uses: str, why: str, *, module: bool = False,
       source: str = "", override: str = "") -> Need:  # fmt: skip
    return Need(name, package, tuple(uses.split()), why, module, source, override)


TABLE: tuple[Need, ...] = (
    _n("make", "make", "base", "every task (Makefile)"),
    _n("bash", "bash", "base chart images", "Makefile SHELL, .ci/run, ensure_helm.sh, imagefs"),
    _n("sh", "dash", "cluster kwok", "KubeRay's and Kueue's wrapper in their own mount namespace"),
    _n("python3", "python3", "base", "`make venv`, hostreqs itself"),
    _n("ensurepip", "python3-venv", "base", "`python3 -m venv` (Debian splits it out)",
       module=True),
    _n("grep", "grep", "base", "`make help`"),
    _n("awk", "mawk", "base", "`make help`"),
    _n("date", "coreutils", "base", ".ci/run's timing"),
    _n("dirname", "coreutils", "base", ".ci/run"),
    _n("flock", "util-linux", "base images", "one bed at a time (/tmp/vdp-bed.lock), images-smoke"),
    _n("go", None, "build chart", "builds the beds' binaries and helm; `go mod download`",
       source=GO),
    _n("sed", "sed", "chart", "ensure_helm.sh reads helm's go.mod"),
    _n("mktemp", "coreutils", "chart", "ensure_helm.sh"),
    _n("mkdir", "coreutils", "chart images", "ensure_helm.sh, imagefs's chroot wrapper"),
    _n("mv", "coreutils", "chart", "ensure_helm.sh"),
    _n("rm", "coreutils", "chart", "ensure_helm.sh"),
    _n("etcd", "etcd-server", "kwok cluster", "the beds' etcd (binaries.find_etcd)",
       override="VLLMDP_ETCD"),
    _n("openssl", "openssl", "kwok cluster", "the beds' CA and certificates (pki.py)"),
    _n("git", "git", "kwok",
       "the release before replicas, from the project's history (reliability tier)"),
    _n("ip", "iproute2", "kwok cluster images kind",
       "pod network namespace (podnet), addresses on lo (hostnet), image smoke loopback"),
    _n("nft", "nftables", "cluster kind",
       "the nftables tables iptables-nft makes (hostnet); kind tier's down check"),
    _n("iptables", "iptables", "cluster ray kind",
       "KUBE-*/CNI-* chains (hostnet); Ray node cut-off; the host's FORWARD policy (kinddocker); "
       "an operator pod cut off from the head (cluster tier)"),
    _n("ip6tables", "iptables", "cluster", "KUBE-*/CNI-* chains, IPv6 (hostnet)"),
    _n("iptables-save", "iptables", "cluster kind", "finding our chains (hostnet, kinddocker)"),
    _n("ip6tables-save", "iptables", "cluster kind", "finding our chains, IPv6 (hostnet)"),
    _n("iptables-restore", "iptables", "cluster", "kube-proxy's iptables mode"),
    _n("ip6tables-restore", "iptables", "cluster", "kube-proxy's iptables mode, IPv6"),
    _n("ipset", "ipset", "cluster",
       "the NetworkPolicy enforcer's address sets (kube-router's firewall; netpolicy)"),
    _n("/usr/bin/containerd", "containerd", "cluster", "each node's runtime (realnodes)"),
    _n("/usr/bin/ctr", "containerd", "cluster", "image import, container cleanup (realnodes)"),
    _n("runc", "runc", "cluster kind", "containerd's OCI runtime; the kind tier's dockerd's"),
    _n("/usr/lib/cni/bridge", "containernetworking-plugins", "cluster", "each node's pod bridge"),
    _n("/usr/lib/cni/host-local", "containernetworking-plugins", "cluster", "pod addresses"),
    _n("/usr/lib/cni/loopback", "containernetworking-plugins", "cluster", "pod loopback"),
    _n("mount", "mount", "cluster images kwok", "KubeRay's resolv.conf, overlays"),
    _n("umount", "mount", "cluster", "`cluster down` (realbed)"),
    _n("unshare", "util-linux", "cluster images kwok", "private mount namespaces"),
    _n("nsenter", "util-linux", "cluster",
       "cluster tier: DNS as KubeRay sees it; a pod's network namespace (podfaults)"),
    _n("getent", "libc-bin", "cluster", "cluster tier: DNS as KubeRay sees it"),
    _n("zstd", "zstd", "cluster images kind", "compressed layers (oci.py, imagebuild)"),
    _n("debootstrap", "debootstrap", "images", "the images' Debian base (imagefs)"),
    _n("gpgv", "gpgv", "images", "debootstrap checks the archive's signature"),
    _n("/usr/share/keyrings/debian-archive-keyring.gpg", "debian-archive-keyring", "images",
       "debootstrap checks the archive's signature"),
    _n("chroot", "coreutils", "images", "image layers and smoke checks (imagefs)"),
    _n("cp", "coreutils", "images", "imagefs's chroot wrapper"),
    _n("chmod", "coreutils", "images", "imagefs's chroot wrapper"),
    _n("tar", "tar", "images", "unpacking an image for its smoke checks (imagesmoke)"),
    _n("prometheus", "prometheus", "observability", "scrapes the operator and vLLM (promlib)"),
    _n("docker", "docker.io", "docker kind", "make image, engine-image; the kind tier's CLI"),
    _n("dockerd", "docker.io", "kind", "the kind tier's own Docker engine (kinddocker)"),
    _n("apt-get", "apt", "install", "`hostreqs.py install`"),
)
BY_NAME = {n.name: n for n in TABLE}


def needs(uses: Iterable[str] = DEFAULT_USES) -> list[Need]:
    """The rows any of `uses` needs (an unknown use raises, naming the known ones)."""
    wanted = set(uses)
    if unknown := wanted - set(USES):
        raise ValueError(f"unknown use {sorted(unknown)}: choose from {', '.join(USES)}")
    return [n for n in TABLE if wanted & set(n.uses)]


@dataclass(frozen=True)
class Host:
    """How a row is looked for; a test passes its own to show what a missing one says."""

    # PATH only, as subprocess resolves it: a command in /usr/sbin off this PATH is missing.
    which: Callable[[str], str | None] = shutil.which
    exists: Callable[[str], bool] = os.path.exists
    has_module: Callable[[str], bool] = lambda m: importlib.util.find_spec(m) is not None
    is_root: Callable[[], bool] = lambda: os.geteuid() == 0

    def off_path(self, name: str) -> str | None:
        """The directory holding `name` when it is installed but not on PATH."""
        found = shutil.which(name, path=os.pathsep.join(USUAL_DIRS))
        return str(Path(found).parent) if found and self.exists(found) else None


def present(need: Need, host: Host = Host()) -> bool:
    """Whether the host has it: on PATH, at its absolute path, or importable."""
    if need.override and host.exists(os.environ.get(need.override) or "/nonexistent"):
        return True
    if need.module:
        return host.has_module(need.name)
    if need.name.startswith("/"):
        return host.exists(need.name)
    return host.which(need.name) is not None


def missing(rows: Iterable[Need], host: Host = Host()) -> list[Need]:
    return [n for n in rows if not present(n, host)]


def packages(rows: Iterable[Need], host: Host = Host()) -> list[str]:
    """The Debian packages to install for `rows` (not for a command that is only off PATH)."""
    return sorted({n.package for n in rows if n.package and not _off_path(n, host)})


def _off_path(need: Need, host: Host) -> str | None:
    plain = not (need.module or need.name.startswith("/"))
    return host.off_path(need.name) if plain else None


def explain(gone: Sequence[Need], host: Host = Host()) -> str:
    """What is missing, one line each naming its package, and how to install it."""
    lines = []
    for n in gone:
        where = _off_path(n, host)
        lines.append(f"missing: {n.name} ({n.origin}): {n.why}"
                     + (f"; it is in {where}, which is not on PATH" if where else ""))  # fmt: skip
        if n.name == "go" and not where:
            lines.append(f"  go: {GO_HINT}")
    if pkgs := packages(gone, host):
        lines.append(f"install as root: python3 tests/testbed/hostreqs.py install "
                     f"(= apt-get install {' '.join(pkgs)})")  # fmt: skip
    return "\n".join(lines)


class MissingHostCommand(RuntimeError):
    """A host command the beds need is missing and was not installed."""


def _say(msg: str) -> None:
    print(msg, flush=True)  # before apt-get's own output and any error on stderr


def install(rows: Sequence[Need], host: Host = Host(), run: Callable[..., object] = subprocess.run,
            log: Callable[[str], None] = _say) -> list[Need]:  # fmt: skip
    """apt-get install the packages of what is missing of `rows` (`apt-get update` once
    first); return what was missing. Raises MissingHostCommand naming each command and its
    package when apt-get is absent, fails, or leaves one missing."""
    gone = missing(rows, host)
    if not gone:
        return []
    if pkgs := packages(gone, host):
        apt = host.which("apt-get")
        if apt is None:
            raise MissingHostCommand(f"no apt-get here to install them:\n{explain(gone, host)}")
        if not host.is_root():
            raise MissingHostCommand(f"installing needs root:\n{explain(gone, host)}")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        log(f"[hostreqs] apt-get install {' '.join(pkgs)} "
            f"(for {', '.join(n.name for n in gone if n.package)})")  # fmt: skip
        for argv in ([apt, "update", "-q"],
                     [apt, "install", "-y", "-q", "--no-install-recommends", *pkgs]):  # fmt: skip
            proc = run(argv, env=env, capture_output=True, text=True)
            rc = getattr(proc, "returncode", 1)
            if rc != 0:
                said = (getattr(proc, "stderr", "") or getattr(proc, "stdout", "") or "")[-2000:]
                raise MissingHostCommand(
                    f"`apt-get {argv[1]}` failed (exit {rc}) installing these:\n"
                    f"{explain(gone, host)}\napt-get said:\n{said.strip()}")  # fmt: skip
        importlib.invalidate_caches()
    if still := missing(gone, host):
        why = ("still missing after apt-get install" if packages(still, host)
               else "not installable by apt-get")  # fmt: skip
        raise MissingHostCommand(f"{why}:\n{explain(still, host)}")
    return gone


def ensure(rows: Sequence[Need], host: Host = Host(), log: Callable[[str], None] = _say) -> None:
    """Before anything is built: as root, install what is missing; otherwise fail naming it."""
    gone = missing(rows, host)
    if not gone:
        return
    fixable = all(n.package and not _off_path(n, host) for n in gone)
    if fixable and host.is_root() and host.which("apt-get"):
        install(gone, host, log=log)
        return
    raise MissingHostCommand(explain(gone, host))


def ensure_uses(*uses: str) -> None:
    """ensure() for the rows of `uses`; what testbed.py and the builds call first."""
    ensure(needs(uses))


def command_path(name: str, host: Host = Host()) -> str:
    """The path of one host command of the table, installed first (as root) when missing; one
    installed off PATH (debootstrap in /usr/sbin for a user) is run by its path."""
    need = BY_NAME[name]  # a KeyError here: the command is not in the one list
    if need.name.startswith("/"):
        ensure([need], host)
        return need.name
    where = host.which(name) or ((d := host.off_path(name)) and str(Path(d) / name))
    if where:
        return where
    ensure([need], host)
    found = host.which(name)
    if found is None:
        raise MissingHostCommand(explain([need], host))
    return found


def _table(uses: Sequence[str]) -> str:
    rows = [f"{'command':48s} {'Debian package':30s} uses"]
    for n in needs(uses):
        mark = "" if present(n) else "   <- MISSING"
        origin = n.package or "(the Go toolchain)"
        rows.append(f"{n.name:48s} {origin:30s} {','.join(n.uses)}{mark}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="uses:\n" + "\n".join(f"  {k:14s} {v}"
                                                             for k, v in USES.items()))  # fmt: skip
    p.add_argument("cmd", choices=("check", "install", "ensure", "list"))
    p.add_argument("uses", nargs="*", help="default: every use but " + ", ".join(OPT_IN))
    a = p.parse_args(argv)
    uses = tuple(a.uses) or DEFAULT_USES
    try:
        rows = needs(uses)
        if a.cmd == "list":
            print(_table(uses))
        elif a.cmd == "check":
            gone = missing(rows)
            if gone:
                print(explain(gone), file=sys.stderr)
                return 1
            print(f"[hostreqs] every host command for {', '.join(uses)} is here "
                  f"({len(rows)} checked)")  # fmt: skip
        elif a.cmd == "install":
            done = install(rows)
            print(f"[hostreqs] installed {' '.join(packages(done))}" if done
                  else "[hostreqs] nothing missing")  # fmt: skip
        else:
            ensure(rows)
    except (MissingHostCommand, ValueError) as e:
        print(f"[hostreqs] {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
