"""The image tool's cache: layers keyed by their inputs, built once, shared by every image.

A layer is a recipe (a build function) plus the inputs that decide its content (strings and
files). Its key hashes those inputs and its parent's key, so a change below rebuilds what is
above it, and a change to the small project layer at the top rebuilds only that layer. Each
built layer keeps its tree (`root/`, the lower of the layers built on it) and its packed tar
(`layer.tar`, what goes into an archive), with `meta.json` (digest, size, build seconds).

    ~/.cache/vllm-dp-operator/images/          ($VLLMDP_CACHE/images when set)
      layers/<name>-<key>/{root/,layer.tar.zst,meta.json}
      archives/<image>-<id>.tar                 the docker-archive an image ref points at
      logs/<name>-<key>.log                     what each build step printed

Builds of the same key wait for each other on a lock file; nothing is ever rebuilt in place
(a new key gets a new directory). An image's older archives go once unused for an hour;
layers stay until `images.py prune` removes those the checkout no longer uses. Standard
library only.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import imagefs
import oci

# Bump when the way layers are made changes, to invalidate every cached layer.
RECIPE = "2"
ARCHIVE_KEEP_SECONDS = 3600
SKIP_PARTS = {"__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache", "build", "dist"}


def cache_root() -> Path:
    """${VLLMDP_CACHE:-${XDG_CACHE_HOME:-~/.cache}/vllm-dp-operator}/images."""
    base = os.environ.get("VLLMDP_CACHE")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        base = str(Path(xdg) / "vllm-dp-operator")
    return Path(base) / "images"


def log(msg: str) -> None:
    print(f"[images] {msg}", file=sys.stderr, flush=True)


def tree_digest(paths: Sequence[Path], base: Path) -> str:
    """A digest of files and directory trees (relative names, exec bit and contents)."""
    h = hashlib.sha256()
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            for dirpath, dirnames, filenames in os.walk(path):
                dirnames[:] = sorted(
                    d for d in dirnames if d not in SKIP_PARTS and not d.endswith(".egg-info")
                )
                files += [Path(dirpath) / f for f in filenames if not f.endswith(".pyc")]
        elif path.exists():
            files.append(path)
        else:
            raise FileNotFoundError(f"image input {path} does not exist")
    for file in sorted(files):
        mode = "x" if os.access(file, os.X_OK) else "-"
        h.update(f"{file.relative_to(base)}\0{mode}\0".encode())
        h.update(file.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


@dataclass(frozen=True)
class LayerDef:
    """How to make one layer: a build function, what decides its content, and its parent.

    `build(upper, lowers, log)` writes the layer into `upper` (lowers are the trees below it,
    top first). `inputs` are strings (pins, commands, settings); `files` are paths whose
    contents count too.
    """

    name: str
    build: Callable[[Path, list[Path], Path], None]
    parent: LayerDef | None = None
    inputs: tuple[str, ...] = ()
    files: tuple[Path, ...] = ()
    files_base: Path = Path("/")

    @property
    def key(self) -> str:
        h = hashlib.sha256(f"recipe={RECIPE}\0{self.name}\0".encode())
        h.update((self.parent.key if self.parent else "").encode() + b"\0")
        for item in self.inputs:
            h.update(item.encode() + b"\0")
        if self.files:
            h.update(tree_digest(list(self.files), self.files_base).encode())
        return h.hexdigest()[:16]

    def chain(self) -> list[LayerDef]:
        """This layer and those below it, bottom first."""
        below = self.parent.chain() if self.parent else []
        return [*below, self]


@dataclass
class BuiltLayer:
    """A layer in the cache: its tree, its tar and what it cost."""

    definition: LayerDef
    dir: Path
    layer: oci.Layer
    meta: dict[str, object] = field(default_factory=dict)

    @property
    def root(self) -> Path:
        return self.dir / "root"


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (a lock file) for the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def layer_dir(definition: LayerDef) -> Path:
    return cache_root() / "layers" / f"{definition.name}-{definition.key}"


def cached(definition: LayerDef, d: Path | None = None) -> BuiltLayer | None:
    """The built layer for this definition, if the cache has it (in `d`: the directory its
    key named when the build began, so an input edited during the build cannot hide it)."""
    d = d or layer_dir(definition)
    meta_file = d / "meta.json"
    if not meta_file.is_file():
        return None
    meta = json.loads(meta_file.read_text())
    if "blob_digest" not in meta:  # written before the digest was recorded
        meta["blob_digest"] = oci.file_digest(d / "layer.tar.zst")
        meta_file.write_text(json.dumps(meta, indent=1) + "\n")
    os.utime(meta_file)  # last used: `prune` keeps what was used recently
    layer = oci.Layer(d / "layer.tar", str(meta["diff_id"]), int(meta["size"]),
                      d / "layer.tar.zst", str(meta["blob_digest"]))  # fmt: skip
    return BuiltLayer(definition, d, layer, meta)


def ensure_layer(definition: LayerDef, force: bool = False) -> BuiltLayer:
    """The layer from the cache, or built (its parents first) and cached."""
    parent = ensure_layer(definition.parent) if definition.parent else None
    found = None if force else cached(definition)
    if found:
        return found
    final = layer_dir(definition)
    with locked(final.parent / f".{final.name}.lock"):
        found = None if force else cached(definition)
        if found:
            return found
        lowers = [b.root for b in _built_chain(parent)] if parent else []
        tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        logfile = cache_root() / "logs" / f"{final.name}.log"
        logfile.parent.mkdir(parents=True, exist_ok=True)
        logfile.write_text("")
        log(f"layer {definition.name}: building (log {logfile})")
        try:
            t0 = time.monotonic()
            definition.build(tmp / "root", lowers, logfile)
            imagefs.check_no_whiteouts(tmp / "root", f"layer {definition.name}")
            t1 = time.monotonic()
            layer = oci.build_layer(tmp / "root", tmp / "layer.tar")
            imagefs.ensure_tool("zstd")
            layer = oci.compress_layer(layer, tmp / "layer.tar.zst")
            layer.path.unlink()  # the archive carries the compressed blob only
            assert layer.blob is not None
            t2 = time.monotonic()
            meta = {
                "name": definition.name, "key": definition.key, "diff_id": layer.diff_id,
                "size": layer.size, "blob_size": layer.blob.stat().st_size,
                "blob_digest": layer.blob_digest,
                "build_seconds": round(t1 - t0, 1), "pack_seconds": round(t2 - t1, 1),
                "built_at": int(time.time()),
            }  # fmt: skip
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
            if force and final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    log(
        f"layer {definition.name}: built in {meta['build_seconds']} s, packed in "
        f"{meta['pack_seconds']} s, {layer.size / 1e6:.0f} MB "
        f"({int(str(meta['blob_size'])) / 1e6:.0f} MB compressed)"
    )
    built = cached(definition, final)
    assert built is not None
    return built


def _built_chain(top: BuiltLayer) -> list[BuiltLayer]:
    """`top` and the built layers below it, top first (the overlay lower order)."""
    out = []
    for definition in reversed(top.definition.chain()):
        found = cached(definition)
        if found is None:
            raise RuntimeError(f"layer {definition.name} vanished from the cache")
        out.append(found)
    return out


def ensure_archive(
    image: str, ref: str, top: LayerDef, config: oci.ImageConfig, force: bool = False
) -> Path:
    """The docker-archive tar for `ref` with `top`'s layer chain, built when missing."""
    top_built = ensure_layer(top, force=force)
    layers = [b.layer for b in reversed(_built_chain(top_built))]
    image_id = hashlib.sha256(
        json.dumps(
            [ref, oci.image_config(layers, config)], sort_keys=True
        ).encode()
    ).hexdigest()[:16]
    out = cache_root() / "archives" / f"{image}-{image_id}.tar"
    if out.is_file() and not force:
        os.utime(out)
        return out
    with locked(out.parent / f".{out.name}.lock"):
        if not out.is_file() or force:
            t0 = time.monotonic()
            oci.write_archive(ref, layers, config, out)
            out.chmod(0o644)
            log(
                f"{ref}: archive written in {time.monotonic() - t0:.1f} s, "
                f"{out.stat().st_size / 1e6:.0f} MB"
            )
    # Older archives of this image, unused for an hour (another checkout may still use a
    # recent one; rewriting an archive from cached layers takes seconds).
    for old in out.parent.glob(f"{image}-*.tar"):
        if old != out and time.time() - old.stat().st_mtime > ARCHIVE_KEEP_SECONDS:
            old.unlink(missing_ok=True)
            (old.parent / f".{old.name}.lock").unlink(missing_ok=True)
    return out


def write_oci_archive(ref: str, top: LayerDef, config: oci.ImageConfig, out: Path,
                      omit: frozenset[str] = frozenset()) -> Path:  # fmt: skip
    """An OCI layout tar of `top`'s image at `out`, less the blobs in `omit` (by digest)."""
    top_built = ensure_layer(top)
    layers = [b.layer for b in reversed(_built_chain(top_built))]
    oci.write_oci_archive(ref, layers, config, out, omit)
    return out


def prune(keep: set[str], older_than_hours: float) -> list[Path]:
    """Delete cached layers not in `keep` (layer dir names) and unused for that long."""
    removed = []
    for d in sorted((cache_root() / "layers").glob("*-*")):
        if d.name.startswith(".") or not d.is_dir():
            continue
        meta = d / "meta.json"
        age = time.time() - (meta.stat().st_mtime if meta.exists() else d.stat().st_mtime)
        if d.name not in keep and age > older_than_hours * 3600:
            with locked(d.parent / f".{d.name}.lock"):
                shutil.rmtree(d)
            (d.parent / f".{d.name}.lock").unlink(missing_ok=True)
            removed.append(d)
    return removed
