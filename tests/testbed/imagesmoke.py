"""Check a built image without Kubernetes: unpack its archive and run it in a chroot.

The archive's layers are unpacked in order into a scratch directory (what a container runtime
would see), then each image's checks run there as the image's own user, with its environment
and working directory, in mount, network and PID namespaces of their own (imagefs.run_in_root),
so their ports never meet anyone else's and nothing they start outlives them. The operator
runs with a read-only root and a tmpfs /tmp, as the chart's Deployment runs it. The scratch
directory is deleted afterwards.

The CPU engine's check starts a real `vllm serve` of /models/tiny: a heavy run, so take the
machine-wide lock around it (`flock /tmp/vllmdp-heavy.lock ...`). Standard library only.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

import imagebuild
import imagefs
import oci

_HTTP = r"""
http() {  # http METHOD PATH [JSON]: print the body; fail unless 200
  python3 - "$@" <<'PY'
import json, os, sys, urllib.request
method, path = sys.argv[1], sys.argv[2]
data = sys.argv[3].encode() if len(sys.argv) > 3 else None
req = urllib.request.Request(f"http://127.0.0.1:{os.environ['PORT']}{path}", data, method=method,
                             headers={"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=120) as resp:
    print(resp.read().decode())
PY
}
wait_ready() {  # wait_ready PID SECONDS: until /v1/models answers, or PID dies
  for _ in $(seq 1 "$2"); do
    if http GET /v1/models >/dev/null 2>&1; then return 0; fi
    kill -0 "$1" 2>/dev/null || { echo "server exited before it was ready"; return 1; }
    sleep 1
  done
  echo "server not ready after $2 s"; return 1
}
"""

CHECKS: dict[str, str] = {
    "vllm-dp-operator": r"""
test "$(id -u):$(id -g)" = "10001:10001"
kopf --version
python3 -c "import vllm_dp_operator.handlers"
if touch /usr/probe 2>/dev/null; then echo "root filesystem is writable"; exit 1; fi
# The image's ENTRYPOINT and CMD as the chart runs them: with no cluster it must get as far
# as looking for credentials (so the command, the module and its imports all work).
set +e
timeout 20 "$@" > /tmp/kopf.log 2>&1
set -e
cat /tmp/kopf.log | tail -5
grep -q -i "credentials\|login\|kubeconfig" /tmp/kopf.log
""",
    "vllm-dp-engine-double": r"""
test "$(id -u)" = 2000
python -m vllm_dp_launcher --help > /dev/null
ray --version | grep -F "2.60.0"
python -c "import ray, zmq, vllm_dp_launcher"
test "$(command -v vllm)" = /opt/vllm-double/vllm
wget --version > /dev/null
bash -c 'ulimit -n 65536 || ulimit -n' > /dev/null
vllm serve /models/double --served-model-name double --host 127.0.0.1 --port "$PORT" &
pid=$!
wait_ready "$pid" 60
http POST /v1/completions '{"model": "double", "prompt": "hello", "max_tokens": 4}'
kill -TERM "$pid"; wait "$pid"
""",
    "vllm-dp-engine-cpu": r"""
test "$(id -u)" = 2000
python -m vllm_dp_launcher --help > /dev/null
ray --version | grep -F "2.60.0"
python -c "import ray, zmq, vllm_dp_launcher, vllm_dp_test_cpu_glue"
vllm --version
ls -l /models/tiny
export VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind OMP_NUM_THREADS=1
start=$(date +%s)
vllm serve /models/tiny --served-model-name tiny --host 127.0.0.1 --port "$PORT" \
  --dtype float32 --max-model-len 256 --enforce-eager --max-num-seqs 8 \
  --distributed-executor-backend mp --api-server-count 1 > /tmp/serve.log 2>&1 &
pid=$!
wait_ready "$pid" 400 || { tail -40 /tmp/serve.log; exit 1; }
echo "vllm serve ready in $(( $(date +%s) - start )) s"
ps -eo rss=,args= --sort=-rss | head -6 | cut -c1-100
ps -eo rss= | awk '{s += $1} END {printf "RSS of all processes: %d MiB\n", s / 1024}'
http POST /v1/completions '{"model": "tiny", "prompt": "hello world the", "max_tokens": 8}'
http POST /v1/chat/completions \
  '{"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}'
grep -F "vllm_dp_test_cpu_glue" /tmp/serve.log | head -1
kill -TERM "$pid"; wait "$pid"
""",
}


def unpack(archive: Path, dest: Path) -> dict[str, object]:
    """Unpack a docker-archive's layers in order into `dest`; return its manifest entry."""
    entry = oci.read_manifest(archive)
    with tarfile.open(archive) as tar:
        for name in entry["Layers"]:
            member = tar.extractfile(name)
            if member is None:
                raise ValueError(f"{archive}: no {name}")
            unzstd = ["--zstd"] if name.endswith(".zst") else []
            proc = subprocess.Popen(
                ["tar", *unzstd, "-x", "-p", "--numeric-owner", "-C", str(dest)],
                stdin=subprocess.PIPE,
            )
            assert proc.stdin is not None
            shutil.copyfileobj(member, proc.stdin, 1 << 20)
            proc.stdin.close()
            if proc.wait() != 0:
                raise RuntimeError(f"unpacking {name} of {archive} failed")
    whiteouts = [str(p) for p in dest.rglob(".wh.*")]
    if whiteouts:  # imagebuild never writes them; a layer that has one is not ours
        raise RuntimeError(f"{archive}: whiteouts {whiteouts[:5]}")
    return entry


def user_ids(root: Path, user: str | None) -> tuple[str, str]:
    """(uid:gid, home) for an image's USER, looked up in the image's own /etc/passwd."""
    name, _, group = (user or "0").partition(":")
    for line in (root / "etc/passwd").read_text().splitlines():
        fields = line.split(":")
        if len(fields) >= 7 and name in (fields[0], fields[2]):
            return f"{fields[2]}:{group or fields[3]}", fields[5]
    if not name.isdigit():
        raise ValueError(f"user {name!r} is not in the image's /etc/passwd")
    return f"{name}:{group or name}", "/"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def smoke(name: str, archive: Path) -> float:
    """Run `name`'s checks in its unpacked archive; return the seconds they took."""
    scratch_parent = imagebuild.cache_root() / "smoke"
    scratch_parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=scratch_parent))
    scratch.chmod(0o755)  # the image's / (mkdtemp makes it 0700)
    try:
        t0 = time.monotonic()
        entry = unpack(archive, scratch)
        config = entry["config"]["config"]  # type: ignore[index]
        imagebuild.log(f"{name}: unpacked in {time.monotonic() - t0:.0f} s")
        ids, home = user_ids(scratch, config.get("User"))
        env = dict(e.split("=", 1) for e in config.get("Env", []))
        env.setdefault("HOME", home)
        env["PORT"] = str(_free_port())
        command = [*(config.get("Entrypoint") or []), *(config.get("Cmd") or [])]
        script = (
            f"cd {config.get('WorkingDir') or '/'}\n"
            + "set -- " + " ".join(_sh(c) for c in command) + "\n"
            + "set -x\n" + _HTTP + CHECKS[name]
        )
        log = imagebuild.cache_root() / "logs" / f"smoke-{name}.log"
        log.write_text("")
        t1 = time.monotonic()
        imagefs.run_in_root([scratch], script, upper=None, log=log, what=f"smoke {name}",
                            env=env, user=ids, read_only=name == "vllm-dp-operator",
                            own_network=True)  # fmt: skip
        took = time.monotonic() - t1
        imagebuild.log(f"{name}: checks passed in {took:.0f} s (log {log})")
        return took
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _sh(word: str) -> str:
    return "'" + word.replace("'", "'\"'\"'") + "'"

