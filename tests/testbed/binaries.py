"""Builds what the test bed runs, cached outside the repository; starts nothing.

- Control plane (`build`): kube-apiserver, kube-controller-manager, kube-scheduler and kubectl
  from this directory's Go module, kwok and the KubeRay operator with `go install`, and
  KubeRay's CRDs. Cached in `<cache>/bin-<key>/`.
- Real nodes (`build_nodes`): kubelet and kube-proxy from the same Go module (so the same
  Kubernetes release), CoreDNS, `pause` and `probe` from `nodecmd/`, and the two one-file
  images made from those (oci.py). Cached in `<cache>/nodes-<key>/`.
- Kueue (`build_kueue`), for the Kueue tests only: its manager with `go install`, and its CRDs
  and webhook manifests from the same module. Cached in `<cache>/kueue-<key>/`, keyed by its
  pin alone (versions.env's last block, left out of the control plane's key).
- KEDA (`build_keda`), for the autoscaling tier only: its operator and metrics API server from
  `kedacmd/` (KEDA's replace directive rules out `go install`) as one-file images, and its
  install manifests from the same module. Cached in `<cache>/keda-<key>/`, keyed by its pin
  and `kedacmd/` alone.
- The real nodes' NetworkPolicy enforcer (`build_netpol`): kube-router with `go install`,
  cached in `<cache>/netpol-<key>/`, keyed by its own pin alone.

What the beds run from Debian (etcd, containerd, runc, the CNI plugins, ...) is in the one list
of host commands, hostreqs.py: each build checks (as root: installs) its part first.

`<cache>` is common.cache_root(); each key hashes the pins and the recipe, so a change rebuilds
and old entries stay (they are never pruned). Builds take a lock file in the cache root, so
two sessions never build the same thing at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import hostreqs
import oci
import yaml
from common import HERE, BuildError, cache_root, log, versions

NODECMD = HERE / "nodecmd"
K8S_COMMANDS = ["kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl"]
NODE_K8S_COMMANDS = ["kubelet", "kube-proxy"]
NODECMD_COMMANDS = ["coredns", "pause", "probe"]
KUBERAY_MODULE = "github.com/ray-project/kuberay/ray-operator"
KWOK_PACKAGE = "sigs.k8s.io/kwok/cmd/kwok"
# Images built here from static binaries (never pulled: `testbed.local` is no registry).
PAUSE_IMAGE = "testbed.local/pause:1"
PROBE_IMAGE = "testbed.local/probe:1"
NODE_IMAGES = {"pause": PAUSE_IMAGE, "probe": PROBE_IMAGE}
# What of the one list (hostreqs.py) each build and bed needs.
CONTROL_PLANE_USES = ("build", "kwok")
REAL_NODE_USES = ("build", "kwok", "cluster")

# Bump when the way binaries are built changes (flags, stamping), to invalidate the cache.
BUILD_RECIPE = "2"
NODE_RECIPE = "1"
KUEUE_RECIPE = "1"
KUEUE_MODULE = "sigs.k8s.io/kueue"

NETPOL_RECIPE = "1"
KUBE_ROUTER_PACKAGE = "github.com/cloudnativelabs/kube-router/v2/cmd/kube-router"
# Pins whose binaries have a cache of their own, left out of the bin- and nodes- keys.
OWN_CACHE_PINS = ("KUBE_ROUTER_VERSION", "KUEUE_VERSION", "KIND_VERSION", "KIND_ETCD_VERSION",
                  "KEDA_VERSION")  # fmt: skip
KEDACMD = HERE / "kedacmd"
KEDA_MODULE = "github.com/kedacore/keda/v2"
KEDA_RECIPE = "1"
#: KEDA's commands (cmd/<name>), each cached as the binary its own manifests run
#: (config/manager, config/metrics-server) and as a one-file image of that binary.
KEDA_COMMANDS = {"operator": "keda", "adapter": "keda-adapter"}
KEDA_IMAGES = {"keda": "testbed.local/keda", "keda-adapter": "testbed.local/keda-metrics-apiserver"}
#: The images' user: KEDA's manifests ask runAsNonRoot, which a numeric user satisfies.
KEDA_USER = "65532"


def without_own_pins(text: str) -> bytes:
    """versions.env without the pins of binaries cached apart (OWN_CACHE_PINS), each with its
    paragraph (the comment lines above it, back to a blank line, and that line): a new enforcer
    version rebuilds the enforcer alone."""
    lines = text.splitlines(keepends=True)
    keep = [True] * len(lines)
    for i, line in enumerate(lines):
        if line.split("=", 1)[0].strip() in OWN_CACHE_PINS:
            keep[i] = False
            j = i - 1
            while j >= 0 and lines[j].startswith("#"):
                keep[j], j = False, j - 1
            if j >= 0 and not lines[j].strip():
                keep[j] = False
    return "".join(ln for ln, k in zip(lines, keep, strict=True) if k).encode()


def _key(recipe: str, files: list[Path]) -> str:
    h = hashlib.sha256(f"recipe={recipe}\0".encode())
    for f in files:
        data = without_own_pins(f.read_text()) if f.name == "versions.env" else f.read_bytes()
        h.update(str(f.relative_to(HERE)).encode() + b"\0" + data + b"\0")
    return h.hexdigest()[:12]


def netpol_key() -> str:
    """The enforcer's cache key: its pin and its recipe only."""
    h = hashlib.sha256(f"recipe={NETPOL_RECIPE}\0".encode())
    h.update(f"{KUBE_ROUTER_PACKAGE}@{versions()['KUBE_ROUTER_VERSION']}".encode())
    return h.hexdigest()[:12]


