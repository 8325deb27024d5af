"""Container image archives without Docker or a registry: directories in, docker-archive out.

A layer is a directory tree packed as an uncompressed tar; an image is an ordered list of
layers plus a config (entrypoint, command, environment, user, working directory). The archive
is the `docker save` format, which `ctr images import` and `docker load` both read. Nothing
here starts a process or touches a container runtime; importing is the real-node module's job.

    layer = build_layer(rootfs_dir, cache_dir / "base.tar")
    write_archive("vllm-dp-operator:dev", [layer], ImageConfig(entrypoint=["kopf", "run"]), out)

Standard library only (and the `zstd` command for compressed layers).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import platform
import subprocess
import tarfile
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

# Paths that are mount points in a running container: their contents never belong in a layer.
RUNTIME_MOUNTS = ("dev", "proc", "sys", "run")
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Layer:
    """One packed layer: the tar on disk and its uncompressed digest (the diff ID).

    `blob`, when set, is the same tar compressed (see `compress_layer`): the archive carries
    it instead of `path`, and the runtime detects the compression when it imports it.
    """

    path: Path
    diff_id: str  # "sha256:<hex>"
    size: int
    blob: Path | None = None
    blob_digest: str | None = None  # "sha256:<hex>" of `blob`

    @property
    def archived(self) -> Path:
        """The file the archive carries for this layer."""
        return self.blob or self.path


@dataclass(frozen=True)
class ImageConfig:
    """The runtime settings an image carries (the `config` object of the image config)."""

    entrypoint: Sequence[str] | None = None
    cmd: Sequence[str] | None = None
    env: Sequence[str] = ()  # "NAME=value"; PATH is added when absent
    workdir: str = "/"
    user: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    stop_signal: str | None = None  # e.g. systemd's SIGRTMIN+3 (the kind node image)


DEFAULT_PATH = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class _HashingWriter:
    """A write-only file that hashes and counts what passes through to another file."""

    def __init__(self, out: IO[bytes]) -> None:
        self._out = out
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self._out.write(data)
        self.sha.update(data)
        self.size += len(data)
        return len(data)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self._out.flush()


def _skip_runtime_mounts(top: Path) -> Callable[[tarfile.TarInfo], tarfile.TarInfo | None]:
    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        parts = Path(info.name).parts
        # Keep the mount point itself (an empty directory), never what is below it.
        if len(parts) > 1 and parts[0] in RUNTIME_MOUNTS:
            return None
        return info

    del top
    return keep


def build_layer(
    source: Path, out: Path, keep: Callable[[tarfile.TarInfo], tarfile.TarInfo | None] | None = None
) -> Layer:
    """Pack `source` (its contents at the image root) into the tar `out`; return the layer.

    Entries are added in sorted order with their owners and modes as on disk; the contents of
    /dev, /proc, /sys and /run are left out. `keep` may drop or edit further entries.
    """
    source = source.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    skip = _skip_runtime_mounts(source)

    def both(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        kept = skip(info)
        return keep(kept) if kept is not None and keep is not None else kept

    fd, tmp = tempfile.mkstemp(prefix=".layer-", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as raw:
            writer = _HashingWriter(raw)
            with tarfile.open(
                fileobj=writer, mode="w", format=tarfile.PAX_FORMAT, copybufsize=_CHUNK  # type: ignore[call-overload]
            ) as tar:
                for name in sorted(os.listdir(source)):
                    tar.add(source / name, arcname=name, filter=both)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Layer(out, f"sha256:{writer.sha.hexdigest()}", writer.size)


def layer_from_tar(path: Path) -> Layer:
    """A Layer for a tar already on disk (its digest is computed by reading it once)."""
    sha = hashlib.sha256()
    size = 0
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            sha.update(chunk)
            size += len(chunk)
    return Layer(path, f"sha256:{sha.hexdigest()}", size)


def compress_layer(layer: Layer, out: Path, level: int = 3) -> Layer:
    """`layer` with its tar compressed by zstd into `out` (multi-threaded; needs `zstd`).

    containerd (1.6 and 2.x) reads zstd layers from a docker-archive and keeps them compressed
    in its content store: half the bytes to write on each import for the engine layers.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".blob-", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run(
            ["zstd", "-q", "-f", f"-{level}", "-T0", str(layer.path), "-o", tmp], check=True
        )
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Layer(layer.path, layer.diff_id, layer.size, out, file_digest(out))


def file_digest(path: Path) -> str:
    """`sha256:<hex>` of a file, read in chunks."""
    sha = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            sha.update(chunk)
    return f"sha256:{sha.hexdigest()}"


