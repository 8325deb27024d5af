"""Secret values out of what the launcher logs.

The operator refuses secrets in engine flags and literal env, so none should reach the
launcher; this is the second line: a flag whose name says it holds a secret (an API key, a
token, a password) is logged with its value hidden, in either spelling (`--flag value`,
`--flag=value`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

HIDDEN = "<redacted>"
#: A flag with one of these words as a dash- or underscore-separated part of its name
#: (`--api-key`, `--hf_token`; not `--max-num-batched-tokens` or `--ssl-keyfile`).
_SECRET_FLAG = re.compile(r"^--?([A-Za-z0-9]+[-_])*(key|token|secret|password|passwd|"
                          r"credentials?)([-_][A-Za-z0-9]+)*$", re.IGNORECASE)  # fmt: skip


def redact_argv(argv: Sequence[str]) -> list[str]:
    """The command line with the value of every secret-named flag replaced."""
    out: list[str] = []
    hide_next = False
    for item in argv:
        if hide_next:
            out.append(HIDDEN)
            hide_next = False
            continue
        flag, eq, _ = item.partition("=")
        if _SECRET_FLAG.match(flag):
            if eq:
                out.append(f"{flag}={HIDDEN}")
            else:
                out.append(item)
                hide_next = True
            continue
        out.append(item)
    return out
