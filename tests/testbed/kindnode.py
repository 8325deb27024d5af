"""The kind node image, built here from Debian's packages and the bed's own Kubernetes builds:
no registry and no Docker (the image tool's chroot layers, imagebuild.py). Starts nothing.

What kind's own node image holds (kind's `images/base` and `pkg/build/nodeimage`, read at the
pinned KIND_VERSION) and where each piece comes from here:
- systemd, containerd, runc, the CNI plugins, iptables, ...: Debian's packages (the base layer,
  with the trims kind's base Dockerfile makes: no wanted units but ours, /sbin/init);
- kind's node files: the entrypoint, the kubelet unit and its kubeadm drop-ins, the containerd
  config, sysctls and helper scripts, taken from the kind module (`go mod download`) at build
  time, never copied into this repository;
- kubeadm, kubelet and kubectl of KUBERNETES_VERSION (kindbins.py, binaries.py);
- the images `kubeadm config images list` names, built here from those same builds (the
  control plane, kube-proxy, etcd, CoreDNS, each over one Debian minbase), under /kind/images
  and imported into containerd by `vllmdp-preload.service` before kubelet starts; the
  sandbox image is the real-node bed's pause;
- a CNI for the cluster (kind's kindnetd is pulled from a registry): `vllmdp-cni.service`
  writes a bridge + host-local config from the node's address on the kind network, pods of
  node 10.211.0.N in 10.212.N.0/24, with a route to each other node's pods (kindbed.py
  creates that network and turns kind's default CNI off).

The layers are cached by their inputs like the test images; the archive is a docker-archive
for `docker load`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import binaries
import imagebuild
import imagedefs
import imagefs
import kindbins
import oci
from common import versions
from imagebuild import LayerDef

SUITE = imagedefs.SUITE
# kind's base image packages (images/base/Dockerfile), with Debian's containerd, runc and CNI
# plugins in place of the ones kind builds. nfs-common, open-iscsi, fuse-overlayfs and
# e2fsprogs are left out: nothing here mounts volumes that need them.
NODE_PACKAGES = (
    "systemd", "containerd", "runc", "containernetworking-plugins", "conntrack", "iptables",
    "nftables", "iproute2", "ethtool", "util-linux", "mount", "kmod", "libseccomp2", "pigz",
    "bash", "ca-certificates", "curl", "jq", "procps", "socat",
)  # fmt: skip
# What kind's base Dockerfile removes after installing them: systemd then starts only the
# units the node enables.
_WANTS_TRIMMED = (
    "lib/systemd/system/multi-user.target.wants", "etc/systemd/system/multi-user.target.wants",
    "lib/systemd/system/local-fs.target.wants", "lib/systemd/system/basic.target.wants",
    "etc/systemd/system/sockets.target.wants", "etc/systemd/system/timers.target.wants",
    "etc/systemd/system/getty.target.wants", "etc/systemd/system/sysinit.target.wants",
)  # fmt: skip
_SOCKET_WANTS = "lib/systemd/system/sockets.target.wants"
_TMPFILES_SETUP = "lib/systemd/system/sysinit.target.wants/systemd-tmpfiles-setup.service"

# The cluster's address plan (kindbed.py): the kind network, and the pods of the node at
# 10.211.0.N in 10.212.N.0/24. Off the real-node bed's 10.200-10.202 and the kwok bed's
# 10.244, 10.96 and 10.0.0.1.
NODE_NET = "10.211.0"
POD_NET = "10.212"
POD_SUBNET = f"{POD_NET}.0.0/16"
SERVICE_SUBNET = "10.213.0.0/16"
CNI_BRIDGE = "vdpk-pods"


def base_layer() -> LayerDef:
    """Debian with kind's node packages, trimmed as kind's base image is."""

    def build(upper: Path, lowers: list[Path], logfile: Path) -> None:
        del lowers
        imagefs.debootstrap(upper, SUITE, imagefs.debian_mirror(suite=SUITE), NODE_PACKAGES,
                            logfile)  # fmt: skip
        for rel in _WANTS_TRIMMED:
            d = upper / rel
            if d.is_dir():
                for link in d.iterdir():
                    link.unlink()
        for link in (upper / _SOCKET_WANTS).glob("*"):
            if "udev" in link.name or "initctl" in link.name:
                link.unlink()
        (upper / _TMPFILES_SETUP).unlink(missing_ok=True)
        journald = upper / "etc/systemd/journald.conf"
        journald.write_text(journald.read_text() + "ReadKMsg=no\n")
        init = upper / "sbin/init"
        init.unlink(missing_ok=True)
        init.symlink_to("/usr/lib/systemd/systemd")

    return LayerDef("kind-node-base", build, inputs=(SUITE, *NODE_PACKAGES, *_WANTS_TRIMMED))



# --- the images kubeadm asks for, built from the bed's own binaries ------------------------------

REGISTRY = "registry.k8s.io"  # the names kubeadm asks for (never pulled: nothing is)
PAUSE_IMAGE = binaries.PAUSE_IMAGE  # containerd's sandbox image, as on the real-node bed
CONTROL_PLANE = ("kube-apiserver", "kube-controller-manager", "kube-scheduler")
# kube-proxy runs iptables and conntrack: a Debian minbase with them.
KUBE_PROXY_PACKAGES = ("iptables", "conntrack", "nftables")


def image_refs() -> dict[str, str]:
    """What the node image preloads: name -> the reference kubeadm asks for. CoreDNS keeps its
    own version (the bed's COREDNS_VERSION; the kind config sets kubeadm's `dns.imageTag`)."""
    v = versions()
    k8s = v["KUBERNETES_VERSION"]
    etcd = v["KIND_ETCD_VERSION"].removeprefix("v")
    return {**{c: f"{REGISTRY}/{c}:{k8s}" for c in (*CONTROL_PLANE, "kube-proxy")},
            "etcd": f"{REGISTRY}/etcd:{etcd}-0",
            "coredns": f"{REGISTRY}/coredns/coredns:{v['COREDNS_VERSION']}"}  # fmt: skip


def images_base() -> LayerDef:
    """The images' Debian minbase: the control plane and KubeRay are built with cgo (libc),
    and kube-proxy runs iptables and conntrack. One layer under every image, so a node's
    containerd stores it once."""

    def build(upper: Path, lowers: list[Path], logfile: Path) -> None:
        del lowers
        imagefs.debootstrap(upper, SUITE, imagefs.debian_mirror(suite=SUITE),
                            KUBE_PROXY_PACKAGES, logfile)  # fmt: skip

    return LayerDef("kube-images-base", build, inputs=(SUITE, *KUBE_PROXY_PACKAGES))


def binary_layer(binary: Path, at: str, key: str) -> LayerDef:
    """`binary` at `at` over images_base (`key`: the cache key of the build it comes from)."""

    def build(upper: Path, lowers: list[Path], logfile: Path) -> None:
        del lowers, logfile
        dest = upper / at.lstrip("/")
        dest.parent.mkdir(parents=True)
        shutil.copy2(binary, dest)

    return LayerDef(f"kube-{binary.name}", build, images_base(), inputs=(at, key))


def component_archive(binary: Path, at: str, key: str, ref: str,
                      config: oci.ImageConfig) -> Path:  # fmt: skip
    """The docker-archive of one component's image, cached by its inputs."""
    return imagebuild.ensure_archive(f"kind-{binary.name}", ref, binary_layer(binary, at, key),
                                     config)  # fmt: skip


