"""The one list of host commands (tests/testbed/hostreqs.py): every command the beds, their
scripts and the helpers that start them run is a row with its Debian package, and `check` /
`install` name the command and the package of what is missing."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testbed"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import hostreqs
import hostscan

REPO = Path(__file__).resolve().parents[2]
# Everything that runs host commands to build, start or check a bed (the opt-in vLLM contract
# tier is out of it).
PY_DIRS = ("tests/testbed", "hack", "tests/cluster", "tests/controlplane", "tests/ray",
           "tests/reliability", "tests/chart", "tests/images", "tests/e2e", "bench")  # fmt: skip
SCRIPTS = ("tests/chart/ensure_helm.sh", ".ci/run", "Makefile")
# Shell the host runs that lives in a Python string (written to a file, then `bash FILE`).
HOST_SCRIPTS = {"tests/testbed/imagefs.py": ("_WRAPPER",)}


def scanned_files() -> list[Path]:
    files = [p for d in PY_DIRS for p in sorted((REPO / d).glob("*.py"))]
    return files + [REPO / s for s in SCRIPTS]


def embedded_script_commands() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for rel, names in HOST_SCRIPTS.items():
        tree = ast.parse((REPO / rel).read_text())
        texts = [n.value.value for n in tree.body if isinstance(n, ast.Assign)
                 and any(isinstance(t, ast.Name) and t.id in names for t in n.targets)
                 and isinstance(n.value, ast.Constant)]  # fmt: skip
        assert len(texts) == len(names), f"{rel}: no {names} (HOST_SCRIPTS is stale)"
        for text in texts:
            for c in hostscan.shell_commands(text):
                out.setdefault(c, set()).add(rel)
    return out


@pytest.fixture(scope="module")
def found() -> dict[str, set[str]]:
    """command -> the files that run it, over everything the beds use."""
    out = {c: {str(Path(f).relative_to(REPO)) for f in fs}
           for c, fs in hostscan.commands_in(scanned_files()).items()}  # fmt: skip
    for c, fs in embedded_script_commands().items():
        out.setdefault(c, set()).update(fs)
    return out


def unlisted(found: dict[str, set[str]], table: tuple[hostreqs.Need, ...]) -> dict[str, list[str]]:
    names = {n.name for n in table}
    return {c: sorted(fs) for c, fs in found.items() if c not in names}


# --- the list against the code ------------------------------------------------------------------
def test_every_host_command_the_beds_run_is_in_the_one_list(found: dict[str, set[str]]) -> None:
    missing = unlisted(found, hostreqs.TABLE)
    assert missing == {}, (
        "host commands run by the beds but not in tests/testbed/hostreqs.py TABLE (add each "
        f"with its Debian package): {missing}")  # fmt: skip


def test_the_scan_sees_nft_so_a_list_without_it_fails(found: dict[str, set[str]]) -> None:
    """The regression of a fresh machine: hostnet.py runs `nft`, which nothing installed."""
    assert "tests/testbed/hostnet.py" in found["nft"]
    without = tuple(n for n in hostreqs.TABLE if n.name != "nft")
    assert unlisted(found, without) == {"nft": sorted(found["nft"])}


def test_the_scan_sees_through_the_beds_wrappers(found: dict[str, set[str]]) -> None:
    expect = {
        "umount": "tests/testbed/realbed.py",  # hostnet.run("umount", m)
        "ip": "tests/testbed/podnet.py",  # _ip(...) wraps ["ip", *args]
        "/usr/bin/ctr": "tests/testbed/realnodes.py",  # [CTR, ...], CTR a module constant
        "ip6tables-save": "tests/testbed/hostnet.py",  # run(f"{ipt}-save") over a tuple
        "sh": "tests/testbed/controlplane.py",  # after unshare's options
        "mount": "tests/testbed/controlplane.py",  # in the script after `sh -c`
        "getent": "tests/cluster/test_realnodes_bed.py",  # after nsenter's `--`
        "debootstrap": "tests/testbed/imagefs.py",  # ensure_tool -> command_path -> which
        "chroot": "tests/testbed/imagefs.py",  # the bash wrapper in a string
        "sed": "tests/chart/ensure_helm.sh",
        "python3": "Makefile",  # $(PY)
        "apt-get": "tests/testbed/hostreqs.py",
    }  # fmt: skip
    assert {c: f for c, f in expect.items() if f not in found.get(c, set())} == {}


def test_programs_the_project_builds_are_not_host_commands(found: dict[str, set[str]]) -> None:
    built = {"kubelet", "kube-proxy", "kube-apiserver", "kube-controller-manager",
             "kube-scheduler", "kubectl", "kwok", "ray-operator", "coredns", "helm", "pause",
             "probe", "python", "kopf", "pytest"}  # fmt: skip
    assert built & set(found) == set()
    assert built & {n.name for n in hostreqs.TABLE} == set()


def test_every_row_names_where_it_comes_from() -> None:
    for n in hostreqs.TABLE:
        assert n.package or n.source, n.name
        assert n.uses and set(n.uses) <= set(hostreqs.USES), n.name
    assert len(hostreqs.BY_NAME) == len(hostreqs.TABLE), "one row per command"
    assert hostreqs.BY_NAME["nft"].package == "nftables"
    assert hostreqs.BY_NAME["/usr/lib/cni/bridge"].package == "containernetworking-plugins"
    assert hostreqs.BY_NAME["go"].package is None


# --- the scanner's rule, on small cases ---------------------------------------------------------
@pytest.mark.parametrize(("source", "expect"), [
    ('import subprocess\nsubprocess.run(["nft", "list", "tables"])', {"nft"}),
    ('import subprocess, sys\nsubprocess.run([sys.executable, "-m", "pip"])', set()),
    ('import subprocess\nsubprocess.run([str(bd / "kubelet"), "--v=2"])', set()),
    ('import subprocess\nsubprocess.Popen([f"{bd}/kube-apiserver"])', set()),
    ('import shutil\nshutil.which("go")', {"go"}),
    ('CTR = "/usr/bin/ctr"\nimport subprocess\nsubprocess.run([CTR, "-a", s])', {"/usr/bin/ctr"}),
    ('def run(*argv):\n    subprocess.run(list(argv))\nrun("umount", "-l", m)', {"umount"}),
    ('def f(cmd):\n    subprocess.run(cmd)\nf(["tar", "-x"])', {"tar"}),
    ('for ipt in ("iptables", "ip6tables"):\n    subprocess.run([f"{ipt}-save"])',
     {"iptables-save", "ip6tables-save"}),
    ('launcher.launch("x", ["unshare", "--mount", "--propagation", "private", "sh", "-c", '
     '"mount --bind a b && exec \\"$@\\""])', {"unshare", "sh", "mount"}),
    ('subprocess.run(["nsenter", f"--target={pid}", "--mount", "--", "getent", "hosts"])',
     {"nsenter", "getent"}),
    ('subprocess.run(["./local-script"])', set()),
])  # fmt: skip
def test_python_scan(source: str, expect: set[str]) -> None:
    assert hostscan.python_commands(source) == expect


@pytest.mark.parametrize(("script", "expect"), [
    ('GOBIN="${tmp}" CGO_ENABLED=0 go install -trimpath x', {"go"}),
    ("command -v zstd >/dev/null || { echo 'no zstd' >&2; exit 1; }", {"zstd"}),
    ("for pkg in pkg/a pkg/b; do\n  ldflags+=\" -X ${pkg}\"\ndone", set()),
    ('cd "$(dirname "$0")/.."', {"dirname"}),
    ('echo "took $(( $(date +%s) - start ))s"', {"date"}),
    ("tests/chart/ensure_helm.sh >/dev/null   # helm, cached", set()),
    ("x=$(go mod download -json m | sed -n 's/a/b/p')", {"go", "sed"}),
    ("if [ -n \"$u\" ]; then mount --bind a b; fi", {"mount"}),
])  # fmt: skip
def test_shell_scan(script: str, expect: set[str]) -> None:
    assert hostscan.shell_commands(script) == expect


def test_makefile_scan_expands_its_variables() -> None:
    text = ("PY ?= python3\nBIN := .venv/bin\nX := $(BIN)/python t.py\n\n"
            "a:\n\t@$(PY) -m venv v\n\t$(X) up $(if $(N),--nodes $(N))\n\t"
            "\"$$(tests/chart/ensure_helm.sh)\" lint c\n\tflock /tmp/l $(X) smoke\n")  # fmt: skip
    assert hostscan.makefile_commands(text) == {"python3", "flock"}


# --- check and install --------------------------------------------------------------------------
def fake_host(absent: set[str], root: bool = True, apt: bool = True) -> hostreqs.Host:
    def which(name: str) -> str | None:
        if name == "apt-get":
            return "/usr/bin/apt-get" if apt else None
        return None if name in absent else f"/usr/bin/{name}"

    return hostreqs.Host(which=which, exists=lambda p: p not in absent,
                         has_module=lambda m: m not in absent, is_root=lambda: root)  # fmt: skip


class FakeHost:
    """A host where apt-get installs (or fails to) what it is asked for."""

    def __init__(self, absent: set[str], fail: str | None = None, root: bool = True,
                 apt: bool = True) -> None:  # fmt: skip
        self.absent, self.fail, self.root, self.apt = set(absent), fail, root, apt
        self.calls: list[list[str]] = []

    def host(self) -> hostreqs.Host:
        return hostreqs.Host(
            which=lambda n: ("/usr/bin/apt-get" if self.apt else None) if n == "apt-get"
            else None if n in self.absent else f"/usr/bin/{n}",
            exists=lambda p: p not in self.absent, has_module=lambda m: m not in self.absent,
            is_root=lambda: self.root)  # fmt: skip

    def run(self, argv: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        self.calls.append(argv)
        if argv[1] == self.fail:
            return subprocess.CompletedProcess(argv, 100, "", "E: Unable to locate package")
        if argv[1] == "install":
            owned = {n.name for n in hostreqs.TABLE if n.package in argv[2:]}
            self.absent -= owned
        return subprocess.CompletedProcess(argv, 0, "", "")


@pytest.fixture(autouse=True)
def nothing_off_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake hosts have no copies of a command off PATH (this machine's /usr/sbin has)."""
    monkeypatch.setattr(hostreqs.Host, "off_path", lambda self, name: None)


