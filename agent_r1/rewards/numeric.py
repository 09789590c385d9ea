"""Numeric-answer match: the reward of math and calculator tasks.

The answer is the last number in the final text (commas as thousands separators allowed, `$` and `%`
ignored), compared with the target within a relative tolerance, as GSM8K graders do.
"""

from __future__ import annotations

import math
import re

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def last_number(text: str) -> float | None:
    """The last number written in `text`, or None when there is none."""
    for raw in reversed(_NUMBER.findall(text)):
        cleaned = raw.replace(",", "")
        try:
            return float(cleaned)
        except ValueError:
            continue
    return None


def numeric_match(answer: str, target: float | int | str, rel_tol: float = 1e-6) -> float:
    """1.0 when the last number of `answer` equals `target` (within rel_tol), else 0.0."""
    got = last_number(answer)
    want = float(str(target).replace(",", ""))
    if got is None:
        return 0.0
    return 1.0 if math.isclose(got, want, rel_tol=rel_tol, abs_tol=1e-9) else 0.0