def preloaded_images(out: Path) -> list[Path]:
    """Copy each image `image_refs` names, and the sandbox image, as a docker-archive into
    `out`; return the paths."""
    bd, nd, kd = binaries.bin_dir(), binaries.node_bin_dir(), kindbins.bin_dir()
    bk, nk, kk = binaries.version_key(), binaries.node_key(), kindbins.key()
    refs = image_refs()
    out.mkdir(parents=True, exist_ok=True)
    sources = [(bd / c, f"/usr/local/bin/{c}", bk, refs[c], oci.ImageConfig())
               for c in CONTROL_PLANE]  # fmt: skip
    sources += [
        (nd / "kube-proxy", "/usr/local/bin/kube-proxy", nk, refs["kube-proxy"],
         oci.ImageConfig()),
        (kd / "etcd", "/usr/local/bin/etcd", kk, refs["etcd"], oci.ImageConfig()),
        (nd / "coredns", "/coredns", nk, refs["coredns"], oci.ImageConfig(entrypoint=["/coredns"])),
    ]  # fmt: skip
    for binary, at, key, ref, config in sources:
        shutil.copy2(component_archive(binary, at, key, ref, config), out / f"{binary.name}.tar")
    shutil.copy2(nd / "images" / "pause.tar", out / "pause.tar")
    return sorted(out.glob("*.tar"))


