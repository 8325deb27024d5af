"""Root filesystems for the test images: a Debian minbase made by debootstrap, and layers made
by running a script in a chroot over an overlay mount of the layers below.

The overlay's upper directory collects exactly what the script wrote, so it *is* the layer:
no copy of the whole tree and no diff. Each run happens in a mount namespace of its own
(`unshare --mount`), so its mounts (the overlay, /proc, /dev, /sys, a tmpfs on /tmp, the host's
resolver and CA bundle, and the read-only inputs under /tmp/in/<name>) vanish with it, even
when it is killed. Needs root, util-linux, debootstrap and zstd (rows of hostreqs.py, installed
from Debian's packages when missing).

A layer must only add or change files: deleting one from a lower layer would need a whiteout,
and `check_no_whiteouts` refuses the layer with the paths that did it (pin the lower layer's
packages so the upper one never replaces them).

Standard library only (hostreqs is too).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import hostreqs

# Left out of the base layer: caches, docs and translations nothing in the images reads.
TRIM = (
    "var/cache/apt/archives",
    "var/cache/apt/pkgcache.bin",
    "var/cache/apt/srcpkgcache.bin",
    "var/lib/apt/lists",
    "var/cache/debconf/templates.dat-old",
    "var/log",
    "usr/share/doc",
    "usr/share/man",
    "usr/share/info",
    "usr/share/locale",
)
# PATH inside the chroot while a layer builds (Debian's default).
BUILD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class BuildError(RuntimeError):
    """A build step failed; the message names the step and where its log is."""


def debian_mirror(apt_dir: Path = Path("/etc/apt"), suite: str = "bookworm") -> str:
    """The Debian archive URI apt on this machine uses for `suite` (main), from its sources."""
    candidates: list[str] = []
    files = [apt_dir / "sources.list", *sorted((apt_dir / "sources.list.d").glob("*"))]
    for path in files:
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if path.suffix == ".sources":
            for stanza in re.split(r"\n\s*\n", text):
                fields = _deb822(stanza)
                if suite in fields.get("Suites", "").split() and "main" in fields.get(
                    "Components", ""
                ).split():
                    candidates += fields.get("URIs", "").split()
        else:
            for line in text.splitlines():
                words = line.split("#", 1)[0].split()
                if (len(words) >= 4 and words[0] == "deb" and not words[1].startswith("[")
                        and words[2] == suite and "main" in words[3:]):  # fmt: skip
                    candidates.append(words[1])
    for uri in candidates:
        if uri.rstrip("/").endswith("/debian"):
            return uri.rstrip("/")
    raise BuildError(
        f"no Debian archive for {suite!r} (main) in {apt_dir}/sources.list*: "
        "configure apt with Debian's packages first"
    )


def _deb822(stanza: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    key = None
    for line in stanza.splitlines():
        if line.startswith("#"):
            continue
        if line[:1].isspace() and key:
            fields[key] += " " + line.strip()
        elif ":" in line:
            key, value = line.split(":", 1)
            fields[key.strip()] = value.strip()
    return fields


def ensure_tool(command: str) -> str:
    """The path of `command`, a row of the one list (hostreqs.py); as root its Debian package
    is installed first when it is missing."""
    try:
        return hostreqs.command_path(command)
    except hostreqs.MissingHostCommand as e:
        raise BuildError(str(e)) from e


def debootstrap(dest: Path, suite: str, mirror: str, packages: Sequence[str], log: Path) -> None:
    """A trimmed Debian minbase of `suite` with `packages` in `dest` (which must not exist)."""
    tool = ensure_tool("debootstrap")
    cmd = [tool, "--variant=minbase", f"--include={','.join(packages)}", suite, str(dest), mirror]
    _run_logged(cmd, log, f"debootstrap {suite}")
    for rel in TRIM:
        path = dest / rel
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
            path.mkdir()
        elif path.exists():
            path.unlink()
    # The runtime supplies these; what debootstrap copied from the host does not belong here.
    (dest / "etc/resolv.conf").write_text("")
    (dest / "etc/hostname").write_text("localhost\n")
    for mount_point in ("proc", "sys", "dev", "tmp", "run"):
        (dest / mount_point).mkdir(exist_ok=True)


def _run_logged(cmd: Sequence[str], log: Path, what: str) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        out.write(f"$ {shlex.join(cmd)}\n".encode())
        out.flush()
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-25:]
        raise BuildError(f"{what} failed (exit {proc.returncode}); log {log}:\n" + "\n".join(tail))


_WRAPPER = r"""
set -euo pipefail
root=$1 lower=$2 upper=$3 work=$4 script=$5 user=$6 ro=$7 netns=$8
shift 8
if [ "$netns" = 1 ]; then ip link set lo up; fi
if [ -n "$upper" ]; then
  mount -t overlay overlay -o "lowerdir=$lower,upperdir=$upper,workdir=$work" "$root"