def test_check_names_the_missing_command_and_its_package() -> None:
    gone = hostreqs.missing(hostreqs.needs(["cluster"]), fake_host({"nft"}))
    assert [n.name for n in gone] == ["nft"]
    text = hostreqs.explain(gone, fake_host({"nft"}))
    assert "missing: nft (Debian package nftables)" in text
    assert "hostreqs.py install" in text and "apt-get install nftables" in text


def test_a_kwok_bed_needs_less_than_the_real_node_bed() -> None:
    kwok = {n.name for n in hostreqs.needs(["kwok"])}
    real = {n.name for n in hostreqs.needs(["cluster"])}
    assert "nft" not in kwok and "nft" in real and {"etcd", "openssl"} <= kwok & real
    # The kind tier runs in make test, with its own dockerd; the user's Docker is opt-in.
    assert "dockerd" in {n.name for n in hostreqs.needs()}
    assert "docker" not in hostreqs.DEFAULT_USES and "kind" in hostreqs.DEFAULT_USES


def test_install_updates_once_then_installs_the_packages() -> None:
    fake = FakeHost({"nft", "/usr/lib/cni/bridge"})
    done = hostreqs.install(hostreqs.needs(["cluster"]), fake.host(), run=fake.run,
                            log=lambda _: None)  # fmt: skip
    assert sorted(n.name for n in done) == ["/usr/lib/cni/bridge", "nft"]
    assert [c[1] for c in fake.calls] == ["update", "install"]
    assert fake.calls[1][-2:] == ["containernetworking-plugins", "nftables"]