# --- the node layer ----------------------------------------------------------------------------

# kind's node files, as its base Dockerfile copies them. Left out: the fuse-overlayfs unit (no
# such snapshotter here) and the licences of the binaries kind builds (Debian's packages here).
_KIND_FILES = (
    ("usr/local/bin/entrypoint", 0o755), ("usr/local/bin/clean-install", 0o755),
    ("kind/README.txt", 0o644), ("kind/bin/mount-product-files.sh", 0o755),
    ("kind/bin/undo-mount-hacks.sh", 0o755), ("kind/bin/create-kubelet-cgroup-v2.sh", 0o755),
    ("etc/crictl.yaml", 0o644), ("etc/default/kubelet", 0o644),
    ("etc/sysctl.d/10-network-magic.conf", 0o644),
    ("etc/sysctl.d/10-network-security.conf", 0o644),
    ("etc/systemd/system/kubelet.service", 0o644), ("etc/systemd/system/kubelet.slice", 0o644),
    ("etc/systemd/system/undo-mount-hacks.service", 0o644),
    ("etc/systemd/system/containerd.service", 0o644),
    ("etc/systemd/system/kubelet.service.d/10-kubeadm.conf", 0o644),
    ("etc/systemd/system/kubelet.service.d/11-kind.conf", 0o644),
)  # fmt: skip
_KIND_SANDBOX = 'sandbox_image = "registry.k8s.io/pause:3.10"'
# kind lets containerd hand each pod the OOM score kubelet asks for (-998 for the control
# plane's static pods). Lowering a score takes CAP_SYS_RESOURCE, which root lacks on some hosts
# (this one): runc's setup then dies before the pod's sandbox starts ("can't get final child's
# PID from pipe"). Restricted, containerd clamps the score at its own.
_KIND_OOM = "restrict_oom_score_adj = false"


def containerd_config(kind_config: str) -> str:
    """kind's containerd config with the real-node bed's pause image as the sandbox image and
    OOM scores clamped at containerd's own (no CAP_SYS_RESOURCE needed)."""
    for want in (_KIND_SANDBOX, _KIND_OOM):
        if want not in kind_config:
            raise imagefs.BuildError(f"kind's containerd config has no `{want}`")
    return (kind_config.replace(_KIND_SANDBOX, f'sandbox_image = "{PAUSE_IMAGE}"')
            .replace(_KIND_OOM, "restrict_oom_score_adj = true"))  # fmt: skip

PRELOAD_UNIT = """[Unit]
Description=Import the images this node image carries into containerd (vllm-dp-operator)
After=containerd.service
Requires=containerd.service
Before=kubelet.service

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/kind/bin/vllmdp-preload.sh

[Install]
WantedBy=multi-user.target
"""

