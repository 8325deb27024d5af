"""Builds what the kind tier adds to the bed's binaries; starts nothing.

- kind itself, `go install sigs.k8s.io/kind@KIND_VERSION`;
- kubeadm, from `kindcmd/` (the bed's Kubernetes release and staging pins, plus what kubeadm
  alone needs, so the bed's own go.sum and cache keys stay as they are);
- etcd KIND_ETCD_VERSION, the version kubeadm asks for, from `kindcmd/etcd/` (Debian's etcd
  is older than kubeadm's static pod expects: flags, /livez and /readyz).

Cached in `<cache>/kind-<key>/` like binaries.py's builds (same lock, same `_cached_build`),
keyed by these pins, the Kubernetes release and kindcmd's go.mod/go.sum files; the kind
module's own files (the node image's entrypoint and units) come from `go mod download` at
image build time (`module_files`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import binaries
from common import HERE, BuildError, cache_root, versions

KINDCMD = HERE / "kindcmd"
ETCDCMD = KINDCMD / "etcd"
KIND_MODULE = "sigs.k8s.io/kind"
ETCD_PACKAGE = "go.etcd.io/etcd/server/v3"
RECIPE = "1"
COMMANDS = ("kind", "kubeadm", "etcd")


def key() -> str:
    v = versions()
    h = hashlib.sha256(f"recipe={RECIPE}\0".encode())
    for pin in ("KIND_VERSION", "KIND_ETCD_VERSION", "KUBERNETES_VERSION"):
        h.update(f"{pin}={v[pin]}\0".encode())
    for f in (KINDCMD / "go.mod", KINDCMD / "go.sum", ETCDCMD / "go.mod", ETCDCMD / "go.sum"):
        h.update(f.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def bin_dir() -> Path:
    return cache_root() / f"kind-{key()}"


def present(d: Path | None = None) -> bool:
    d = d or bin_dir()
    return all((d / c).is_file() for c in COMMANDS)


def _check_etcd_pin() -> str:
    want = versions()["KIND_ETCD_VERSION"]
    found = re.search(r"go\.etcd\.io/etcd/server/v3 (v\S+)", (ETCDCMD / "go.mod").read_text())
    if not found or found.group(1) != want:
        raise BuildError(f"kindcmd/etcd/go.mod must require {ETCD_PACKAGE} {want} "
                         f"(versions.env KIND_ETCD_VERSION), found "
                         f"{found.group(1) if found else None}")  # fmt: skip
    return want


def build(force: bool = False) -> Path:
    """Build (or reuse) kind, kubeadm and etcd; return their dir."""
    d = bin_dir()
    binaries.ensure_host(binaries.host_uses(("build",), force or not present(d)))
    etcd_version = _check_etcd_pin()

    def recipe(tmp: Path) -> None:
        v, env = versions(), binaries.go_env()
        if force or not (d / "kind").is_file():
            pkg = f"{KIND_MODULE}@{v['KIND_VERSION']}"
            binaries._run_build(["go", "install", "-ldflags=-s -w", pkg], HERE,
                                dict(env, GOBIN=str(tmp)), pkg)  # fmt: skip
            os.replace(tmp / "kind", d / "kind")
        if force or not (d / "kubeadm").is_file():
            k8s = v["KUBERNETES_VERSION"]
            ldflags = f"-ldflags=-s -w {binaries.k8s_version_ldflags(k8s)}"
            binaries._run_build(["go", "build", ldflags, "-o", str(tmp / "kubeadm"),
                                 "k8s.io/kubernetes/cmd/kubeadm"], KINDCMD, env,
                                f"kubeadm {k8s}")  # fmt: skip
            os.replace(tmp / "kubeadm", d / "kubeadm")
        if force or not (d / "etcd").is_file():
            binaries._run_build(["go", "build", "-ldflags=-s -w", "-o", str(tmp / "etcd"),
                                 ETCD_PACKAGE], ETCDCMD, dict(env, CGO_ENABLED="0"),
                                f"etcd {etcd_version}")  # fmt: skip
            os.replace(tmp / "etcd", d / "etcd")
        info = {"versions": {k: v[k] for k in ("KIND_VERSION", "KIND_ETCD_VERSION",
                                                "KUBERNETES_VERSION")}, "key": key()}  # fmt: skip
        (d / "BUILD_INFO.json").write_text(json.dumps(info))

    return binaries._cached_build(d, present, force, recipe)


def module_files() -> Path:
    """kind's node files (`images/base/files`) of the pinned kind module, downloaded if needed."""
    env = binaries.go_env()
    files = binaries.module_dir(KIND_MODULE, versions()["KIND_VERSION"], env) / "images/base/files"
    if not (files / "usr/local/bin/entrypoint").is_file():
        raise BuildError(f"no kind node entrypoint in {files}")
    return files
