"""The image tool reads the Dockerfiles instead of copying them (tests/testbed/dockerfile.py,
imagedefs.py): the parser, and what it reads from the project's own Dockerfiles."""

from __future__ import annotations

import shlex
import sys
import tomllib
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testbed"))
import dockerfile
import imagedefs

REPO = Path(__file__).resolve().parents[2]

SAMPLE = """\
# syntax=docker/dockerfile:1
ARG BASE=python:3.11-slim
FROM ${BASE} AS builder
WORKDIR /src
COPY pyproject.toml README.md ./
RUN pip wheel --no-deps --wheel-dir /wheels .

FROM ${BASE}
ENV A=1 \\
    B="two words"
# a comment inside the stage
ENV PATH="/opt/x:${PATH}"
ENV LEGACY value with spaces
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \\
    pip install /wheels/*.whl \\
    && useradd --uid 7 app
USER 7:7
WORKDIR /app
WORKDIR data
CMD ["ignored"]
ENTRYPOINT ["tool", "run"]
"""


def test_stages_instructions_flags_and_continuations() -> None:
    stages = dockerfile.parse(SAMPLE)
    assert [(s.name, s.base) for s in stages] == [("builder", "${BASE}"), (None, "${BASE}")]
    (run,) = stages[1].all("RUN")
    assert run.flag("mount") == "type=bind,from=builder,source=/wheels,target=/wheels"
    assert run.args == "pip install /wheels/*.whl && useradd --uid 7 app"
    assert dockerfile.copy_sources(stages[0].all("COPY")[0]) == (["pyproject.toml", "README.md"],
                                                                 "./")


def test_config_env_expansion_user_workdir_and_entrypoint_resets_cmd() -> None:
    runtime = dockerfile.stage(dockerfile.parse(SAMPLE))
    config = dockerfile.config(runtime, env={"PATH": "/usr/bin"})
    env = dict(e.split("=", 1) for e in config.env)
    assert env == {"PATH": "/opt/x:/usr/bin", "A": "1", "B": "two words",
                   "LEGACY": "value with spaces"}
    assert config.user == "7:7"
    assert config.workdir == "/app/data"
    assert config.entrypoint == ["tool", "run"]
    assert config.cmd is None  # Docker drops a CMD set before ENTRYPOINT


def test_shell_form_and_env_before_a_run() -> None:
    stages = dockerfile.parse("FROM x\nENV A=1\nRUN echo $A\nENV B=2\nCMD echo hi\n")
    runtime = stages[0]
    assert dockerfile.env_before(runtime, runtime.all("RUN")[0]) == {"A": "1"}
    assert dockerfile.config(runtime).cmd == ["/bin/sh", "-c", "echo hi"]


def test_not_a_dockerfile_is_refused() -> None:
    with pytest.raises(dockerfile.DockerfileError, match="no FROM"):
        dockerfile.parse("# nothing\n")
    with pytest.raises(dockerfile.DockerfileError, match="RUN before any FROM"):
        dockerfile.parse("RUN true\nFROM x\n")


def test_builder_stage_with_other_steps_is_refused() -> None:
    stages = dockerfile.parse("FROM x AS b\nRUN apt-get install -y gcc\nFROM y\n")
    with pytest.raises(dockerfile.DockerfileError, match="only runs `pip wheel --no-deps"):
        imagedefs.wheel_build(stages[0], REPO)


# --- the project's own Dockerfiles ---------------------------------------------------------------


def _pip_wheel_paths(path: Path) -> list[str]:
    """The positional paths of every `pip wheel` RUN in the Dockerfile's builder stage."""
    paths = []
    for ins in dockerfile.stage(dockerfile.load(path), "builder").all("RUN"):
        words = shlex.split(ins.args)
        skip = False
        for word in words[2:]:
            if skip:
                skip = False
            elif word in ("--wheel-dir", "-w"):
                skip = True
            elif not word.startswith("-"):
                paths.append(word)
    return paths


def test_operator_image_installs_every_wheel_the_dockerfile_builds() -> None:
    plan = imagedefs.operator_plan()
    assert list(plan.wheels.paths) == _pip_wheel_paths(REPO / "Dockerfile")
    # Every builder COPY source is an input of the layer (a change to it rebuilds the layer).
    for src in plan.wheels.sources():
        assert src.exists(), src


def test_operator_dependencies_are_the_wheels_pyproject_dependencies() -> None:
    plan = imagedefs.operator_plan()
    projects = plan.wheels.projects()
    ours = {imagedefs._canonical(str(p["name"])) for p in projects}
    expected = sorted({
        d for p in projects for d in p.get("dependencies", [])  # type: ignore[attr-defined]
        if imagedefs._requirement_name(d) not in ours
    })  # fmt: skip
    assert list(plan.dependencies) == expected
    root = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for dep in root["dependencies"]:
        if imagedefs._requirement_name(dep) not in ours:
            assert dep in plan.dependencies


