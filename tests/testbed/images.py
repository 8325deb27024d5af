#!/usr/bin/env python3
"""Container images for the real-node test bed, built with no registry and no Docker.

    python tests/testbed/images.py build all          # or a name; prints one archive path each
    python tests/testbed/images.py list               # refs, layers, cached or not, sizes
    python tests/testbed/images.py smoke <name>|all   # run each image's checks in a chroot
    python tests/testbed/images.py lock               # re-pin tests/images/locks/*.txt
    python tests/testbed/images.py oci <name> OUT [--have FILE]   # OCI tar, less what a store has
    python tests/testbed/images.py prune              # drop cached layers no longer used

Images (refs `<name>:dev`; the archives are docker-archive tars for `ctr images import`):

- vllm-dp-operator: the operator, as the root Dockerfile builds and runs it.
- vllm-dp-engine-double: TEST image. Ray, the launcher, and the OpenAI test double as `vllm`.
- vllm-dp-engine-cpu: TEST image. Ray, vLLM's CPU build, /models/tiny, the launcher, the test
  glue.

Each is a stack of cached layers on a shared Debian minbase (imagedefs.py says what goes in,
imagebuild.py caches, imagefs.py builds in a chroot over overlayfs). `build` does only what
changed inputs need and prints the archive paths on stdout (progress goes to stderr). From
Python: `images.build(["vllm-dp-operator"])` returns {name: archive path}, and
`images.image_id(path)` the ID the archive imports as. Needs root.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import dockerfile
import hostreqs
import imagebuild
import imagedefs
import imagefs
import imagesmoke
import oci

IMAGES = tuple(imagedefs.IMAGES)
TAG = imagedefs.TAG


def ref(name: str) -> str:
    """The reference an image's archive is tagged with, e.g. `vllm-dp-operator:dev`."""
    return f"{name}:{TAG}"


def _names(arg: str) -> list[str]:
    if arg == "all":
        return list(IMAGES)
    if arg not in IMAGES:
        raise SystemExit(f"unknown image {arg!r}; one of: all, {', '.join(IMAGES)}")
    return [arg]


def build(names: list[str] | tuple[str, ...] = IMAGES, force: bool = False) -> dict[str, Path]:
    """Build (or find in the cache) each image; return {name: docker-archive path}."""
    ensure_host()
    out = {}
    for name in names:
        top, config = imagedefs.IMAGES[name]()
        out[name] = imagebuild.ensure_archive(name, ref(name), top, config, force=force)
    return out


def ensure_host() -> None:
    """debootstrap, zstd, unshare, ... (hostreqs.py `images`), before a layer is built."""
    try:
        hostreqs.ensure_uses("images")
    except hostreqs.MissingHostCommand as e:
        raise imagefs.BuildError(str(e)) from e


def oci_archive(name: str, out: Path, have: set[str] | frozenset[str] = frozenset()) -> Path:
    """Write `name`'s image to `out` as an OCI layout tar, less the blobs in `have`.

    `have` is what the target store holds already (`ctr content ls -q`, digests): a node that
    has the base, Ray and vLLM layers then imports only what changed (a few MB, well under a
    second, instead of rewriting every layer). Builds what is missing first, like `build`.
    """
    top, config = imagedefs.IMAGES[name]()
    return imagebuild.write_oci_archive(ref(name), top, config, out, frozenset(have))


def image_id(archive: Path) -> str:
    """The image ID (config digest, `sha256:...`) an archive imports as (crictl's IMAGE ID)."""
    return "sha256:" + str(oci.read_manifest(archive)["Config"]).removesuffix(".json")


def describe(name: str) -> dict[str, object]:
    """An image's ref, layers (cached or not, sizes, build times) and archive, if built."""
    top, config = imagedefs.IMAGES[name]()
    layers = []
    for definition in top.chain():
        found = imagebuild.cached(definition)
        layers.append({
            "layer": definition.name, "key": definition.key, "cached": bool(found),
            **({k: found.meta[k] for k in ("size", "build_seconds", "pack_seconds")}
               if found else {}),
        })  # fmt: skip
    archives = sorted((imagebuild.cache_root() / "archives").glob(f"{name}-*.tar"))
    return {
        "image": name, "ref": ref(name), "user": config.user, "entrypoint": config.entrypoint,
        "cmd": config.cmd, "env": list(config.env), "workdir": config.workdir,
        "layers": layers, "archives": [str(a) for a in archives],
    }  # fmt: skip


