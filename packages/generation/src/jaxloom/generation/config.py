"""`GenerationConfig`: decoding settings with `transformers.GenerationConfig` names."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxloom.core.schema import NonNegativeInt, PositiveInt, config


@config
class GenerationConfig:
    """How to decode.

    Arguments, grouped:

    - `max_new_tokens`: tokens generated after the prompt.
    - `do_sample`, `temperature`: sample (with `temperature`) instead of the argmax; temperature 0 is greedy.
    - `top_k`, `top_p`: keep only the k most likely tokens / the smallest set with probability >= p.
    - `eos_token_id`: one id or several; a sequence stops after it (None: never).
    - `pad_token_id`: written after a sequence stops.
    - `seed`: the sampling RNG's seed.
    """

    max_new_tokens: PositiveInt = 32
    do_sample: bool = False  # False: greedy
    temperature: float = 1.0  # 0 also means greedy
    top_k: PositiveInt | None = None
    top_p: float | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: NonNegativeInt = 0
    seed: NonNegativeInt = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature = {self.temperature}; expected >= 0")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p = {self.top_p}; expected a value in (0, 1] or None")

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0

    @property
    def eos_ids(self) -> tuple[int, ...]:
        e = self.eos_token_id
        return () if e is None else (e,) if isinstance(e, int) else tuple(e)

    def replace(self, **changes: Any) -> GenerationConfig:
        """A copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, hf_config: Any, **overrides: Any) -> GenerationConfig:
        """From `hf_config`, a `transformers.GenerationConfig` (or any object with those attribute names);
        `overrides` win."""
        names = [f.name for f in dataclasses.fields(cls)]
        values = {n: getattr(hf_config, n) for n in names if getattr(hf_config, n, None) is not None}
        return cls(**{**values, **overrides})
