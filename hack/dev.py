"""`make dev`: the operator serving one example on a local test bed, with no GPU or Docker.

Real (default, root): the real-node bed (two kubelets, containerd, KubeRay), the operator and
CPU engine images imported into each node, the operator installed by `helm install` of the
chart, `examples/dev-cpu.yaml` applied; waits for `Serving` and prints the phase, the pods on
their nodes and a `curl` that answers from the host through the Service's ClusterIP.

`--sim` (`make dev SIM=1`): the kwok bed (4 simulated 8-GPU nodes, pods run nothing), the
operator as a local process, an example applied; prints what it made once the head job exists.

`down` stops whichever is up; both leave nothing behind.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
SIM_STATE = Path(os.environ.get("VLLMDP_TESTBED_DIR") or REPO / ".testbed").resolve()
REAL_STATE = Path(os.environ.get("VLLMDP_CLUSTER_DIR") or REPO / ".cluster").resolve()
DEV = SIM_STATE / "dev"
TESTBED = [sys.executable, str(REPO / "tests" / "testbed" / "testbed.py")]
HOSTREQS = [sys.executable, str(REPO / "tests" / "testbed" / "hostreqs.py")]
# What of the one list of host commands (tests/testbed/hostreqs.py) each mode needs; the
# builds add Go's row when they build.
REAL_USES = ("kwok", "cluster", "images")
SIM_USES = ("kwok",)
OPERATOR_ENV = {"VLLMDP_PROBE_LAUNCHING_SECONDS": "2"}
REAL_EXAMPLE = REPO / "examples" / "dev-cpu.yaml"
SIM_EXAMPLE = REPO / "examples" / "dp8-rpn4-tp1.yaml"
IMAGES = ("vllm-dp-operator", "vllm-dp-engine-cpu")


def _testbed(*args: str) -> None:
    env = {**os.environ, "VLLMDP_TESTBED_DIR": str(SIM_STATE),
           "VLLMDP_CLUSTER_DIR": str(REAL_STATE)}  # fmt: skip
    subprocess.run([*TESTBED, *args], check=True, env=env)


def _host_first(uses: tuple[str, ...]) -> None:
    """Every host command this mode needs, installed as root, before the first build."""
    if subprocess.run([*HOSTREQS, "ensure", *uses]).returncode != 0:
        sys.exit("make dev: a host command is missing (above); nothing was built")


def _kubectl(state: Path, *args: str, input: str | None = None) -> str:
    kubectl = json.loads((state / "testbed.json").read_text()).get("bin_dir")
    exe = str(Path(kubectl) / "kubectl") if kubectl else "kubectl"
    proc = subprocess.run([exe, f"--kubeconfig={state / 'kubeconfig'}", *args], input=input,
                          text=True, capture_output=True, check=True)  # fmt: skip
    return proc.stdout or ""


def _wait(what: str, check: object, timeout: float, hint: str) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()  # type: ignore[operator]
        if got:
            return got
        time.sleep(2)
    sys.exit(f"no {what} within {timeout:.0f}s; {hint}")


# --- real nodes ------------------------------------------------------------------------------
def up_real(example: Path, timeout: float, nodes: int | None = None) -> None:
    """Real nodes (`nodes` of them, the bed's default 2 when None: four let a user try
    replicas and a Surge), images, the chart, the example; wait for Serving and show how to
    call it."""
    if os.geteuid() != 0:
        sys.exit("make dev runs real kubelets and containerd: run it as root (or `make dev SIM=1`)")
    t0 = time.monotonic()
    _host_first(REAL_USES)
    _testbed("cluster", "up", *(["--nodes", str(nodes)] if nodes else []))
    _testbed("cluster", "load", *IMAGES)
    _testbed("cluster", "operator")
    doc = yaml.safe_load(example.read_text())
    ns, name = doc["metadata"].get("namespace", "default"), doc["metadata"]["name"]
    _kubectl(REAL_STATE, "apply", "-f", str(example))
    print(f"applied {example.relative_to(REPO)}; waiting for Serving (up to {timeout:.0f}s)",
          flush=True)  # fmt: skip

    def serving() -> bool:
        st = json.loads(_kubectl(REAL_STATE, "-n", ns, "get", "vdp", name, "-o", "json"))
        return (st.get("status") or {}).get("phase") == "Serving"

    hint = (f"see `kubectl -n {ns} describe vdp {name}` and "
            f"`kubectl -n vllm-dp-system logs deploy/vdp-vllm-dp-operator`")  # fmt: skip
    _wait(f"Serving for {name}", serving, timeout, hint)
    took = time.monotonic() - t0
    print(_kubectl(REAL_STATE, "-n", ns, "get", "vdp", name))
    print(_kubectl(REAL_STATE, "-n", ns, "get", "pods", "-o", "wide"))
    svc = json.loads(_kubectl(REAL_STATE, "-n", ns, "get", "svc", f"{name}-api", "-o", "json"))
    port = svc["spec"]["ports"][0]["port"]
    model = doc["spec"].get("servedModelName") or doc["spec"]["model"]
    body = json.dumps({"model": model, "prompt": "Hello, my name is", "max_tokens": 16})
    curl = (f"curl -s http://{svc['spec']['clusterIP']}:{port}/v1/completions "
            f"-H 'Content-Type: application/json' -d {shlex.quote(body)}")  # fmt: skip
    print(f"Serving {took:.0f}s after `make dev` started. From this host:\n  {curl}")
    print(f"export KUBECONFIG={REAL_STATE / 'kubeconfig'}   # then: kubectl get vdp -A")


# --- kwok (SIM=1) ----------------------------------------------------------------------------
def _operator_alive() -> bool:
    pid_file = DEV / "operator.pid"
    if not pid_file.exists():
        return False
    try:
        os.kill(int(pid_file.read_text()), 0)
    except (OSError, ValueError):
        return False
    return True


def _start_operator() -> None:
    if _operator_alive():
        print("operator: already running")
        return
    DEV.mkdir(parents=True, exist_ok=True)
    # The proxied probe only where the test bed routes pod IPs into its own namespace.
    probe = "apiserver-proxy" if (SIM_STATE / "pod_network.json").exists() else "off"
    env = {**os.environ, **OPERATOR_ENV, "VLLMDP_HEALTH_PROBE": probe,
           "KUBECONFIG": str(SIM_STATE / "kubeconfig")}
    cmd = [sys.executable, "-m", "kopf", "run", "--standalone", "--all-namespaces",
           "-m", "vllm_dp_operator.handlers"]  # fmt: skip
    with (DEV / "operator.log").open("ab") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    (DEV / "operator.pid").write_text(str(proc.pid))
    print(f"operator: started, PID {proc.pid}, log {DEV / 'operator.log'}")


def up_sim(example: Path, timeout: float) -> None:
    """The kwok bed, the operator as a process, the example; show what it made."""
    _host_first(SIM_USES)
    _testbed("up")
    from vllm_dp_operator.api.crd import build_crd

    _kubectl(SIM_STATE, "apply", "--server-side", "--force-conflicts", "-f", "-",
             input=yaml.safe_dump(build_crd()))  # fmt: skip
    _kubectl(SIM_STATE, "wait", "--for=condition=Established", "crd/vllmdataparallels.vllmdp.io")
    _start_operator()
    doc = yaml.safe_load(example.read_text())
    ns, name = doc["metadata"].get("namespace", "default"), doc["metadata"]["name"]
    _kubectl(SIM_STATE, "apply", "-f", str(example))

    def head_job() -> bool:
        st = json.loads(_kubectl(SIM_STATE, "-n", ns, "get", "vdp", name, "-o", "json"))
        job = (st.get("status") or {}).get("headJob")
        return bool(job and _kubectl(SIM_STATE, "-n", ns, "get", "rayjob", job,
                                     "--ignore-not-found"))  # fmt: skip

    _wait(f"head job for {name}", head_job, timeout, f"see {DEV / 'operator.log'}")
    print(_kubectl(SIM_STATE, "-n", ns, "get", "vdp,raycluster,rayjob,svc,pods", "-o", "wide"))
    print(f"export KUBECONFIG={SIM_STATE / 'kubeconfig'}   # then: kubectl get vdp -A")


def down() -> None:
    """Stop whichever bed is up: the local operator and the kwok bed, or the real nodes."""
    pid_file = DEV / "operator.pid"
    if _operator_alive():
        pid = int(pid_file.read_text())
        os.kill(pid, signal.SIGTERM)
        for _ in range(100):
            try:
                os.kill(pid, 0)
            except OSError:
                break
            time.sleep(0.1)
        else:
            os.kill(pid, signal.SIGKILL)
        print(f"operator: stopped PID {pid}")
    pid_file.unlink(missing_ok=True)
    if (SIM_STATE / "pids.json").exists():
        _testbed("down")
    if (REAL_STATE / "pids.json").exists() or (REAL_STATE / "host.json").exists():
        _testbed("cluster", "down")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_up = sub.add_parser("up")
    p_up.add_argument("--sim", action="store_true", help="kwok nodes instead of real ones")
    p_up.add_argument("--example", type=Path, help="default: dev-cpu.yaml (real), "
                      "dp8-rpn4-tp1.yaml (--sim)")  # fmt: skip
    p_up.add_argument("--timeout", type=float, help="default: 900 s (real), 180 s (--sim)")
    p_up.add_argument("--nodes", type=int, help="real nodes to start (default: the bed's 2)")
    sub.add_parser("down")
    args = parser.parse_args()
    if args.cmd == "down":
        down()
    elif args.sim:
        up_sim((args.example or SIM_EXAMPLE).resolve(), args.timeout or 180)
    else:
        up_real((args.example or REAL_EXAMPLE).resolve(), args.timeout or 900, args.nodes)


if __name__ == "__main__":
    main()
