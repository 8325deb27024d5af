"""Kubernetes resource quantities: read one as a number, write one back."""

from __future__ import annotations

import re

_SUFFIX = {"m": 1e-3, "": 1.0, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
           "Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "Pi": 2.0**50,
           "Ei": 2.0**60}  # fmt: skip


def quantity_value(text: str) -> float:
    """The value of a Kubernetes quantity string ('500m' -> 0.5, '2Ki' -> 2048.0)."""
    match = re.fullmatch(r"\+?([0-9.]+)(?:[eE]([+-]?[0-9]+)|([a-zA-Z]*))", text)
    if not match or match.group(3) not in (None, *_SUFFIX):
        raise ValueError(f"not a quantity: {text!r}")
    exponent = 10.0 ** int(match.group(2)) if match.group(2) else 1.0
    return float(match.group(1)) * exponent * _SUFFIX[match.group(3) or ""]


def cpu_quantity(cores: float) -> str:
    """CPU cores as a quantity: whole cores plainly ('20'), else millicores ('2500m')."""
    milli = round(cores * 1000)
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


def memory_quantity(num_bytes: float) -> str:
    """Bytes as a quantity in the largest binary unit that divides them ('72Gi', '1536Mi')."""
    whole = round(num_bytes)
    for unit in ("Ti", "Gi", "Mi", "Ki"):
        size = int(_SUFFIX[unit])
        if whole % size == 0:
            return f"{whole // size}{unit}"
    return str(whole)
