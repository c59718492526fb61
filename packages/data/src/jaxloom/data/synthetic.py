"""A synthetic task whose accuracy shows that a model learned: `a+b=` → the sum's digits."""

from __future__ import annotations

import numpy as np


def addition_records(n: int, *, max_digits: int = 2, seed: int = 0) -> list[dict[str, str]]:
    """`n` records `{"prompt": "12+7=", "completion": "19"}` with operands below `10**max_digits`, drawn
    from `seed`."""
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 10**max_digits, n)
    b = rng.integers(0, 10**max_digits, n)
    return [{"prompt": f"{x}+{y}=", "completion": str(x + y)} for x, y in zip(a.tolist(), b.tolist(), strict=True)]


def exact_match(predictions: list[str], records: list[dict[str, str]]) -> float:
    """Share of `predictions` that equal their record's completion in `records` (after stripping
    whitespace)."""
    if len(predictions) != len(records):
        raise ValueError(f"{len(predictions)} predictions for {len(records)} records")
    return float(np.mean([p.strip() == r["completion"] for p, r in zip(predictions, records, strict=True)]))
