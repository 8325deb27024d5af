"""Loads the kind node image's docker-archive into the kind tier's dockerd (kinddocker.py);
starts nothing. Docker 20.10 reads no zstd layers, and the image tool writes them: the
archive is loaded from a plain copy (the same diff IDs, so the same image ID), made for the
load and removed after it."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

import hostreqs
import kinddocker
import oci
from common import BuildError, log


def load(archive: Path, ref: str, p: kinddocker.Paths | None = None) -> None:
    """`docker load` a docker-archive unless the daemon has that very image (by ID)."""
    p = p or kinddocker.paths()
    want = "sha256:" + str(oci.read_manifest(archive)["Config"]).removesuffix(".json")
    have = kinddocker.docker("image", "inspect", "--format={{.Id}}", ref, check=False,
                             p=p).stdout.strip()  # fmt: skip
    if have == want:
        return
    t0 = time.monotonic()
    plain = p.root / "load" / archive.name
    plain.parent.mkdir(parents=True, exist_ok=True)
    try:
        plain_archive(archive, plain)
        kinddocker.docker("load", f"--input={plain}", p=p, timeout=1800)
    finally:
        shutil.rmtree(plain.parent, ignore_errors=True)
    log(f"kind: loaded {ref} into dockerd in {time.monotonic() - t0:.1f}s")


def plain_archive(archive: Path, out: Path) -> None:
    """A copy of a docker-archive with its zstd layers decompressed (`zstd -d`)."""
    zstd = hostreqs.command_path("zstd")
    work = out.parent / "layers"
    work.mkdir(exist_ok=True)
    with tarfile.open(archive) as src, tarfile.open(out, "w") as dst:
        for member in src.getmembers():
            data = src.extractfile(member)
            if data is None:
                continue
            if member.name == "manifest.json":
                manifest = json.load(data)
                for entry in manifest:
                    entry["Layers"] = [n.removesuffix(".zst") for n in entry["Layers"]]
                body = json.dumps(manifest).encode()
                info = tarfile.TarInfo("manifest.json")
                info.size = len(body)
                dst.addfile(info, io.BytesIO(body))
            elif member.name.endswith(".zst"):
                layer = work / "layer.tar"
                with layer.open("wb") as fh:
                    unzstd = subprocess.Popen([zstd, "-d", "-q", "-c"], stdin=subprocess.PIPE,
                                              stdout=fh)  # fmt: skip
                    assert unzstd.stdin is not None
                    shutil.copyfileobj(data, unzstd.stdin, 1 << 20)
                    unzstd.stdin.close()
                    if unzstd.wait() != 0:
                        raise BuildError(f"zstd -d failed on {member.name} of {archive}")
                dst.add(layer, arcname=member.name.removesuffix(".zst"))
                layer.unlink()
            else:
                dst.addfile(member, data)