def netpol_bin_dir() -> Path:
    return cache_root() / f"netpol-{netpol_key()}"


def version_key() -> str:
    return _key(BUILD_RECIPE, [HERE / n for n in ("versions.env", "go.mod", "go.sum")])


def kueue_key() -> str:
    h = hashlib.sha256(f"recipe={KUEUE_RECIPE}\0{versions()['KUEUE_VERSION']}".encode())
    return h.hexdigest()[:12]


def keda_key() -> str:
    """KEDA's cache key: its pin, its recipe and `kedacmd/` only."""
    return _key(KEDA_RECIPE + versions()["KEDA_VERSION"],
                sorted(p for p in KEDACMD.rglob("*") if p.is_file()))  # fmt: skip


def node_key() -> str:
    sources = sorted(p for p in NODECMD.rglob("*") if p.is_file())
    return _key(NODE_RECIPE, [HERE / n for n in ("versions.env", "go.mod", "go.sum")] + sources)


def bin_dir() -> Path:
    return cache_root() / f"bin-{version_key()}"


def node_bin_dir() -> Path:
    return cache_root() / f"nodes-{node_key()}"


def go_env() -> dict[str, str]:
    env = dict(os.environ)
    env["GOFLAGS"] = (env.get("GOFLAGS", "") + " -trimpath -buildvcs=false").strip()
    # Go 1.27 turns on the jsonv2 experiment, which breaks the apiserver's OpenAPI.
    with contextlib.suppress(Exception):
        gover = subprocess.run(["go", "env", "GOVERSION"], capture_output=True, text=True).stdout
        minor = int(gover.strip().removeprefix("go").split(".")[1])
        if minor >= 27 and "GOEXPERIMENT" not in env:
            env["GOEXPERIMENT"] = "nojsonv2"
    return env


def _run_build(cmd: list[str], cwd: Path, env: dict[str, str], what: str) -> float:
    t0 = time.monotonic()
    log(f"building {what}: {' '.join(cmd)}")
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    dt = time.monotonic() - t0
    if proc.returncode != 0:
        raise BuildError(
            f"building {what} failed (rc={proc.returncode}):\n{proc.stdout}\n{proc.stderr[-6000:]}"
        )
    log(f"built {what} in {dt:.1f}s")
    return dt