CNI_UNIT = """[Unit]
Description=The node's pod network: bridge and host-local from its kind address (vllm-dp-operator)
After=network.target
Before=kubelet.service containerd.service

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/kind/bin/vllmdp-cni.sh

[Install]
WantedBy=multi-user.target
"""

PRELOAD_SCRIPT = """#!/bin/sh
set -eu
for f in /kind/images/*.tar; do
  ctr --namespace=k8s.io images import --all-platforms --digests "$f"
done
"""

KUBELET_DROPIN = """[Unit]
After=vllmdp-preload.service vllmdp-cni.service
Wants=vllmdp-preload.service vllmdp-cni.service
"""

# Node NODE_NET.N: its pods in POD_NET.N.0/24 on a bridge, every other node's pods via that
# node (all nodes share the kind network's /24).
CNI_SCRIPT = """#!/bin/sh
set -eu
cidr=$(ip -4 -o addr show dev eth0 | awk '{print $4}' | head -n1)
addr=${cidr%/*}
case "$cidr" in
  @NODE_NET@.*/24) ;;
  *) echo "vllmdp-cni: eth0 is '$cidr', not in @NODE_NET@.0/24 (kindbed's network)" >&2; exit 1;;
esac
me=${addr##*.}
echo 1 > /proc/sys/net/ipv4/ip_forward
if [ -e /proc/sys/net/bridge/bridge-nf-call-iptables ]; then
  echo 1 > /proc/sys/net/bridge/bridge-nf-call-iptables
fi
mkdir -p /etc/cni/net.d
printf '%s\\n' \\
  '{"cniVersion": "0.4.0", "name": "vllmdp-kind", "plugins": [' \\
  ' {"type": "bridge", "bridge": "@BRIDGE@", "isGateway": true, "ipMasq": false,' \\
  '  "hairpinMode": true, "ipam": {"type": "host-local",' \\
  "   \\"ranges\\": [[{\\"subnet\\": \\"@POD_NET@.$me.0/24\\"}]]," \\
  '   "routes": [{"dst": "0.0.0.0/0"}]}},' \\
  ' {"type": "portmap", "capabilities": {"portMappings": true}}]}' \\
  > /etc/cni/net.d/10-vllmdp.conflist
i=1
while [ "$i" -le 254 ]; do
  if [ "$i" -ne "$me" ]; then ip route replace "@POD_NET@.$i.0/24" via "@NODE_NET@.$i" dev eth0; fi
  i=$((i + 1))
done
echo "vllmdp-cni: node $addr, pods @POD_NET@.$me.0/24"
""".replace("@NODE_NET@", NODE_NET).replace("@POD_NET@", POD_NET).replace("@BRIDGE@", CNI_BRIDGE)

_ENABLE = """hook='{"path": "/kind/bin/mount-product-files.sh"}'
ctr oci spec \\
  | jq ".hooks.createContainer[.hooks.createContainer | length] |= . + $hook" \\
  | jq 'del(.process.rlimits)' > /etc/containerd/cri-base.json
systemctl enable kubelet.service containerd.service undo-mount-hacks.service \\
  vllmdp-preload.service vllmdp-cni.service
systemctl mask systemd-binfmt.service
"""


