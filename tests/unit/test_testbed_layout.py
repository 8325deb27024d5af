"""The real-node test bed's pure parts: node layout, address ranges, rendered configs, image
names. (The bed itself is tested by the cluster tier, tests/cluster.)"""

from __future__ import annotations

import ipaddress
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testbed"))
import hostnet
import kwoknodes
import realnodes


def test_nodes_never_share_a_path_port_range_or_cgroup(tmp_path: Path) -> None:
    nodes = realnodes.plan(tmp_path, 3)
    assert [n.name for n in nodes] == ["node-1", "node-2", "node-3"]
    for attr in ("dir", "store", "ip", "pod_cidr", "bridge", "cgroup_root", "socket"):
        assert len({getattr(n, attr) for n in nodes}) == 3, attr
    nets = [ipaddress.ip_network(n.pod_cidr) for n in nodes]
    assert all(a.subnet_of(ipaddress.ip_network(hostnet.POD_CIDR)) for a in nets)
    assert all(len(n.bridge) <= 15 for n in nodes)  # Linux interface names


def test_node_count_out_of_range_names_the_field(tmp_path: Path) -> None:
    for bad in (0, 10):
        with pytest.raises(ValueError, match=r"nodes: .* out of range"):
            realnodes.plan(tmp_path, bad)


def test_real_ranges_never_overlap_the_kwok_bed() -> None:
    real = [hostnet.POD_CIDR, hostnet.SERVICE_CIDR, hostnet.HOST_PREFIX + "0/24"]
    kwok = [kwoknodes.POD_CIDR, kwoknodes.SERVICE_CIDR, f"{kwoknodes.NODE_IP}/32"]
    for a in real:
        for b in kwok:
            assert not ipaddress.ip_network(a).overlaps(ipaddress.ip_network(b)), (a, b)
    for ip in (hostnet.API_IP, hostnet.DNS_IP, *(hostnet.node_ip(i) for i in range(1, 10))):
        assert ipaddress.ip_address(ip) in ipaddress.ip_network(hostnet.HOST_PREFIX + "0/24")
    assert len({hostnet.API_IP, hostnet.DNS_IP, *(hostnet.node_ip(i) for i in range(1, 10))}) == 11


def test_containerd_config_keeps_everything_under_the_node(tmp_path: Path) -> None:
    node = realnodes.plan(tmp_path, 1)[0]
    cfg = realnodes.containerd_config(node, "testbed.local/pause:1")
    for needle in (f'root = "{node.store}"', f'address = "{node.socket}"',
                   f'Root = "{node.dir / "runc"}"', f'conf_dir = "{node.dir / "cni"}"',
                   "restrict_oom_score_adj = true", "netns_mounts_under_state_dir = true",
                   'sandbox_image = "testbed.local/pause:1"', "SystemdCgroup = false"):  # fmt: skip
        assert needle in cfg, needle
    assert "/var/lib/containerd" not in cfg and "/etc/cni" not in cfg


def test_kubelet_config_per_node(tmp_path: Path) -> None:
    node = realnodes.plan(tmp_path, 2)[1]
    cfg = realnodes.kubelet_config(node, tmp_path / "ca.crt", 10250, 10248)
    assert cfg["cgroupRoot"] == "/vllmdp-node-2"
    assert cfg["podLogsDir"] == str(node.dir / "pod-logs")
    assert cfg["address"] == "10.202.0.12" and cfg["clusterDNS"] == [hostnet.DNS_IP]
    assert cfg["authentication"]["anonymous"]["enabled"] is False
    assert cfg["containerRuntimeEndpoint"] == f"unix://{node.socket}"
    bridge = realnodes.cni_config(node)["plugins"][0]
    assert bridge["bridge"] == "vllmdp-br2"
    assert bridge["ipam"]["ranges"] == [[{"subnet": "10.200.2.0/24"}]]


@pytest.mark.parametrize(("stored", "tag", "same"), [
    ("testbed.local/pause:1", "testbed.local/pause:1", True),
    ("registry.example/library/vllm-dp-operator:dev", "vllm-dp-operator:dev", True),
    ("registry.example/team/app:1", "team/app:1", True),
    ("testbed.local/pause:1", "pause:1", False),
    ("registry.example/library/pause:1", "testbed.local/pause:1", False),
    ("registry.example/team/pause:1", "pause:1", False),
])  # fmt: skip
def test_stored_image_names(stored: str, tag: str, same: bool) -> None:
    assert realnodes.stored_as(stored, tag) is same


def test_iptables_cleanup_only_touches_our_chains() -> None:
    assert hostnet.OUR_CHAINS.match("KUBE-SERVICES")
    assert hostnet.OUR_CHAINS.match("CNI-HOSTPORT-DNAT")
    assert not hostnet.OUR_CHAINS.match("INPUT")
    assert not hostnet.OUR_CHAINS.match("DOCKER-USER")


