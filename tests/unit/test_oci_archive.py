"""The image archive writer (tests/testbed/oci.py): layers, digests and the manifest."""

from __future__ import annotations

import hashlib
import sys
import tarfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testbed"))
import oci


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_layer_digest_is_the_sha256_of_the_tar_and_skips_mount_contents(tmp_path: Path) -> None:
    src = _tree(tmp_path / "src", {"etc/hello": "hi\n", "proc/1/status": "x", "dev/null": ""})
    layer = oci.build_layer(src, tmp_path / "layer.tar")
    data = layer.path.read_bytes()
    assert layer.diff_id == "sha256:" + hashlib.sha256(data).hexdigest()
    assert layer.size == len(data)
    with tarfile.open(layer.path) as tar:
        names = set(tar.getnames())
    assert {"etc", "etc/hello", "proc", "dev"} <= names
    assert "proc/1/status" not in names and "dev/null" not in names
    assert oci.layer_from_tar(layer.path) == layer


def test_archive_lists_layers_in_order_with_config(tmp_path: Path) -> None:
    base = oci.build_layer(_tree(tmp_path / "a", {"bin/tool": "1"}), tmp_path / "a.tar")
    app = oci.build_layer(_tree(tmp_path / "b", {"app/main.py": "2"}), tmp_path / "b.tar")
    cfg = oci.ImageConfig(entrypoint=["python3"], cmd=["-m", "app"], env=["A=1"], user="10001")
    digest = oci.write_archive("local/app:dev", [base, app], cfg, tmp_path / "img.tar")
    entry = oci.read_manifest(tmp_path / "img.tar")
    assert entry["RepoTags"] == ["local/app:dev"]
    assert entry["Config"] == digest.split(":", 1)[1] + ".json"
    config = entry["config"]
    assert config["rootfs"]["diff_ids"] == [base.diff_id, app.diff_id]
    assert config["config"]["Entrypoint"] == ["python3"]
    assert config["config"]["Cmd"] == ["-m", "app"]
    assert config["config"]["User"] == "10001"
    assert config["config"]["Env"][0].startswith("PATH=") and "A=1" in config["config"]["Env"]
    with tarfile.open(tmp_path / "img.tar") as tar:
        for name in entry["Layers"]:
            member = tar.extractfile(name)
            assert member is not None
            assert "sha256:" + hashlib.sha256(member.read()).hexdigest() in (
                base.diff_id, app.diff_id)


def test_an_image_needs_a_layer(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one layer"):
        oci.write_archive("x:y", [], oci.ImageConfig(), tmp_path / "x.tar")