else
  mount --bind "$lower" "$root"
  if [ "$ro" = 1 ]; then mount -o remount,bind,ro "$root"; fi
fi
mount -t proc proc "$root/proc"
mount --rbind /dev "$root/dev"
mount --rbind /sys "$root/sys"
mount -t tmpfs -o mode=1777 tmpfs "$root/tmp"
mount --bind /etc/resolv.conf "$root/etc/resolv.conf"
ca=/etc/ssl/certs/ca-certificates.crt
if [ -e "$root$ca" ] && [ -e "$ca" ]; then
  mount --bind "$ca" "$root$ca"
fi
mkdir -p "$root/tmp/in" "$root/tmp/home"
chmod 0777 "$root/tmp/home"
while [ $# -gt 0 ]; do
  mkdir -p "$root/tmp/in/$1"; mount --bind "$2" "$root/tmp/in/$1"; shift 2
done
cp "$script" "$root/tmp/step.sh"
chmod 0755 "$root/tmp/step.sh"
spec=()
if [ -n "$user" ]; then spec=(--userspec="$user"); fi
exec chroot "${spec[@]}" "$root" /usr/bin/env -i /bin/bash -euo pipefail /tmp/step.sh
"""


def run_in_root(
    lowers: Sequence[Path],
    script: str,
    *,
    upper: Path | None,
    log: Path,
    what: str,
    inputs: Mapping[str, Path] | None = None,
    env: Mapping[str, str] | None = None,
    user: str | None = None,
    read_only: bool = False,
    own_network: bool = False,
) -> None:
    """Run `script` (bash) chrooted into the stack `lowers` (top first).

    With `upper`, everything the script writes lands there (an overlay); without it the single
    lower is used as it is (`read_only` binds it read-only, as a container runtime would with
    readOnlyRootFilesystem). `own_network` runs it in new network and PID namespaces: only
    loopback, so its ports never meet anyone else's, and every process it started ends with
    it. `inputs` are host paths bound under
    /tmp/in/<name>. The host's CA bundle and resolver are bound over the image's for the run
    only, so pip works here and the layer keeps Debian's own files.
    """
    if upper is None and len(lowers) != 1:
        raise ValueError("without an upper layer, run in exactly one directory")
    with tempfile.TemporaryDirectory(prefix="vllmdp-img-") as tmp:
        root = Path(tmp) / "root"
        root.mkdir()
        work = Path(tmp) / "work"
        if upper is not None:
            upper.mkdir(parents=True, exist_ok=True)
            # overlayfs wants its workdir on the upper's filesystem.
            work = upper.parent / f".work-{upper.name}"
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir()
        step = Path(tmp) / "step.sh"
        full_env = {"PATH": BUILD_PATH, "HOME": "/tmp/home", "LANG": "C.UTF-8"}
        full_env.update(env or {})
        exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in full_env.items())
        step.write_text(exports + script)
        wrapper = Path(tmp) / "wrapper.sh"
        wrapper.write_text(_WRAPPER)
        lower_arg = ":".join(str(p) for p in lowers)
        args = [
            "unshare", "--mount", "--propagation", "private",
            *(["--net", "--pid", "--fork"] if own_network else []),
            "--", "bash", str(wrapper), str(root), lower_arg, str(upper or ""), str(work),
            str(step), user or "", "1" if read_only else "0", "1" if own_network else "0",
        ]  # fmt: skip
        for name, host in (inputs or {}).items():
            args += [name, str(host)]
        try:
            _run_logged(args, log, what)
        finally:
            if upper is not None:
                shutil.rmtree(work, ignore_errors=True)
    if upper is not None:
        check_no_whiteouts(upper, what)


def whiteouts(upper: Path) -> list[str]:
    """Paths an overlay upper dir deletes or hides from the layers below (whiteouts, opaque)."""
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(upper):
        for name in (*dirnames, *filenames):
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            rel = os.path.relpath(path, upper)
            if (st.st_mode & 0o170000) == 0o020000 and st.st_rdev == 0:
                found.append(f"deleted /{rel}")
            elif os.path.isdir(path) and not os.path.islink(path):
                try:
                    if os.getxattr(path, "trusted.overlay.opaque", follow_symlinks=False) == b"y":
                        found.append(f"replaced /{rel}/")
                except OSError:
                    pass
    return found


def check_no_whiteouts(upper: Path, what: str) -> None:
    """Refuse a layer that deletes or replaces files of the layers below it."""
    found = whiteouts(upper)
    if found:
        shown = "\n  ".join(found[:20])
        raise BuildError(
            f"{what} changed files of a lower layer ({len(found)}):\n  {shown}\n"
            "A layer may only add files: pin the lower layer so this one need not replace them."
        )


def dir_size(path: Path) -> int:
    """Bytes of the regular files under `path` (hard links counted once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            st = os.lstat(os.path.join(dirpath, name))
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            total += st.st_size
    return total