def test_archive_identity_is_the_same_for_both_formats(tmp_path: Path) -> None:
    """A docker-archive and an OCI layout tar of one image name the same config digest, so a
    node holding it from either is not imported into again."""
    if shutil.which("zstd") is None:
        pytest.skip("zstd is not installed (needed for OCI layers)")
    import oci

    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "hello").write_text("hi\n")
    layer = oci.compress_layer(oci.build_layer(tmp_path / "root", tmp_path / "l.tar"),
                               tmp_path / "l.zst")  # fmt: skip
    config = oci.ImageConfig(entrypoint=["/hello"])
    oci.write_archive("app:dev", [layer], config, tmp_path / "docker.tar")
    oci.write_oci_archive("app:dev", [layer], config, tmp_path / "oci.tar")
    docker_names, docker_id = realnodes.archive_image(tmp_path / "docker.tar")
    oci_names, oci_id = realnodes.archive_image(tmp_path / "oci.tar")
    assert docker_id == oci_id and docker_id.startswith("sha256:")
    assert docker_names == ["app:dev"]
    assert len(oci_names) == 1 and realnodes.stored_as(oci_names[0], "app:dev")


def test_the_real_node_bed_takes_a_node_count() -> None:
    import testbed

    assert testbed.parser().parse_args(["cluster", "up"]).nodes is None  # as it runs, else 2
    assert testbed.parser().parse_args(["cluster", "up", "--nodes", "4"]).nodes == 4


def test_node_count_env_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    import testbed

    monkeypatch.setenv("VLLMDP_CLUSTER_NODES", "3")
    assert testbed.parser().parse_args(["cluster", "up"]).nodes == 3


@pytest.mark.parametrize(("asked", "running", "is_up", "expect"), [
    (None, 2, False, (2, False)),  # nothing up: the default, 2
    (None, 4, True, (4, True)),  # a bed of 4 is up: keep it (make dev, the cluster tier)
    (4, 4, True, (4, True)),
    (3, 2, True, (3, False)),  # asked for another size: start it again with 3
    (3, 2, False, (3, False)),
])  # fmt: skip
def test_up_keeps_a_bed_of_the_size_asked_and_restarts_another(
    asked: int | None, running: int, is_up: bool, expect: tuple[int, bool]
) -> None:
    import realbed

    assert realbed.sized(asked, running, is_up) == expect


def test_down_and_leftovers_cover_every_node_a_bed_can_have(tmp_path: Path) -> None:
    """A bed of 4 taken down after a later `up` of 2 rewrote testbed.json still leaves
    nothing: cleanup looks at node-1..9, not at the recorded count."""
    import realbed
    from procs import State

    st = State(tmp_path)
    st.write_info({"node_count": 2})
    assert [n.name for n in realbed.nodes_of(st)] == ["node-1", "node-2"]
    every = realbed.every_node(st)
    assert [n.name for n in every][-1] == f"node-{realnodes.MAX_NODES}"
    assert {n.ip for n in every} == {f"10.202.0.{10 + i}" for i in range(1, 10)}
    st.write_info({"node_count": 4})
    assert "kubelet-node-4" in realbed.components(st)


def test_another_beds_listener_is_a_foreign_claim() -> None:
    """An API server still bound to 10.202.0.1:6443 after its address left lo (as /proc/net/tcp
    lists it: little-endian hex, state 0A = LISTEN); other addresses and states are not ours."""
    text = ("  sl  local_address rem_address   st tx_queue rx_queue\n"
            "   0: 0100CA0A:192B 00000000:0000 0A 00000000:00000000\n"  # 10.202.0.1:6443
            "   1: 0100007F:1F90 00000000:0000 0A 00000000:00000000\n"  # 127.0.0.1:8080
            "   2: 0B00CA0A:D2F4 0100CA0A:192B 01 00000000:00000000\n")  # an established one
    assert hostnet.listeners(text) == ["10.202.0.1:6443"]


def _cluster_up_with(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, error: Exception
) -> list[object]:
    """`testbed.py cluster up` whose realbed.up raises `error`; the downs it ran."""
    import binaries
    import realbed
    import testbed

    monkeypatch.setenv("VLLMDP_CLUSTER_DIR", str(tmp_path))
    monkeypatch.setattr(binaries, "ensure_host", lambda uses: None)
    monkeypatch.setattr(binaries, "binaries_present", lambda bd=None: True)
    monkeypatch.setattr(binaries, "node_binaries_present", lambda nd=None: True)

    def up(*_: object) -> None:
        raise error

    downs: list[object] = []
    monkeypatch.setattr(realbed, "up", up)
    monkeypatch.setattr(realbed, "down", lambda st: downs.append(st) or [])
    assert testbed.main(["cluster", "up", "--no-build"]) == 1
    return downs


def test_an_up_refused_before_any_change_takes_nothing_down(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A `down` then would replay the last host record and take another bed's addresses."""
    import realbed

    refused = realbed.NotStarted("our address ranges are already in use here")
    assert _cluster_up_with(monkeypatch, tmp_path, refused) == []


def test_an_up_that_failed_midway_is_taken_down(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert len(_cluster_up_with(monkeypatch, tmp_path, RuntimeError("kubelet died"))) == 1


@pytest.mark.parametrize(("made", "alive", "held", "expect"), [
    (False, False, ["10.202.0.1:6443"], True),  # a `down` of nothing while another bed is up
    (False, False, [], False),  # a second `down` repairs what the first left
    (True, False, ["10.202.0.1:6443"], False),  # this bed changed the host: undo it
    (False, True, ["10.202.0.1:6443"], False),  # this bed runs: it holds the range
])  # fmt: skip
def test_down_leaves_another_beds_host_alone(
    made: bool, alive: bool, held: list[str], expect: bool
) -> None:
    import realbed

    assert realbed.another_bed_up(made, alive, held) is expect