def lock() -> None:
    """Re-resolve the engine images' packages in the base image and rewrite the locks."""
    base = imagebuild.ensure_layer(imagedefs.base_layer())
    with imagebuild.locked(imagebuild.cache_root() / ".lock-run.lock"):
        scratch = imagebuild.cache_root() / "tmp" / "lock"
        out = scratch / "out"
        shutil.rmtree(scratch, ignore_errors=True)
        out.mkdir(parents=True)
        script = (
            "python3 /tmp/in/data/lock.py --launcher /tmp/in/engine/pyproject.toml "
            "--cpu-in /tmp/in/data/engine-cpu/requirements.in "
            "--omit /tmp/in/data/engine-cpu/omit.txt --out /tmp/in/out\n"
        )
        imagefs.run_in_root([base.root], script, upper=scratch / "upper", log=scratch / "lock.log",
                    what="lock", inputs={"data": imagedefs.DATA, "out": out,
                                         "engine": imagedefs.REPO / "engine_image"},
                    env=imagedefs.PIP_ENV)  # fmt: skip
        for produced in sorted(out.glob("*.txt")):
            target = imagedefs.LOCKS / produced.name
            target.write_text(produced.read_text())
            print(target)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build what changed; print the archive path of each")
    b.add_argument("image", help=f"all, or one of {', '.join(IMAGES)}")
    b.add_argument("--force", action="store_true", help="rebuild the top layer and archive")
    ls = sub.add_parser("list", help="refs, layers and what the cache holds")
    ls.add_argument("--json", action="store_true")
    s = sub.add_parser("smoke", help="unpack the archive and run the image's checks (chroot)")
    s.add_argument("image")
    sub.add_parser("lock", help="re-pin tests/images/locks/ (resolves on PyPI)")
    o = sub.add_parser("oci", help="write an OCI layout tar, less the blobs a store has")
    o.add_argument("image")
    o.add_argument("out", type=Path)
    o.add_argument("--have", type=Path, help="file of digests the store has (ctr content ls -q)")
    pr = sub.add_parser("prune", help="delete cached layers this checkout does not use")
    pr.add_argument("--hours", type=float, default=24, help="keep what was used more recently")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "build":
            t0 = time.monotonic()
            for path in build(_names(args.image), force=args.force).values():
                print(path, flush=True)
            imagebuild.log(f"done in {time.monotonic() - t0:.1f} s")
        elif args.cmd == "list":
            info = [describe(n) for n in IMAGES]
            if args.json:
                print(json.dumps(info, indent=1))
            for item in [] if args.json else info:
                print(f"{item['ref']}  user {item['user']}  archives {item['archives'] or '-'}")
                for layer in item["layers"]:  # type: ignore[attr-defined]
                    size = f"{layer['size'] / 1e6:.0f} MB" if layer["cached"] else "not built"
                    print(f"  {layer['layer']:<15} {layer['key']}  {size}")
        elif args.cmd == "smoke":
            for name, path in build(_names(args.image)).items():
                imagesmoke.smoke(name, path)
        elif args.cmd == "lock":
            lock()
        elif args.cmd == "oci":
            have = set(args.have.read_text().split()) if args.have else set()
            print(oci_archive(_names(args.image)[0], args.out, have))
        elif args.cmd == "prune":
            tops = [imagedefs.IMAGES[n]()[0] for n in IMAGES]
            keep = {imagebuild.layer_dir(d).name for top in tops for d in top.chain()}
            for path in imagebuild.prune(keep, args.hours):
                print(f"removed {path}")
    except (imagefs.BuildError, dockerfile.DockerfileError) as exc:
        print(f"images: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