def test_install_with_nothing_missing_runs_no_apt() -> None:
    fake = FakeHost(set())
    assert hostreqs.install(hostreqs.needs(), fake.host(), run=fake.run) == []
    assert fake.calls == []


@pytest.mark.parametrize(("fake", "said"), [
    (FakeHost({"nft"}, fail="install"), "`apt-get install` failed (exit 100)"),
    (FakeHost({"nft"}, fail="update"), "`apt-get update` failed (exit 100)"),
    (FakeHost({"nft"}, apt=False), "no apt-get here"),
    (FakeHost({"nft"}, root=False), "installing needs root"),
])  # fmt: skip
def test_a_failed_install_names_the_command_and_the_package(fake: FakeHost, said: str) -> None:
    with pytest.raises(hostreqs.MissingHostCommand) as e:
        hostreqs.install(hostreqs.needs(["cluster"]), fake.host(), run=fake.run,
                         log=lambda _: None)  # fmt: skip
    assert said in str(e.value) and "missing: nft (Debian package nftables)" in str(e.value)


def test_go_is_named_as_the_go_toolchain_not_a_package() -> None:
    fake = FakeHost({"go"})
    with pytest.raises(hostreqs.MissingHostCommand, match="not installable by apt-get") as e:
        hostreqs.install(hostreqs.needs(["build"]), fake.host(), run=fake.run)
    assert "missing: go (the Go toolchain" in str(e.value) and fake.calls == []


