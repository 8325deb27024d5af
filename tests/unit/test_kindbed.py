"""The kind tier's pure parts: kind's cluster config for our node image and for an upstream one,
and the runtime shim that drops the capabilities this host's root lacks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testbed"))
import kindbed
import kinddocker
import kindnode
import kindruntime
from common import versions


def _patches(config: dict[str, object]) -> list[dict[str, object]]:
    return [yaml.safe_load(p) for p in config["kubeadmConfigPatches"]]  # type: ignore[attr-defined]


def test_our_node_image_gets_our_cni_our_address_plan_and_the_beds_coredns() -> None:
    config = kindbed.cluster_config(ours=True, patches_dir=Path("/p"))
    assert config["networking"] == {"ipFamily": "ipv4", "disableDefaultCNI": True,
                                    "podSubnet": "10.212.0.0/16",
                                    "serviceSubnet": "10.213.0.0/16"}  # fmt: skip
    assert [n["role"] for n in config["nodes"]] == ["control-plane", "worker"]
    patches = {p["kind"]: p for p in _patches(config)}
    assert patches["KubeletConfiguration"]["failCgroupV1"] is False
    assert patches["ClusterConfiguration"]["dns"]["imageTag"] == versions()["COREDNS_VERSION"]
    # The node image preloads CoreDNS under exactly that tag.
    assert kindnode.image_refs()["coredns"].endswith(":" + versions()["COREDNS_VERSION"])


def test_an_upstream_node_image_keeps_kinds_cni_and_images() -> None:
    config = kindbed.cluster_config(ours=False, patches_dir=Path("/p"))
    assert config["networking"] == {"ipFamily": "ipv4"}
    assert [p["kind"] for p in _patches(config)] == ["KubeletConfiguration", "InitConfiguration"]


@pytest.mark.parametrize("ours", [True, False])
def test_the_control_planes_static_pods_ask_for_no_cpu(ours: bool) -> None:
    config = kindbed.cluster_config(ours=ours, patches_dir=Path("/state/patches"))
    init = {p["kind"]: p for p in _patches(config)}["InitConfiguration"]
    assert init["patches"] == {"directory": kindbed.PATCHES_IN_NODE}
    assert config["nodes"][0]["extraMounts"] == [{"hostPath": "/state/patches", "readOnly": True,
                                                  "containerPath": kindbed.PATCHES_IN_NODE}]
    patches = kindbed.static_pod_patches()
    assert sorted(patches) == sorted(f"{c}+strategic.yaml" for c in
                                     ("etcd", "kube-apiserver", "kube-controller-manager",
                                      "kube-scheduler"))  # fmt: skip
    for name, text in patches.items():
        (container,) = yaml.safe_load(text)["spec"]["containers"]
        assert container == {"name": name.split("+")[0], "resources": {"requests": {"cpu": "0"}}}


def test_the_cni_plan_stays_off_the_other_beds_ranges() -> None:
    ours = ("10.211.", "10.212.", "10.213.")
    for taken in ("10.200.", "10.201.", "10.202.", "10.244.", "10.96.", "10.0.0.1"):
        assert not any(o.startswith(taken) or taken.startswith(o) for o in ours), taken
    assert kinddocker.SUBNET.startswith(kindnode.NODE_NET + ".")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_the_runtime_shim_keeps_only_the_capabilities_root_has(tmp_path: Path) -> None:
    seen = tmp_path / "seen.json"
    fake_runc = tmp_path / "runc"
    fake_runc.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {seen}\n")
    fake_runc.chmod(0o755)
    shim = kindruntime.write_shim(tmp_path / "shim", str(fake_runc), sys.executable)
    every = ["CAP_CHOWN", "CAP_SYS_ADMIN", "CAP_SYS_RESOURCE", "CAP_BPF", "CAP_NOT_A_CAP"]
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps(
        {"process": {"capabilities": {k: every for k in ("bounding", "effective")}}}))
    process = tmp_path / "process.json"
    process.write_text(json.dumps({"capabilities": {"bounding": every}}))

    subprocess.run([str(shim), "--root", "/x", "create", "--bundle", str(bundle), "id"],
                   check=True)  # fmt: skip
    assert seen.read_text().split() == ["--root", "/x", "create", "--bundle", str(bundle), "id"]
    subprocess.run([str(shim), "exec", "--process", str(process), "id"], check=True)

    have = kindruntime.bounding_set()
    want = [c for c in every if c in have or c == "CAP_NOT_A_CAP"]
    caps = json.loads((bundle / "config.json").read_text())["process"]["capabilities"]
    assert caps == {"bounding": want, "effective": want}
    assert json.loads(process.read_text())["capabilities"] == {"bounding": want}
    assert "CAP_CHOWN" in want


def test_a_capability_the_host_lacks_is_dropped_and_an_unknown_one_kept() -> None:
    # Bits 0 (CHOWN) and 21 (SYS_ADMIN) set; 24 (SYS_RESOURCE) not.
    have = kindruntime.bounding_set(f"Name:\tx\nCapBnd:\t{(1 << 0) | (1 << 21):016x}\n")
    assert have == {"CAP_CHOWN", "CAP_SYS_ADMIN"}
    doc = {"capabilities": {"bounding": ["CAP_CHOWN", "CAP_SYS_RESOURCE", "CAP_NEW_ONE"]}}
    assert kindruntime.trim(doc, have) == {"capabilities": {"bounding": ["CAP_CHOWN",
                                                                         "CAP_NEW_ONE"]}}
    assert kindruntime.trim({"args": ["x"]}, have) == {"args": ["x"]}


def test_the_node_containerd_clamps_oom_scores_and_runs_the_beds_pause() -> None:
    kind_config = ('[plugins."io.containerd.grpc.v1.cri"]\n'
                   '  sandbox_image = "registry.k8s.io/pause:3.10"\n'
                   "  restrict_oom_score_adj = false\n")  # fmt: skip
    ours = kindnode.containerd_config(kind_config)
    assert f'sandbox_image = "{kindnode.PAUSE_IMAGE}"' in ours
    assert "restrict_oom_score_adj = true" in ours and "= false" not in ours


def test_a_kind_containerd_config_without_the_expected_lines_is_named() -> None:
    with pytest.raises(kindnode.imagefs.BuildError, match="restrict_oom_score_adj"):
        kindnode.containerd_config('sandbox_image = "registry.k8s.io/pause:3.10"\n')


COREFILE = """.:53 {
    errors
    health {
       lameduck 5s
    }
    kubernetes cluster.local in-addr.arpa ip6.arpa {
       pods insecure
    }
    prometheus :9153
    forward . /etc/resolv.conf {
       max_concurrent 1000
    }
    loop
    reload
}
"""


def _words(text: str) -> str:
    return " ".join(text.split())


def test_kubeadms_corefile_keeps_only_what_the_beds_coredns_has() -> None:
    plugins = kindbed.coredns_plugins()
    assert {"kubernetes", "forward", "health", "errors"} <= plugins and "reload" not in plugins
    fitted = kindbed.corefile_for(COREFILE, plugins)
    assert _words(fitted) == (".:53 { errors health { lameduck 5s } kubernetes cluster.local "
                              "in-addr.arpa ip6.arpa { pods insecure } forward . "
                              "/etc/resolv.conf { max_concurrent 1000 } }")  # fmt: skip


def test_a_directive_with_a_block_goes_with_its_block() -> None:
    fitted = kindbed.corefile_for(COREFILE, {"errors", "forward"})
    assert _words(fitted) == ".:53 { errors forward . /etc/resolv.conf { max_concurrent 1000 } }"
    every = kindbed.coredns_plugins() | {"prometheus", "loop", "reload"}
    assert kindbed.corefile_for(COREFILE, every) == COREFILE


def test_loading_onto_a_disk_too_small_is_refused_with_the_numbers(tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    archive = tmp_path / "engine.tar"
    archive.write_bytes(b"\0" * 1000)
    free = {"bytes": 6999}

    def usage(path: object) -> object:
        return type("Usage", (), {"free": free["bytes"], "total": 0, "used": 0})()

    monkeypatch.setattr(kindbed.shutil, "disk_usage", usage)
    with pytest.raises(RuntimeError, match=r"2 nodes needs about .* GiB free under .*; it has"):
        kindbed.check_space([archive], tmp_path, nodes=2)
    free["bytes"] = kindbed.space_needed(1000, 2)
    kindbed.check_space([archive], tmp_path, nodes=2)
