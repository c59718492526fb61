"""Preference pairs as the train step holds them: each row is one pair, `[chosen | rejected]` side by side
(`[B, 2L]`), so a pair never splits across devices. DPO, KTO's paired view and the reward model read them."""

from __future__ import annotations

from typing import Any


def pairs_as_rows(x: Any) -> Any:
    """`[B, 2L]` rows of pairs → `[2B, L]` sequences (chosen, rejected, chosen, ...); the data axis stays
    the leading one, so no data moves between devices."""
    b, w = x.shape
    return x.reshape(b * 2, w // 2)
