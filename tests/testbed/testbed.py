#!/usr/bin/env python3
"""Local Kubernetes test beds, as plain processes on this machine. Two modes:

kwok mode: a real control plane (etcd, kube-apiserver, controller-manager, scheduler), kwok's
simulated GPU nodes and the KubeRay operator, on 127.0.0.1. Pods run nothing. State in
`.testbed/` or $VLLMDP_TESTBED_DIR.

    testbed.py build | bin-dir             build or reuse the binaries / print their dir
    testbed.py up [--nodes 4 ...]          start (idempotent)
    testbed.py env | status | down         exports / which components live / stop all
    testbed.py restart etcd|kube-apiserver [--down 10] [--crash]   a fault, for reliability tests

real-node mode (root): the same control plane plus real kubelets, containerd, CNI bridges,
kube-proxy, CoreDNS and KubeRay; pods run real containers from imported image archives. State
in `.cluster/` or $VLLMDP_CLUSTER_DIR.

    testbed.py cluster build               also kubelet, kube-proxy, CoreDNS, pause/probe images
    testbed.py kueue-build | kueue-up | kueue-down   Kueue with its webhooks on the kwok bed
    testbed.py keda-build                  KEDA's images and manifests (the autoscaling tier)
    testbed.py cluster keda-up | keda-down KEDA installed on the running real-node bed
    testbed.py netpol-build                the enforcer alone (kube-router; `cluster build` has it)
    testbed.py cluster up [--nodes 2] [--gpus-per-node 4] [--image TAR ...]
                                           (`make cluster-up NODES=4`: 1..9 nodes, default 2)
    testbed.py cluster import [--node N] TAR...   image archives into the nodes (skips same image)
    testbed.py cluster content NODE        blobs a node holds (for images.py oci --have)
    testbed.py cluster images              what each node holds
    testbed.py cluster load NAME...        images.py images into every node, only missing blobs
    testbed.py cluster operator [--set K=V]   the operator image into every node, helm install
    testbed.py cluster operator-down       helm uninstall
    testbed.py cluster env | status | down | leftovers | cached

Binaries are cached in ${VLLMDP_CACHE:-${XDG_CACHE_HOME:-~/.cache}/vllm-dp-operator}/testbed/.
Modules: build, controlplane, kwoknodes (+ podnet), realbed (+ realnodes, addons, hostnet);
the images pods run are built by images.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import binaries
import faults
import kedabed
import kueuebed
import kwoknodes
import operatorchart
import realbed
import realnodes
from common import BuildError, log
from procs import State


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name) or default)


def _kwok_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    b = sub.add_parser("build", help="build or reuse the binaries")
    b.add_argument("--force", action="store_true", help="rebuild even if cached")
    sub.add_parser("bin-dir", help="print the binary cache dir")
    r = sub.add_parser("restart", help="stop a component for a while and start it again")
    r.add_argument("component", choices=faults.RESTARTABLE)
    r.add_argument("--down", type=float, default=10.0, help="seconds it stays down")
    r.add_argument("--crash", action="store_true", help="SIGKILL instead of SIGTERM")
    u = sub.add_parser("up", help="start the kwok test bed (idempotent)")
    u.add_argument("--nodes", type=int, default=_env_int("VLLMDP_TESTBED_NODES", 4),
                   help="fake GPU nodes (env VLLMDP_TESTBED_NODES, default 4)")
    u.add_argument("--gpus-per-node", type=int,
                   default=_env_int("VLLMDP_TESTBED_GPUS_PER_NODE", 8),
                   help="nvidia.com/gpu per node (env VLLMDP_TESTBED_GPUS_PER_NODE, default 8)")
    u.add_argument("--cpu-nodes", type=int, default=_env_int("VLLMDP_TESTBED_CPU_NODES", 1),
                   help="untainted CPU-only nodes (env VLLMDP_TESTBED_CPU_NODES, default 1)")
    u.add_argument("--gpu-product",
                   default=os.environ.get("VLLMDP_TESTBED_GPU_PRODUCT", "NVIDIA-H100-80GB-HBM3"))
    u.add_argument("--instance-type",
                   default=os.environ.get("VLLMDP_TESTBED_INSTANCE_TYPE", "p5.48xlarge"))
    u.add_argument("--etcd-port", type=int, default=_env_int("VLLMDP_TESTBED_ETCD_PORT", 0),
                   help="default: a free port (env VLLMDP_TESTBED_ETCD_PORT)")
    u.add_argument("--apiserver-port", type=int,
                   default=_env_int("VLLMDP_TESTBED_APISERVER_PORT", 0),
                   help="default: a free port (env VLLMDP_TESTBED_APISERVER_PORT)")
    u.add_argument("--keep-data", action="store_true", help="keep the etcd data of a previous run")
    u.add_argument("--no-build", action="store_true",
                   help="fail instead of building missing binaries")
    sub.add_parser("down", help="stop what `up` started")
    sub.add_parser("kueue-build", help="build or reuse Kueue (binary, CRDs, webhooks)")
    sub.add_parser("keda-build", help="build or reuse KEDA (images, install manifests)")
    sub.add_parser("netpol-build", help="build or reuse the real-node bed's NetworkPolicy enforcer")
    sub.add_parser("kueue-up", help="start Kueue with its webhooks on the running bed")
    sub.add_parser("kueue-down", help="remove Kueue's webhooks and stop it")
    sub.add_parser("env", help="print shell exports")
    sub.add_parser("status", help="show which components are alive")


def _cluster_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    c = sub.add_parser("cluster", help="the real-node test bed (root)")
    csub = c.add_subparsers(dest="ccmd", required=True)
    b = csub.add_parser("build", help="build or reuse every binary and image it runs")
    b.add_argument("--force", action="store_true")
    u = csub.add_parser("up", help="start the real-node bed (idempotent)")
    env_nodes = os.environ.get("VLLMDP_CLUSTER_NODES")
    u.add_argument("--nodes", type=int, default=int(env_nodes) if env_nodes else None,
                   help="real nodes, 1..9 (env VLLMDP_CLUSTER_NODES; default: as many as the "
                   f"running bed has, else {realbed.DEFAULT_NODES}); a node costs about "
                   "130 MiB (kubelet, containerd) before its pods")  # fmt: skip
    u.add_argument("--gpus-per-node", type=int,
                   default=_env_int("VLLMDP_CLUSTER_GPUS_PER_NODE", realbed.DEFAULT_GPUS),
                   help="nvidia.com/gpu advertised per node (env VLLMDP_CLUSTER_GPUS_PER_NODE)")
    u.add_argument("--image", type=Path, action="append", default=[],
                   help="docker-archive tar to import into every node (repeatable)")
    u.add_argument("--no-build", action="store_true")
    i = csub.add_parser("import", help="import image archives (docker-archive or OCI layout)")
    i.add_argument("archives", type=Path, nargs="+")
    i.add_argument("--node", help="only this node (default: every node)")
    c = csub.add_parser("content", help="digests a node's content store holds (one a line)")
    c.add_argument("node")
    ld = csub.add_parser("load", help="build (or reuse) images.py images and import into every "
                         "node only the blobs it lacks")  # fmt: skip
    ld.add_argument("names", nargs="+")
    o = csub.add_parser("operator", help="import the operator image, `helm install` the chart")
    o.add_argument("--set", dest="values", action="append", default=[], metavar="KEY=VALUE",
                   help="extra chart value (repeatable)")
    csub.add_parser("operator-down", help="`helm uninstall` the operator")
    csub.add_parser("keda-up", help="install KEDA from its own manifests (kedabed.py)")
    csub.add_parser("keda-down", help="remove KEDA (its CRDs stay)")
    for name, text in (("images", "list each node's images"), ("down", "stop and clean up"),
                       ("cached", "exit 0 when every binary and image is cached"),
                       ("env", "print shell exports"), ("status", "which components live"),
                       ("leftovers", "list anything of the bed still on the host")):  # fmt: skip
        csub.add_parser(name, help=text)


def _cluster(a: argparse.Namespace) -> int:
    st = State(realbed.state_dir())
    if a.ccmd in ("build", "up"):
        # Every host command of the real-node bed (hostreqs.py) before the first build: the
        # control plane takes minutes to build, and only the nodes after it need nft.
        cached = (binaries.binaries_present(binaries.bin_dir())
                  and binaries.node_binaries_present(binaries.node_bin_dir()))  # fmt: skip
        building = a.force or not cached if a.ccmd == "build" else not (cached or a.no_build)
        binaries.ensure_host(binaries.host_uses(binaries.REAL_NODE_USES, building))
    if a.ccmd == "build":
        binaries.build(force=a.force)
        binaries.build_nodes(force=a.force)
    elif a.ccmd == "up":
        if a.nodes is not None:
            realnodes.plan(st.root, a.nodes)  # a bad count fails here, not in up's cleanup
        for archive in a.image:
            if not archive.is_file():
                raise BuildError(f"--image {archive}: no such file")
        if a.no_build:
            bd, nd = binaries.bin_dir(), binaries.node_bin_dir()
            if not (binaries.binaries_present(bd) and binaries.node_binaries_present(nd)):
                raise BuildError(f"binaries missing in {bd} or {nd}; run `cluster build`")
        else:
            bd, nd = binaries.build(), binaries.build_nodes()
        try:
            realbed.up(st, bd, nd, a.nodes, a.gpus_per_node, a.image)
        except realbed.NotStarted:
            raise
        except BaseException:
            print(f"[testbed] up failed; taking down what was started (logs in {st.logs})",
                  file=sys.stderr)  # fmt: skip
            realbed.down(st)
            raise
    elif a.ccmd == "operator":
        operatorchart.install(st, extra=tuple(a.values))
    elif a.ccmd == "operator-down":
        operatorchart.uninstall(st)
    elif a.ccmd == "keda-up":
        kedabed.up(st)
    elif a.ccmd == "keda-down":
        kedabed.down(st)
    elif a.ccmd in ("import", "images", "content", "load") and not realbed.healthy(st):
        raise RuntimeError(f"no healthy real-node bed in {st.root}; run `cluster up`")
    elif a.ccmd == "import":
        nodes = [n for n in realbed.nodes_of(st) if a.node in (None, n.name)]
        if not nodes:
            raise ValueError(f"--node {a.node}: no such node")
        realnodes.log_import(nodes, a.archives)
    elif a.ccmd == "load":
        _load(st, a.names)
    elif a.ccmd == "content":
        nodes = [n for n in realbed.nodes_of(st) if n.name == a.node]
        if not nodes:
            raise ValueError(f"node {a.node}: no such node")
        print("\n".join(sorted(realnodes.content_digests(nodes[0]))))
    elif a.ccmd == "images":
        for node in realbed.nodes_of(st):
            for ref, digest in sorted(realnodes.node_images(node).items()):
                print(f"{node.name}\t{ref}\t{digest or '-'}")
    elif a.ccmd == "down":
        return 1 if realbed.down(st) else 0
    elif a.ccmd == "env":
        print("\n".join(realbed.env_lines(st)))
    elif a.ccmd == "status":
        return 0 if realbed.status(st) else 1
    elif a.ccmd == "cached":
        bd, nd = binaries.bin_dir(), binaries.node_bin_dir()
        return 0 if binaries.binaries_present(bd) and binaries.node_binaries_present(nd) else 1
    elif a.ccmd == "leftovers":
        left = realbed.leftovers(st)
        print("\n".join(left) if left else "nothing left")
        return 1 if left else 0
    return 0


def _load(st: State, names: list[str]) -> None:
    """Each image into each node as an OCI tar less the blobs that node holds: a changed top
    layer costs its own size, not the image's (the CPU engine's vLLM layer is 2.4 GB)."""
    import images

    for name in names:
        images.build([name])
        for node in realbed.nodes_of(st):
            out = st.root / f"load-{name}-{node.name}.oci.tar"
            try:
                images.oci_archive(name, out, realnodes.content_digests(node))
                t0 = time.monotonic()
                said = realnodes.import_image(node, out)
                log(f"{said} (delta {out.stat().st_size / 1e6:.0f} MB, "
                    f"{time.monotonic() - t0:.1f}s)")  # fmt: skip
            finally:
                out.unlink(missing_ok=True)


def _kwok(a: argparse.Namespace) -> int:
    st = State(kwoknodes.state_dir())
    if a.cmd == "build":
        binaries.build(force=a.force)
    elif a.cmd == "bin-dir":
        print(binaries.bin_dir())
    elif a.cmd == "up":
        if kwoknodes.healthy(st):
            print(f"[testbed] already up and healthy ({st.root}); nothing to do")
            return 0
        binaries.ensure_host(("kwok",))  # build() adds Go's row when it builds
        bd = binaries.bin_dir() if a.no_build else binaries.build()
        if not binaries.binaries_present(bd):
            raise BuildError(f"binaries missing in {bd}; run `build`")
        try:
            kwoknodes.up(st, bd, a.nodes, a.gpus_per_node, a.cpu_nodes, a.etcd_port or None,
                         a.apiserver_port or None, a.keep_data, a.gpu_product,
                         a.instance_type)  # fmt: skip
        except BaseException:
            print(f"[testbed] up failed; stopping what was started (logs stay in {st.logs})",
                  file=sys.stderr)  # fmt: skip
            kwoknodes.down(st)
            raise
    elif a.cmd == "down":
        kwoknodes.down(st)
    elif a.cmd == "kueue-build":
        print(binaries.build_kueue())
    elif a.cmd == "keda-build":
        print(binaries.build_keda())
    elif a.cmd == "netpol-build":
        print(binaries.build_netpol())
    elif a.cmd == "kueue-up":
        print(json.dumps(kueuebed.up(st)))
    elif a.cmd == "kueue-down":
        kueuebed.down(st)
    elif a.cmd == "restart":
        ready = faults.restart(st.root, a.component, a.down, a.crash)
        print(f"[testbed] {a.component} down {a.down:.0f}s, ready {ready:.1f}s after its start")
    elif a.cmd == "env":
        print("\n".join(kwoknodes.env_lines(st)))
    elif a.cmd == "status":
        return 0 if kwoknodes.status(st) else 1
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = p.add_subparsers(dest="cmd", required=True)
    _kwok_parser(sub)
    _cluster_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    try:
        return _cluster(a) if a.cmd == "cluster" else _kwok(a)
    except BuildError as e:
        print(f"[testbed] BUILD ERROR: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, ValueError) as e:
        print(f"[testbed] ERROR: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