def test_operator_runtime_settings_and_runs_come_from_the_dockerfile() -> None:
    plan = imagedefs.operator_plan()
    runtime = dockerfile.stage(dockerfile.load(REPO / "Dockerfile"))
    assert [cmd for cmd, _env, _target in plan.runs] == [i.args for i in runtime.all("RUN")]
    exp = dockerfile.config(runtime, env=dict(imagedefs.BASE_ENV))
    assert plan.config == exp
    assert plan.config.user and plan.config.user.split(":")[0] != "0"
    assert plan.config.entrypoint and plan.config.entrypoint[0] == "kopf"


def test_engine_test_images_take_the_engine_dockerfiles_settings() -> None:
    plan = imagedefs.engine_plan()
    runtime = dockerfile.stage(dockerfile.load(REPO / "engine_image" / "Dockerfile"))
    assert plan.config == dockerfile.config(runtime, env=dict(imagedefs.BASE_ENV))
    assert "useradd" in plan.user_setup[0]
    assert plan.launcher.paths == ("opt/vllm-dp-launcher",)
    for src in plan.launcher.sources():
        assert src.exists(), src
    _top, double = imagedefs.double_image()
    env = dict(e.split("=", 1) for e in double.env)
    assert env["PATH"].startswith("/opt/vllm-double:")
    assert env["PATH"].endswith(imagedefs.BASE_ENV["PATH"])
    assert double.user == plan.config.user
    _top, cpu = imagedefs.cpu_image()
    assert {"HF_HUB_OFFLINE=1", "TRANSFORMERS_OFFLINE=1"} <= set(cpu.env)


def test_two_wheels_one_depending_on_the_other(tmp_path: Path) -> None:
    """The operator image installing the launcher's wheel too (its plan schema), as the root
    Dockerfile may: both are built, and only third-party requirements form the deps layer."""
    (tmp_path / "operator" / "op").mkdir(parents=True)
    (tmp_path / "engine_image" / "launcher").mkdir(parents=True)
    (tmp_path / "README.md").write_text("x")
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "vllm-dp-operator"\nversion = "1"\n'
        'dependencies = ["kopf>=1.45", "vllm_dp_launcher==0.1.0"]\n'
    )
    (tmp_path / "engine_image" / "pyproject.toml").write_text(
        '[project]\nname = "vllm-dp-launcher"\nversion = "0.1.0"\ndependencies = ["pyzmq>=26"]\n'
    )
    (tmp_path / "Dockerfile").write_text(
        "FROM python:3.11-slim AS builder\nWORKDIR /src\nCOPY pyproject.toml README.md ./\n"
        "COPY operator/ operator/\nCOPY engine_image/ engine_image/\n"
        "RUN pip wheel --no-deps --wheel-dir /wheels . ./engine_image\n"
        "FROM python:3.11-slim\n"
        "RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels "
        "pip install /wheels/*.whl\nUSER 1:1\nENTRYPOINT [\"kopf\"]\n"
    )
    plan = imagedefs.operator_plan(tmp_path / "Dockerfile")
    assert plan.wheels.paths == (".", "./engine_image")
    assert plan.dependencies == ("kopf>=1.45", "pyzmq>=26")
    assert [target for _cmd, _env, target in plan.runs] == ["/wheels"]
    assert set(plan.wheels.sources()) == {
        tmp_path / "pyproject.toml", tmp_path / "README.md", tmp_path / "operator",
        tmp_path / "engine_image"}  # fmt: skip


def test_the_operator_image_installs_its_dependencies_from_the_hash_lock() -> None:
    """The shipped image and the test image both install the third-party set from
    operator/requirements.lock with --require-hashes, and the lock still satisfies every
    dependency pyproject.toml declares (edit one without re-locking and this fails)."""
    plan = imagedefs.operator_plan()
    assert plan.lock == REPO / "operator" / "requirements.lock"
    install = plan.runs[0][0]
    assert "--require-hashes -r /wheels/requirements.lock" in install
    assert "--no-deps /wheels/*.whl" in install
    sys.path.insert(0, str(REPO / "hack"))
    import lock_operator

    pins = lock_operator.read_lock()
    assert lock_operator.unsatisfied(pins, lock_operator.requirements()) == []
    assert all(len(digest) == 64 for _version, digest in pins.values())


def test_the_shipped_dockerfiles_pin_their_base_images_by_digest() -> None:
    """Every FROM of the operator's Dockerfile resolves to an image@sha256 (a stage name or an
    ARG whose default is one)."""
    text = (REPO / "Dockerfile").read_text()
    stages = dockerfile.load(REPO / "Dockerfile")
    names = {s.name for s in stages if s.name}
    for line in text.splitlines():
        words = line.split()
        if not words or words[0].upper() != "FROM":
            continue
        image = words[1]
        if image.startswith("${"):
            image = dockerfile.arg_default(text, image.strip("${}")) or image
        assert image in names or "@sha256:" in image, f"{line!r}: not pinned by digest"
