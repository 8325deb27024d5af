"""Golden manifests: `vllm-dp render` of every example, pinned byte for byte.

Regenerate with `pytest tests/unit/test_golden.py --update-golden` and review the diff; never
edit a golden file by hand.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_dp_operator.cli import main

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
GOLDEN = REPO / "tests" / "golden"


def _render(example: Path, capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    assert main(["render", "-f", str(example)]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    return out


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_golden(
    example: Path, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]
) -> None:
    golden = GOLDEN / example.name
    actual = _render(example, capsys)
    if request.config.getoption("--update-golden"):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(actual, encoding="utf-8")
        return
    assert golden.exists(), f"{golden.relative_to(REPO)} is missing: run pytest --update-golden"
    expected = golden.read_text(encoding="utf-8")
    assert actual == expected, (
        f"{golden.relative_to(REPO)} differs from the render: review the change, then run "
        "pytest --update-golden"
    )


def test_no_golden_without_an_example(request: pytest.FixtureRequest) -> None:
    orphans = sorted(p for p in GOLDEN.glob("*.yaml") if not (REPO / "examples" / p.name).exists())
    if request.config.getoption("--update-golden"):
        for path in orphans:
            path.unlink()
        return
    assert not orphans, f"golden files without an example: {[p.name for p in orphans]}"
