"""pytest imports test modules of folders without `__init__.py` by basename (rootdir
conftest, no packages), so two such files of one name break collection of the whole run."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_module_basenames_are_unique_outside_packages() -> None:
    names = Counter(p.name for p in TESTS.rglob("test_*.py")
                    if not (p.parent / "__init__.py").exists())  # fmt: skip
    assert not [n for n, k in names.items() if k > 1], names.most_common(3)