def test_ensure_as_a_user_names_what_is_missing_and_installs_nothing() -> None:
    fake = FakeHost({"nft", "zstd"}, root=False)
    with pytest.raises(hostreqs.MissingHostCommand) as e:
        hostreqs.ensure(hostreqs.needs(["cluster"]), fake.host())
    assert "missing: nft (Debian package nftables)" in str(e.value)
    assert "missing: zstd (Debian package zstd)" in str(e.value) and fake.calls == []


def test_a_command_not_in_the_list_has_no_path() -> None:
    with pytest.raises(KeyError):
        hostreqs.command_path("not-a-listed-command")


def test_cli_check_on_a_path_without_nft(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """`check` as a user runs it: a PATH that has every listed command but nft."""
    for n in hostreqs.needs(["cluster"]):
        if not n.name.startswith("/") and n.name != "nft":
            (tmp_path / n.name).write_text("#!/bin/sh\n")
            (tmp_path / n.name).chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    rows = [replace(n, name=str(tmp_path / "sh")) if n.name.startswith("/") else n
            for n in hostreqs.TABLE]  # fixed paths: point them at a file that exists
    monkeypatch.setattr(hostreqs, "TABLE", tuple(rows))
    assert hostreqs.main(["check", "cluster"]) == 1
    err = capsys.readouterr().err
    assert "missing: nft (Debian package nftables)" in err
    assert [ln for ln in err.splitlines() if ln.startswith("missing:")] == [
        ln for ln in err.splitlines() if ln.startswith("missing: nft ")]
    assert os.environ["PATH"] == str(tmp_path)


def test_install_does_what_apt_can_and_names_what_it_cannot() -> None:
    fake = FakeHost({"nft", "go"})
    with pytest.raises(hostreqs.MissingHostCommand, match="not installable by apt-get") as e:
        hostreqs.install(hostreqs.needs(["build", "cluster"]), fake.host(), run=fake.run,
                         log=lambda _: None)  # fmt: skip
    assert fake.calls[-1][-1] == "nftables" and "nft" not in fake.absent
    assert "missing: go" in str(e.value) and "missing: nft" not in str(e.value)