def _arch() -> str:
    machine = platform.machine().lower()
    return {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(machine, machine)


def image_config(layers: Sequence[Layer], config: ImageConfig) -> dict[str, Any]:
    """The image config document (OCI image spec `config.json`) for these layers."""
    env = list(config.env)
    if not any(e.startswith("PATH=") for e in env):
        env.insert(0, DEFAULT_PATH)
    runtime: dict[str, Any] = {"Env": env, "WorkingDir": config.workdir}
    if config.entrypoint is not None:
        runtime["Entrypoint"] = list(config.entrypoint)
    if config.cmd is not None:
        runtime["Cmd"] = list(config.cmd)
    if config.user:
        runtime["User"] = config.user
    if config.labels:
        runtime["Labels"] = dict(config.labels)
    if config.stop_signal:
        runtime["StopSignal"] = config.stop_signal
    return {
        "architecture": _arch(),
        "os": "linux",
        "config": runtime,
        "rootfs": {"type": "layers", "diff_ids": [layer.diff_id for layer in layers]},
        "history": [{"created_by": f"layer {layer.path.name}"} for layer in layers],
    }


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(data))


def write_archive(ref: str, layers: Sequence[Layer], config: ImageConfig, out: Path) -> str:
    """Write a docker-archive tar of `layers` tagged `ref`; return the image config digest."""
    if not layers:
        raise ValueError("an image needs at least one layer")
    config_bytes = json.dumps(image_config(layers, config), sort_keys=True).encode()
    config_digest = hashlib.sha256(config_bytes).hexdigest()
    layer_names = [
        f"{layer.diff_id.split(':', 1)[1]}/layer.tar{'.zst' if layer.blob else ''}"
        for layer in layers
    ]
    manifest = [{"Config": f"{config_digest}.json", "RepoTags": [ref], "Layers": layer_names}]
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".image-", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w") as tar:
            _add_bytes(tar, f"{config_digest}.json", config_bytes)
            _add_bytes(tar, "manifest.json", json.dumps(manifest).encode())
            seen: set[str] = set()
            for layer, name in zip(layers, layer_names, strict=True):
                if name in seen:
                    continue
                seen.add(name)
                tar.add(layer.archived, arcname=name)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return f"sha256:{config_digest}"


def read_manifest(archive: Path) -> dict[str, Any]:
    """The one manifest entry of a docker-archive tar, with its config parsed."""
    with tarfile.open(archive) as tar:
        manifest_file = tar.extractfile("manifest.json")
        if manifest_file is None:
            raise ValueError(f"{archive}: no manifest.json")
        (entry,) = json.load(manifest_file)
        config_file = tar.extractfile(entry["Config"])
        if config_file is None:
            raise ValueError(f"{archive}: no {entry['Config']}")
        entry = dict(entry, config=json.load(config_file))
    return dict(entry)


OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"


def containerd_name(ref: str) -> str:
    """The full name containerd (and the kubelet) give a short ref: docker.io/library/x:tag."""
    name = ref.rsplit(":", 1)[0] if ":" in ref.rsplit("/", 1)[-1] else ref
    first = name.split("/", 1)[0]
    if "/" not in name:
        ref = f"docker.io/library/{ref}"
    elif "." not in first and ":" not in first and first != "localhost":
        ref = f"docker.io/{ref}"
    return ref


def write_oci_archive(
    ref: str, layers: Sequence[Layer], config: ImageConfig, out: Path,
    omit: frozenset[str] = frozenset(),
) -> str:  # fmt: skip
    """Write an OCI image layout tar of compressed `layers` tagged `ref`; return the manifest
    digest. Blobs whose digest is in `omit` are left out (a store that already holds them,
    such as a node's containerd, imports the rest and unpacks the image from what it has)."""
    if not layers or any(layer.blob is None or layer.blob_digest is None for layer in layers):
        raise ValueError("an OCI archive needs at least one layer, each compressed")
    config_bytes = json.dumps(image_config(layers, config), sort_keys=True).encode()
    config_digest = f"sha256:{hashlib.sha256(config_bytes).hexdigest()}"
    config_desc = {"mediaType": OCI_CONFIG, "size": len(config_bytes), "digest": config_digest}
    layer_descs = [
        {"mediaType": "application/vnd.oci.image.layer.v1.tar+zstd",
         "digest": layer.blob_digest, "size": layer.archived.stat().st_size}
        for layer in layers
    ]  # fmt: skip
    manifest = json.dumps({"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                           "config": config_desc, "layers": layer_descs}).encode()  # fmt: skip
    manifest_digest = f"sha256:{hashlib.sha256(manifest).hexdigest()}"
    tag = ref.rsplit(":", 1)[1] if ":" in ref.rsplit("/", 1)[-1] else "latest"
    index = {"schemaVersion": 2, "manifests": [{
        "mediaType": OCI_MANIFEST, "digest": manifest_digest, "size": len(manifest),
        "annotations": {"io.containerd.image.name": containerd_name(ref),
                        "org.opencontainers.image.ref.name": tag},
    }]}  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".oci-", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w") as tar:
            _add_bytes(tar, "oci-layout", b'{"imageLayoutVersion": "1.0.0"}')
            _add_bytes(tar, "index.json", json.dumps(index).encode())
            _add_bytes(tar, f"blobs/sha256/{config_digest[7:]}", config_bytes)
            _add_bytes(tar, f"blobs/sha256/{manifest_digest[7:]}", manifest)
            seen: set[str] = set()
            for layer in layers:
                digest = str(layer.blob_digest)
                if digest in omit or digest in seen:
                    continue
                seen.add(digest)
                tar.add(layer.archived, arcname=f"blobs/sha256/{digest[7:]}")
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return manifest_digest
