"""`make dev`: the test bed, the operator and one example, with no GPU or Docker needed.

`up` builds or reuses the control-plane binaries, starts the test bed, installs the CRD,
starts the operator in the background (PID and log under the test bed's state dir), applies
the example and prints what it made once the head job exists. `down` undoes all of it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
STATE = Path(os.environ.get("VLLMDP_TESTBED_DIR") or REPO / ".testbed").resolve()
DEV = STATE / "dev"
TESTBED = [sys.executable, str(REPO / "tests" / "testbed" / "testbed.py")]
OPERATOR_ENV = {"VLLMDP_PROBE_LAUNCHING_SECONDS": "2"}


def _testbed(*args: str) -> None:
    env = {**os.environ, "VLLMDP_TESTBED_DIR": str(STATE)}
    subprocess.run([*TESTBED, *args], check=True, env=env)


def _kubectl(*args: str, input: str | None = None, capture: bool = True) -> str:
    kubectl = json.loads((STATE / "testbed.json").read_text()).get("bin_dir")
    exe = str(Path(kubectl) / "kubectl") if kubectl else "kubectl"
    proc = subprocess.run([exe, f"--kubeconfig={STATE / 'kubeconfig'}", *args], input=input,
                          text=True, capture_output=capture, check=True)  # fmt: skip
    return proc.stdout or ""


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
    probe = "apiserver-proxy" if (STATE / "pod_network.json").exists() else "off"
    env = {**os.environ, **OPERATOR_ENV, "VLLMDP_HEALTH_PROBE": probe,
           "KUBECONFIG": str(STATE / "kubeconfig")}
    cmd = [sys.executable, "-m", "kopf", "run", "--standalone", "--all-namespaces",
           "-m", "vllm_dp_operator.handlers"]  # fmt: skip
    with (DEV / "operator.log").open("ab") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    (DEV / "operator.pid").write_text(str(proc.pid))
    print(f"operator: started, PID {proc.pid}, log {DEV / 'operator.log'}")


def up(example: Path, timeout: float) -> None:
    """Bring everything up and apply the example."""
    _testbed("up")
    from vllm_dp_operator.crd import build_crd

    _kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
             input=yaml.safe_dump(build_crd()))  # fmt: skip
    _kubectl("wait", "--for=condition=Established", "crd/vllmdataparallels.vllmdp.io")
    _start_operator()
    doc = yaml.safe_load(example.read_text())
    ns = doc["metadata"].get("namespace", "default")
    _kubectl("apply", "-f", str(example))
    name = doc["metadata"]["name"]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        head_job = json.loads(_kubectl("-n", ns, "get", "vdp", name, "-o", "json")).get(
            "status", {}).get("headJob")  # fmt: skip
        if head_job and _kubectl("-n", ns, "get", "rayjob", head_job, "--ignore-not-found"):
            break
        time.sleep(1)
    else:
        sys.exit(f"no head job for {name} within {timeout:.0f}s; see {DEV / 'operator.log'}")
    print(_kubectl("-n", ns, "get", "vdp,raycluster,rayjob,svc,pods", "-o", "wide"))
    print(f"export KUBECONFIG={STATE / 'kubeconfig'}   # then: kubectl get vdp -A")


def down() -> None:
    """Stop the operator, then the test bed."""
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
    _testbed("down")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_up = sub.add_parser("up")
    p_up.add_argument("--example", type=Path, default=REPO / "examples" / "dp8-rpn4-tp1.yaml")
    p_up.add_argument("--timeout", type=float, default=180)
    sub.add_parser("down")
    args = parser.parse_args()
    if args.cmd == "up":
        up(args.example, args.timeout)
    else:
        down()


if __name__ == "__main__":
    main()
