"""Read a Dockerfile's stages and instructions, so the image tool builds what it says.

The project's Dockerfiles stay the one definition of what an image holds and how it runs; the
image tool (images.py) reads them instead of keeping a second copy: the builder stage's
COPY sources and `pip wheel` paths, the runtime stage's RUN lines (run as written), and its
ENV, LABEL, USER, WORKDIR, ENTRYPOINT and CMD (the image config).

Only the plain Dockerfile syntax these files use is understood: line continuations, comments,
JSON or shell form for ENTRYPOINT/CMD, `KEY=value` ENV (and the legacy `ENV KEY value`),
`${VAR}` expansion of ENV from earlier ENV, and flags such as `--mount=...` or `--chmod=...`.
No heredocs. Standard library only.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import oci


class DockerfileError(ValueError):
    """The Dockerfile uses something this reader does not handle (named in the message)."""


@dataclass(frozen=True)
class Instruction:
    """One instruction: its keyword (upper case), its `--flag=value` flags and the rest."""

    keyword: str
    flags: tuple[str, ...]
    args: str
    line: int

    def flag(self, name: str) -> str | None:
        """The value of `--name=value`, or None."""
        for flag in self.flags:
            key, _, value = flag[2:].partition("=")
            if key == name:
                return value
        return None


@dataclass
class Stage:
    """A `FROM ... [AS name]` stage and its instructions in order."""

    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        """The stage's instructions with this keyword, in order."""
        return [i for i in self.instructions if i.keyword == keyword]


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """Join continuation lines; drop comments and blank lines. Returns (first line no, text)."""
    out: list[tuple[int, str]] = []
    buf: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not buf):
            continue
        if not buf:
            start = number
        if raw.rstrip().endswith("\\"):
            buf.append(raw.rstrip()[:-1])
            continue
        buf.append(raw)
        out.append((start, " ".join(part.strip() for part in buf if part.strip())))
        buf = []
    if buf:
        out.append((start, " ".join(part.strip() for part in buf if part.strip())))
    return out


def parse(text: str) -> list[Stage]:
    """The stages of a Dockerfile, in order."""
    stages: list[Stage] = []
    for number, line in _logical_lines(text):
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        rest = rest.strip()
        flags: list[str] = []
        while rest.startswith("--"):
            flag, _, rest = rest.partition(" ")
            flags.append(flag)
            rest = rest.strip()
        if keyword == "FROM":
            words = rest.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(base=words[0], name=name))
            continue
        if not stages:
            if keyword == "ARG":
                continue  # a global ARG before the first FROM
            raise DockerfileError(f"line {number}: {keyword} before any FROM")
        stages[-1].instructions.append(Instruction(keyword, tuple(flags), rest, number))
    if not stages:
        raise DockerfileError("no FROM: not a Dockerfile")
    return stages


def load(path: Path) -> list[Stage]:
    """Parse the Dockerfile at `path`."""
    try:
        return parse(path.read_text())
    except DockerfileError as exc:
        raise DockerfileError(f"{path}: {exc}") from None


def stage(stages: list[Stage], name: str | None = None) -> Stage:
    """The stage called `name`, or the last stage (the one that becomes the image)."""
    if name is None:
        return stages[-1]
    for candidate in stages:
        if candidate.name == name:
            return candidate
    raise DockerfileError(f"no stage named {name!r}")


def expand(value: str, env: dict[str, str]) -> str:
    """`${VAR}` and `$VAR` replaced from `env` (unset variables become empty, as in Docker)."""
    return re.sub(
        r"\$(?:\{(\w+)\}|(\w+))", lambda m: env.get(m.group(1) or m.group(2), ""), value
    )


def env_pairs(instruction: Instruction, env: dict[str, str]) -> list[tuple[str, str]]:
    """The (name, value) pairs an ENV instruction sets, expanded against `env`."""
    words = shlex.split(instruction.args)
    if words and "=" not in words[0]:
        return [(words[0], expand(" ".join(words[1:]), env))]  # legacy `ENV KEY value`
    pairs = []
    for word in words:
        key, sep, value = word.partition("=")
        if not sep:
            raise DockerfileError(f"line {instruction.line}: ENV {word!r} has no '='")
        pairs.append((key, expand(value, env)))
    return pairs


def _exec_form(instruction: Instruction) -> list[str]:
    args = instruction.args.strip()
    if args.startswith("["):
        value = json.loads(args)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise DockerfileError(f"line {instruction.line}: {instruction.keyword} is not a list")
        return value
    return ["/bin/sh", "-c", args]


def config(stage: Stage, env: dict[str, str] | None = None) -> oci.ImageConfig:
    """The image config a stage ends with: ENV, LABEL, USER, WORKDIR, ENTRYPOINT, CMD.

    `env` is what the base image already sets (it is extended, in order, by the stage's ENV).
    """
    current = dict(env or {})
    labels: dict[str, str] = {}
    user: str | None = None
    workdir = "/"
    entrypoint: list[str] | None = None
    cmd: list[str] | None = None
    for ins in stage.instructions:
        if ins.keyword == "ENV":
            current.update(env_pairs(ins, current))
        elif ins.keyword == "LABEL":
            for word in shlex.split(ins.args):
                key, _, value = word.partition("=")
                labels[key] = value
        elif ins.keyword == "USER":
            user = expand(ins.args.strip(), current)
        elif ins.keyword == "WORKDIR":
            workdir = str(Path(workdir) / expand(ins.args.strip(), current))
        elif ins.keyword == "ENTRYPOINT":
            entrypoint = _exec_form(ins)
            cmd = None  # Docker resets CMD when ENTRYPOINT is set after it
        elif ins.keyword == "CMD":
            cmd = _exec_form(ins)
    return oci.ImageConfig(
        entrypoint=entrypoint,
        cmd=cmd,
        env=[f"{k}={v}" for k, v in current.items()],
        workdir=workdir,
        user=user,
        labels=labels,
    )


def env_before(stage: Stage, instruction: Instruction) -> dict[str, str]:
    """The ENV in effect when `instruction` runs (the stage's ENV above it)."""
    current: dict[str, str] = {}
    for ins in stage.instructions:
        if ins is instruction:
            break
        if ins.keyword == "ENV":
            current.update(env_pairs(ins, current))
    return current


def arg_default(text: str, name: str) -> str | None:
    """The default value of `ARG name=value`, anywhere in the Dockerfile text."""
    for line in text.splitlines():
        match = re.match(rf"\s*ARG\s+{re.escape(name)}=(\S+)", line, re.IGNORECASE)
        if match:
            return match.group(1).strip("\"'")
    return None


def copy_sources(instruction: Instruction) -> tuple[list[str], str]:
    """The sources and destination of a COPY (shell or JSON form)."""
    args = instruction.args.strip()
    words = json.loads(args) if args.startswith("[") else shlex.split(args)
    if len(words) < 2:
        raise DockerfileError(f"line {instruction.line}: COPY needs a source and a destination")
    return words[:-1], words[-1]
