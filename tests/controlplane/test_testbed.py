"""Checks of the control-plane test bed itself: fake GPU nodes, scheduling on nvidia.com/gpu,
ServiceAccount tokens and RBAC, KubeRay RayCluster readiness, and the RayJob failure stage."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from conftest import RunningTestbed

pytestmark = pytest.mark.controlplane

RAY_IMAGE = "rayproject/ray:2.60.0"
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
FAIL_LABEL = "vllmdp.io/test-fail-submitter"


def _pod(name: str, gpus: int | None, tolerate: bool = True) -> dict[str, Any]:
    res: dict[str, Any] = {"requests": {"cpu": "100m"}}
    if gpus is not None:
        res = {
            "requests": {"cpu": "100m", "nvidia.com/gpu": str(gpus)},
            "limits": {"nvidia.com/gpu": str(gpus)},
        }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "containers": [{"name": "c", "image": "busybox", "resources": res}],
            "tolerations": [GPU_TOLERATION] if tolerate else [],
        },
    }


def _cond(obj: dict[str, Any], ctype: str) -> str | None:
    for c in obj.get("status", {}).get("conditions", []) or []:
        if c.get("type") == ctype:
            return str(c.get("status"))
    return None


def test_fake_gpu_nodes_ready(testbed: RunningTestbed) -> None:
    nodes = testbed.kubectl_json("get", "nodes")["items"]
    gpu = [n for n in nodes if n["metadata"]["labels"].get("nvidia.com/gpu.present") == "true"]
    assert len(gpu) == testbed.info["gpu_nodes"]
    for n in gpu:
        assert n["status"]["allocatable"]["nvidia.com/gpu"] == str(testbed.info["gpus_per_node"])
        assert {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"} in n["spec"][
            "taints"
        ]
        assert "node.kubernetes.io/instance-type" in n["metadata"]["labels"]
    for n in nodes:
        assert _cond(n, "Ready") == "True", n["metadata"]["name"]


def test_builtin_namespaces_exist(testbed: RunningTestbed) -> None:
    names = testbed.kubectl("get", "namespaces", "-o", "name").stdout.split()
    assert {"namespace/default", "namespace/kube-system"} <= set(names)


def test_gpu_pod_scheduled_running_ready(testbed: RunningTestbed, testbed_namespace: str) -> None:
    ns = testbed_namespace
    testbed.wait_until(
        "default SA",
        lambda: testbed.kubectl("get", "sa", "default", "-n", ns, check=False).returncode == 0,
        30,
    )
    testbed.apply(
        [
            _pod("fits", testbed.info["gpus_per_node"]),
            _pod("too-big", testbed.info["gpus_per_node"] + 1),
            _pod("no-toleration", 1, tolerate=False),
        ],
        "-n",
        ns,
    )

    def running() -> dict[str, Any] | None:
        p = testbed.kubectl_json("get", "pod", "fits", "-n", ns)
        ok = (
            p["status"].get("phase") == "Running"
            and _cond(p, "Ready") == "True"
            and p["status"].get("podIP")
        )
        return p if ok else None

    pod = testbed.wait_until("pod fits Running/Ready", running, 30)
    assert pod["spec"]["nodeName"].startswith("gpu-node-")

    def unschedulable(name: str) -> str | None:
        p = testbed.kubectl_json("get", "pod", name, "-n", ns)
        for c in p["status"].get("conditions", []) or []:
            if (
                c["type"] == "PodScheduled"
                and c["status"] == "False"
                and c.get("reason") == "Unschedulable"
            ):
                return str(c.get("message", ""))
        return None

    msg = testbed.wait_until("too-big unschedulable", lambda: unschedulable("too-big"), 30)
    assert "nvidia.com/gpu" in msg
    msg = testbed.wait_until(
        "no-toleration unschedulable", lambda: unschedulable("no-toleration"), 30
    )
    assert "nvidia.com/gpu" in msg  # insufficient on the CPU node, untolerated taint on GPU nodes


def test_serviceaccount_token_and_rbac(testbed: RunningTestbed, testbed_namespace: str) -> None:
    ns = testbed_namespace
    testbed.kubectl("create", "serviceaccount", "probe", "-n", ns)
    token = testbed.kubectl("create", "token", "probe", "-n", ns, "--duration=10m").stdout.strip()
    assert token.count(".") == 2

    def as_sa(*args: str) -> Any:
        return testbed.kubectl(f"--token={token}", "--user=", *args, check=False)

    who = as_sa("auth", "whoami", "-o", "json")
    assert who.returncode == 0, who.stderr
    assert (
        json.loads(who.stdout)["status"]["userInfo"]["username"]
        == f"system:serviceaccount:{ns}:probe"
    )
    denied = as_sa("get", "pods", "-n", ns)
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower()
    testbed.kubectl(
        "create",
        "rolebinding",
        "probe-view",
        "--clusterrole=view",
        f"--serviceaccount={ns}:probe",
        "-n",
        ns,
    )
    testbed.wait_until(
        "RBAC allows get pods", lambda: as_sa("get", "pods", "-n", ns).returncode == 0, 15
    )


def _raycluster(name: str, gpus: int = 4, workers: int = 2) -> dict[str, Any]:
    def container(kind: str) -> dict[str, Any]:
        return {
            "name": f"ray-{kind}",
            "image": RAY_IMAGE,
            "resources": {
                "requests": {"cpu": "1", "memory": "4Gi", "nvidia.com/gpu": str(gpus)},
                "limits": {"cpu": "1", "memory": "4Gi", "nvidia.com/gpu": str(gpus)},
            },
        }

    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": name},
        "spec": {
            "headGroupSpec": {
                "rayStartParams": {},
                "template": {
                    "spec": {"containers": [container("head")], "tolerations": [GPU_TOLERATION]}
                },
            },
            "workerGroupSpecs": [
                {
                    "groupName": "gpu",
                    "replicas": workers,
                    "minReplicas": workers,
                    "maxReplicas": workers,
                    "rayStartParams": {},
                    "template": {
                        "spec": {
                            "containers": [container("worker")],
                            "tolerations": [GPU_TOLERATION],
                        }
                    },
                }
            ],
        },
    }


def _wait_cluster_ready(testbed: RunningTestbed, ns: str, name: str) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        rc = testbed.kubectl_json("get", "raycluster", name, "-n", ns)
        st = rc.get("status", {})
        ok = (
            st.get("state") == "ready"
            and _cond(rc, "HeadPodReady") == "True"
            and _cond(rc, "RayClusterProvisioned") == "True"
        )
        return rc if ok else None

    return testbed.wait_until(f"RayCluster {name} ready", ready, 90)  # type: ignore[no-any-return]


def test_raycluster_becomes_ready(testbed: RunningTestbed, testbed_namespace: str) -> None:
    ns = testbed_namespace
    testbed.apply(_raycluster("rc"), "-n", ns)
    rc = _wait_cluster_ready(testbed, ns, "rc")
    st = rc["status"]
    assert st["readyWorkerReplicas"] == 2
    assert st["head"]["podIP"]
    pods = testbed.kubectl_json("get", "pods", "-n", ns, "-l", "ray.io/cluster=rc")["items"]
    assert sorted(p["metadata"]["labels"]["ray.io/node-type"] for p in pods) == [
        "head",
        "worker",
        "worker",
    ]
    for p in pods:
        assert p["spec"]["nodeName"].startswith("gpu-node-")
        assert p["status"]["phase"] == "Running" and p["status"]["podIP"]


def _rayjob(name: str, cluster: str, fail: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "entrypoint": "python -c 'print(42)'",
        "submissionMode": "K8sJobMode",
        "clusterSelector": {"ray.io/cluster": cluster},
    }
    if fail:
        spec["submitterConfig"] = {"backoffLimit": 0}
        spec["submitterPodTemplate"] = {
            "metadata": {"labels": {FAIL_LABEL: "true"}},
            "spec": {
                "restartPolicy": "Never",
                "containers": [{"name": "ray-job-submitter", "image": RAY_IMAGE}],
            },
        }
    return {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": {"name": name}, "spec": spec}


def test_rayjob_submitter_failure_stage(testbed: RunningTestbed, testbed_namespace: str) -> None:
    ns = testbed_namespace
    testbed.apply(_raycluster("rc"), "-n", ns)
    _wait_cluster_ready(testbed, ns, "rc")
    testbed.apply(_rayjob("doomed", "rc", fail=True), "-n", ns)

    def failed() -> dict[str, Any] | None:
        rj = testbed.kubectl_json("get", "rayjob", "doomed", "-n", ns)
        return rj if rj.get("status", {}).get("jobDeploymentStatus") == "Failed" else None

    rj = testbed.wait_until("RayJob Failed", failed, 90)
    assert rj["status"]["reason"] == "SubmissionFailed"
    job = testbed.kubectl_json("get", "job", "doomed", "-n", ns)
    assert _cond(job, "Failed") == "True"
    pods = testbed.kubectl_json(
        "get", "pods", "-n", ns, "-l", "batch.kubernetes.io/job-name=doomed"
    )["items"]
    assert pods and all(p["status"]["phase"] == "Failed" for p in pods)
    term = pods[0]["status"]["containerStatuses"][0]["state"]["terminated"]
    assert term["exitCode"] != 0


def test_rayjob_default_submitter_runs(testbed: RunningTestbed, testbed_namespace: str) -> None:
    """Without the failure label the submitter Job completes (kwok pod-complete stage); the RayJob
    reaches Running with a dashboard URL and a job id. KubeRay cannot reach a dashboard here, so
    the Ray job status never arrives, and 30 s after the submitter finished KubeRay gives up:
    Failed / JobDeploymentStatusTransitionGracePeriodExceeded. No RayJob can succeed here."""
    ns = testbed_namespace
    testbed.apply(_raycluster("rc", workers=1), "-n", ns)
    _wait_cluster_ready(testbed, ns, "rc")
    testbed.apply(_rayjob("ok", "rc", fail=False), "-n", ns)

    def running() -> dict[str, Any] | None:
        rj = testbed.kubectl_json("get", "rayjob", "ok", "-n", ns)
        st = rj.get("status", {})
        return rj if st.get("jobDeploymentStatus") == "Running" and st.get("dashboardURL") else None

    rj = testbed.wait_until("RayJob Running", running, 60)
    assert rj["status"]["jobId"]
    assert rj["status"]["dashboardURL"].endswith(":8265")
    testbed.wait_until(
        "submitter Job complete",
        lambda: _cond(testbed.kubectl_json("get", "job", "ok", "-n", ns), "Complete") == "True",
        60,
    )

    def gave_up() -> dict[str, Any] | None:
        rj = testbed.kubectl_json("get", "rayjob", "ok", "-n", ns)
        return rj if rj.get("status", {}).get("jobDeploymentStatus") == "Failed" else None

    st = testbed.wait_until("RayJob Failed after the 30 s grace period", gave_up, 75)["status"]
    assert st["reason"] == "JobDeploymentStatusTransitionGracePeriodExceeded"
    assert st["jobStatus"] == "FAILED"