def go_available() -> bool:
    return shutil.which("go") is not None


def expected_binaries() -> list[str]:
    return [*K8S_COMMANDS, "kwok", "ray-operator"]


def binaries_present(bd: Path | None = None) -> bool:
    bd = bd or bin_dir()
    return all((bd / b).is_file() for b in expected_binaries()) and (bd / "kuberay-crds").is_dir()


def node_binaries_present(nd: Path | None = None) -> bool:
    """The real-node binaries and images, the NetworkPolicy enforcer (its own cache) included."""
    nd = nd or node_bin_dir()
    return all((nd / b).is_file() for b in [*NODE_K8S_COMMANDS, *NODECMD_COMMANDS]) and all(
        (nd / "images" / f"{n}.tar").is_file() for n in NODE_IMAGES
    ) and netpol_binary().is_file()


def netpol_binary() -> Path:
    """Where build_netpol puts kube-router."""
    return netpol_bin_dir() / "kube-router"


def ensure_host(uses: tuple[str, ...]) -> None:
    """The host commands of `uses` (hostreqs.py), installed as root when missing; before any
    build, so a missing one costs seconds, not a build."""
    try:
        hostreqs.ensure_uses(*uses)
    except hostreqs.MissingHostCommand as e:
        raise BuildError(str(e)) from e


def host_uses(uses: tuple[str, ...], building: bool) -> tuple[str, ...]:
    """`uses` without Go's when nothing is to be built (a cache from elsewhere needs no Go)."""
    return uses if building else tuple(u for u in uses if u != "build")


def find_etcd() -> str:
    """The etcd binary: $VLLMDP_ETCD, or Debian's etcd-server on PATH (hostreqs.py)."""
    cand = os.environ.get("VLLMDP_ETCD") or shutil.which("etcd")
    if not cand:
        raise BuildError(hostreqs.explain([hostreqs.BY_NAME["etcd"]]) + " (or set VLLMDP_ETCD)")
    return cand


def kuberay_module_dir(env: dict[str, str]) -> Path:
    return module_dir(KUBERAY_MODULE, versions()["KUBERAY_VERSION"], env)


def module_dir(module: str, ver: str, env: dict[str, str]) -> Path:
    """Where `go mod download` put a module (downloading it first)."""
    proc = subprocess.run(
        ["go", "mod", "download", "-json", f"{module}@{ver}"],
        cwd=HERE,
        env=env,
        capture_output=True,
        text=True,
    )
    try:
        info = json.loads(proc.stdout)
    except json.JSONDecodeError as e:
        raise BuildError(f"go mod download {module}@{ver} failed:\n{proc.stderr}") from e
    if info.get("Error") or not info.get("Dir"):
        raise BuildError(f"go mod download {module}@{ver}: {info.get('Error')}")
    return Path(info["Dir"])


def k8s_version_ldflags(version: str) -> str:
    """Stamp the version like the upstream build does (hack/lib/version.sh); without it the
    binaries report v0.0.0-master+$Format:%H$, which kubectl and Helm cannot parse."""
    major, minor = version.removeprefix("v").split(".")[:2]
    stamp = {
        "gitVersion": version,
        "gitMajor": major,
        "gitMinor": minor,
        "gitTreeState": "clean",
        "buildDate": "1970-01-01T00:00:00Z",
    }
    return " ".join(
        f"-X {pkg}.{k}={val}"
        for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version")
        for k, val in stamp.items()
    )


@contextlib.contextmanager
def _build_lock(target: Path) -> Iterator[None]:
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".build.lock", "w") as lock:
        t0 = time.monotonic()
        fcntl.flock(lock, fcntl.LOCK_EX)
        if time.monotonic() - t0 > 1:
            log(f"waited {time.monotonic() - t0:.0f}s for another build")
        yield