def node_layer() -> LayerDef:
    """kind's node files, kubeadm/kubelet/kubectl, the preloaded images and the CNI."""
    v = versions()
    bd, nd, kd = binaries.bin_dir(), binaries.node_bin_dir(), kindbins.bin_dir()

    def build(upper: Path, lowers: list[Path], logfile: Path) -> None:
        files = kindbins.module_files()
        for rel, mode in _KIND_FILES:
            dest = upper / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(files / rel, dest)
            dest.chmod(mode)
        config = containerd_config((files / "etc/containerd/config.toml").read_text())
        (upper / "etc/containerd").mkdir(parents=True, exist_ok=True)
        (upper / "etc/containerd/config.toml").write_text(config)
        # kind's containerd unit runs the containerd kind builds; Debian's is in /usr/bin.
        (upper / "usr/local/bin/containerd").symlink_to("/usr/bin/containerd")
        cni = upper / "opt/cni/bin"
        cni.mkdir(parents=True)
        plugins = next(low / "usr/lib/cni" for low in lowers if (low / "usr/lib/cni").is_dir())
        for plugin in sorted(plugins.iterdir()):
            (cni / plugin.name).symlink_to(f"/usr/lib/cni/{plugin.name}")
        usr_bin = upper / "usr/bin"
        usr_bin.mkdir(parents=True, exist_ok=True)
        for src in (kd / "kubeadm", nd / "kubelet", bd / "kubectl"):
            shutil.copy2(src, usr_bin / src.name)
        (upper / "kind/version").write_text(v["KUBERNETES_VERSION"])
        (upper / "etc/kubernetes/manifests").mkdir(parents=True)
        units = upper / "etc/systemd/system"
        (units / "vllmdp-preload.service").write_text(PRELOAD_UNIT)
        (units / "vllmdp-cni.service").write_text(CNI_UNIT)
        (units / "kubelet.service.d/20-vllmdp.conf").write_text(KUBELET_DROPIN)
        for name, text in (("vllmdp-cni.sh", CNI_SCRIPT), ("vllmdp-preload.sh", PRELOAD_SCRIPT)):
            script = upper / "kind/bin" / name
            script.write_text(text)
            script.chmod(0o755)
        preloaded_images(upper / "kind/images")
        (upper / "kind/images.json").write_text(json.dumps(image_refs(), indent=1) + "\n")
        # systemctl and ctr run in a chroot over what is here so far; what they write (unit
        # links, the runtime spec) is moved into this layer.
        step = upper.parent / "enable-upper"
        imagefs.run_in_root([upper, *lowers], _ENABLE, upper=step, log=logfile,
                            what="kind node units")  # fmt: skip
        _merge(step, upper)

    texts = (PAUSE_IMAGE, _KIND_OOM, PRELOAD_UNIT, PRELOAD_SCRIPT, CNI_UNIT, KUBELET_DROPIN,
             CNI_SCRIPT, _ENABLE, *(f"{r}:{m:o}" for r, m in _KIND_FILES))
    inputs = (v["KIND_VERSION"], v["KUBERNETES_VERSION"], kindbins.key(), binaries.version_key(),
              binaries.node_key(), images_base().key, *texts,
              json.dumps(image_refs(), sort_keys=True))  # fmt: skip
    return LayerDef("kind-node", build, base_layer(), inputs=inputs)


def _merge(src: Path, dest: Path) -> None:
    """Move what a chroot step wrote (its own upper) into the layer being built."""
    for path in sorted(src.rglob("*")):
        target = dest / path.relative_to(src)
        if path.is_dir() and not path.is_symlink():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists() or target.is_symlink():
            target.unlink()
        path.rename(target)
    shutil.rmtree(src)


# kind's base image: `ENV container=docker`, `STOPSIGNAL SIGRTMIN+3` (systemd's halt signal),
# and the entrypoint that fixes mounts and cgroups before it execs systemd.
NODE_CONFIG = oci.ImageConfig(entrypoint=["/usr/local/bin/entrypoint", "/sbin/init"],
                              env=["container=docker"], stop_signal="SIGRTMIN+3")  # fmt: skip
NODE_REPO = "vllmdp.local/kind-node"


def node_ref() -> str:
    """The node image's reference; its tag is the Kubernetes version, as kind's images' are."""
    return f"{NODE_REPO}:{versions()['KUBERNETES_VERSION']}"


def build() -> Path:
    """The node image's docker-archive, built when its inputs changed (needs root)."""
    binaries.build()
    binaries.build_nodes()
    kindbins.build()
    return imagebuild.ensure_archive("kind-node", node_ref(), node_layer(), NODE_CONFIG)