def _cached_build(
    target: Path, present: Callable[[Path], bool], force: bool, recipe: Callable[[Path], None]
) -> Path:
    if present(target) and not force:
        log(f"binaries cached in {target}")
        return target
    with _build_lock(target):
        if present(target) and not force:
            log(f"binaries cached in {target}")
            return target
        if not go_available():
            raise BuildError("Go toolchain not found (needed to build the test bed binaries)")
        target.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=target))
        t0 = time.monotonic()
        try:
            recipe(tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log(f"build done in {time.monotonic() - t0:.1f}s -> {target}")
    return target


def _k8s_commands(cmds: list[str], tmp: Path, out: Path) -> None:
    """`go build` these k8s.io/kubernetes commands into tmp in one go, then move them to `out`.

    One `go build` for all of them links one while it compiles the next: built one by one, each
    link (a minute for kube-apiserver) leaves a core idle.
    """
    if not cmds:
        return
    v = versions()["KUBERNETES_VERSION"]
    ldflags = f"-ldflags=-s -w {k8s_version_ldflags(v)}"
    pkgs = [f"k8s.io/kubernetes/cmd/{cmd}" for cmd in cmds]
    _run_build(["go", "build", ldflags, "-o", f"{tmp}/", *pkgs], HERE, go_env(),
               f"{', '.join(cmds)} {v}")  # fmt: skip
    for cmd in cmds:
        os.replace(tmp / cmd, out / cmd)


def build(force: bool = False) -> Path:
    """Build (or reuse) the control-plane binaries; return their dir."""
    bd = bin_dir()
    ensure_host(host_uses(CONTROL_PLANE_USES, force or not binaries_present(bd)))

    def recipe(tmp: Path) -> None:
        v, env = versions(), go_env()
        for name, pkg in (("ray-operator", f"{KUBERAY_MODULE}@{v['KUBERAY_VERSION']}"),
                          ("kwok", f"{KWOK_PACKAGE}@{v['KWOK_VERSION']}")):  # fmt: skip
            if force or not (bd / name).is_file():
                argv = ["go", "install", "-ldflags=-s -w", pkg]
                _run_build(argv, HERE, dict(env, GOBIN=str(tmp)), pkg)
                os.replace(tmp / name, bd / name)
        if force or not (bd / "kuberay-crds").is_dir():
            src = kuberay_module_dir(env) / "config" / "crd" / "bases"
            dst = tmp / "kuberay-crds"
            dst.mkdir()
            for f in sorted(src.glob("ray.io_*.yaml")):
                shutil.copyfile(f, dst / f.name)
            if not any(dst.iterdir()):
                raise BuildError(f"no KubeRay CRDs in {src}")
            shutil.rmtree(bd / "kuberay-crds", ignore_errors=True)
            os.replace(dst, bd / "kuberay-crds")
        _k8s_commands([c for c in K8S_COMMANDS if force or not (bd / c).is_file()], tmp, bd)
        (bd / "BUILD_INFO.json").write_text(json.dumps({"versions": v, "key": version_key()}))

    return _cached_build(bd, binaries_present, force, recipe)


def _check_pin(gomod: Path, module: str, pin: str) -> str:
    """The version versions.env pins as `pin`, which `gomod` must require of `module`."""
    want = versions()[pin]
    found = re.search(rf"{re.escape(module)} (v\S+)", gomod.read_text())
    if not found or found.group(1) != want:
        have = found.group(1) if found else None
        raise BuildError(f"{gomod.parent.name}/go.mod must require {module} {want} "
                         f"(versions.env {pin}), found {have}")  # fmt: skip
    return want


def _check_coredns_pin() -> None:
    _check_pin(NODECMD / "go.mod", "github.com/coredns/coredns", "COREDNS_VERSION")


def _one_file_image(binary: Path, ref: str, out: Path, work: Path,
                    user: str | None = None) -> None:  # fmt: skip
    """A scratch image holding only `binary` at /<name>, which is its entrypoint; run as
    `user` when given."""
    root = work / f"{binary.name}-rootfs"
    root.mkdir()
    shutil.copy2(binary, root / binary.name)
    layer = oci.build_layer(root, work / f"{binary.name}-layer.tar")
    entry = oci.ImageConfig(entrypoint=[f"/{binary.name}"], user=user,
                            labels={"vllmdp.io/test-image": "true"})  # fmt: skip
    oci.write_archive(ref, [layer], entry, out)


def build_nodes(force: bool = False) -> Path:
    """Build (or reuse) the real-node binaries and images, and the enforcer; return their dir."""
    nd = node_bin_dir()
    ensure_host(host_uses(REAL_NODE_USES, force or not node_binaries_present(nd)))
    _check_coredns_pin()
    build_netpol(force)

    def recipe(tmp: Path) -> None:
        _k8s_commands([c for c in NODE_K8S_COMMANDS if force or not (nd / c).is_file()], tmp, nd)
        static = dict(go_env(), CGO_ENABLED="0")
        for cmd in NODECMD_COMMANDS:
            if force or not (nd / cmd).is_file():
                argv = ["go", "build", "-ldflags=-s -w", "-o", str(tmp / cmd), f"./{cmd}"]
                _run_build(argv, NODECMD, static, f"{cmd} (nodecmd)")
                os.replace(tmp / cmd, nd / cmd)
        (nd / "images").mkdir(exist_ok=True)
        for name, ref in NODE_IMAGES.items():
            _one_file_image(nd / name, ref, nd / "images" / f"{name}.tar", tmp)
        info = {"versions": versions(), "key": node_key()}
        (nd / "BUILD_INFO.json").write_text(json.dumps(info))

    return _cached_build(nd, node_binaries_present, force, recipe)


def kueue_dir() -> Path:
    return cache_root() / f"kueue-{kueue_key()}"


def kueue_present(kd: Path | None = None) -> bool:
    kd = kd or kueue_dir()
    return (kd / "kueue").is_file() and (kd / "config" / "webhook.yaml").is_file() and any(
        (kd / "config" / "crds").glob("*.yaml"))  # fmt: skip


def build_kueue(force: bool = False) -> Path:
    """Build (or reuse) Kueue and copy its CRDs and webhook manifests; return their dir.

    `go install` works: the module has no replace directives. The CRDs (config/components/crd
    bases, with the conversion patches of the same folder) and the webhook configurations
    (config/components/webhook/manifests.yaml) are copied as shipped; kueuebed.py renders them
    for the bed.
    """
    kd = kueue_dir()
    ensure_host(host_uses(CONTROL_PLANE_USES, force or not kueue_present(kd)))

    def recipe(tmp: Path) -> None:
        v, env = versions()["KUEUE_VERSION"], go_env()
        if force or not (kd / "kueue").is_file():
            pkg = f"{KUEUE_MODULE}/cmd/kueue@{v}"
            _run_build(["go", "install", "-ldflags=-s -w", pkg], HERE, dict(env, GOBIN=str(tmp)),
                       pkg)  # fmt: skip
            os.replace(tmp / "kueue", kd / "kueue")
        src = module_dir(KUEUE_MODULE, v, env) / "config" / "components"
        dst = tmp / "config"
        (dst / "crds").mkdir(parents=True)
        (dst / "conversion").mkdir()
        for f in sorted((src / "crd" / "bases").glob("kueue.x-k8s.io_*.yaml")):
            shutil.copyfile(f, dst / "crds" / f.name)
        # The conversion patches its kustomization applies (some in the folder are not).
        kustomization = yaml.safe_load((src / "crd" / "kustomization.yaml").read_text())
        for entry in kustomization.get("patches") or []:
            f = src / "crd" / entry["path"]
            shutil.copyfile(f, dst / "conversion" / f.name)
        shutil.copyfile(src / "webhook" / "manifests.yaml", dst / "webhook.yaml")
        shutil.rmtree(kd / "config", ignore_errors=True)
        os.replace(dst, kd / "config")
        (kd / "BUILD_INFO.json").write_text(json.dumps({"KUEUE_VERSION": v, "key": kueue_key()}))

    return _cached_build(kd, kueue_present, force, recipe)


def keda_dir() -> Path:
    return cache_root() / f"keda-{keda_key()}"


def keda_present(kd: Path | None = None) -> bool:
    kd = kd or keda_dir()
    return all((kd / "images" / f"{b}.tar").is_file() for b in KEDA_COMMANDS.values()) and (
        kd / "config" / "default" / "kustomization.yaml").is_file()  # fmt: skip


def keda_image(name: str) -> str:
    """The image reference of KEDA's `name` (a KEDA_COMMANDS value) for this pin."""
    return f"{KEDA_IMAGES[name]}:{versions()['KEDA_VERSION']}"


def build_keda(force: bool = False) -> Path:
    """Build (or reuse) KEDA's operator and metrics API server as one-file images, and copy
    its install manifests; return their dir (kedabed.py installs them on the real-node bed).

    One static `go build` of both commands in `kedacmd/` (CGO off, as KEDA's own images are
    built), so what they share compiles once. `config/` is KEDA's kustomize tree as shipped
    (CRDs, RBAC, the two Deployments, the APIService); kedabed renders it with kubectl's
    kustomize and points it at these images.
    """
    kd = keda_dir()
    ensure_host(host_uses(CONTROL_PLANE_USES, force or not keda_present(kd)))
    v = _check_pin(KEDACMD / "go.mod", KEDA_MODULE, "KEDA_VERSION")

    def recipe(tmp: Path) -> None:
        env = dict(go_env(), CGO_ENABLED="0")
        pkgs = [f"{KEDA_MODULE}/cmd/{c}" for c in KEDA_COMMANDS]
        _run_build(["go", "build", "-ldflags=-s -w", "-o", f"{tmp}/", *pkgs], KEDACMD, env,
                   f"KEDA {v}")  # fmt: skip
        (tmp / "images").mkdir()
        for cmd, name in KEDA_COMMANDS.items():
            os.replace(tmp / cmd, tmp / name)
            _one_file_image(tmp / name, keda_image(name), tmp / "images" / f"{name}.tar", tmp,
                            user=KEDA_USER)  # fmt: skip
            (tmp / name).unlink()
        shutil.copytree(module_dir(KEDA_MODULE, v, env) / "config", tmp / "config")
        for d in (tmp / "config", *(p for p in (tmp / "config").rglob("*") if p.is_dir())):
            d.chmod(0o755)  # the module cache's folders are read-only: a rebuild removes these
        for sub in ("images", "config"):
            shutil.rmtree(kd / sub, ignore_errors=True)
            os.replace(tmp / sub, kd / sub)
        (kd / "BUILD_INFO.json").write_text(json.dumps({"KEDA_VERSION": v, "key": keda_key()}))

    return _cached_build(kd, keda_present, force, recipe)


def build_netpol(force: bool = False) -> Path:
    """Build (or reuse) the NetworkPolicy enforcer, kube-router (netpolicy.py); return its path."""
    target = netpol_bin_dir()
    ensure_host(host_uses(REAL_NODE_USES, force or not netpol_binary().is_file()))

    def recipe(tmp: Path) -> None:
        pkg = f"{KUBE_ROUTER_PACKAGE}@{versions()['KUBE_ROUTER_VERSION']}"
        _run_build(["go", "install", "-ldflags=-s -w", pkg], HERE, dict(go_env(), GOBIN=str(tmp)),
                   pkg)  # fmt: skip
        os.replace(tmp / "kube-router", target / "kube-router")

    _cached_build(target, lambda d: (d / "kube-router").is_file(), force, recipe)
    return netpol_binary()
