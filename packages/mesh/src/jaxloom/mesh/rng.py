"""A deterministic stream of PRNG keys whose position can be saved and restored (RedCo's `gen_rng`)."""

from __future__ import annotations

from typing import Any


class RngStream:
    """Key `i` of the stream is `fold_in(PRNGKey(seed), i)`: the same on every process, independent of
    how many keys were drawn before a restart. `state_dict()` is two integers, JSON-ready.

    >>> rngs = RngStream(42)
    >>> k = rngs.gen_rng()           # a fresh key; the stream advances
    >>> saved = rngs.state_dict()    # {'seed': 42, 'count': 1}
    """

    def __init__(self, seed: int, count: int = 0):
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(f"RngStream seed must be an int, got {seed!r}")
        if count < 0:
            raise ValueError(f"RngStream count must be >= 0, got {count}")
        self.seed = seed
        self.count = count

    def gen_rng(self):
        """The next key (a `uint32[2]` array); advances the stream by one."""
        import jax

        key = jax.random.fold_in(jax.random.PRNGKey(self.seed), self.count)
        self.count += 1
        return key

    def gen_model_step_rng(self):
        """The key for one jitted (SPMD) model step. It must be identical on all processes, so it is
        simply the next key of the stream; randomness per example comes from folding in positions
        inside the step."""
        return self.gen_rng()

    def state_dict(self) -> dict[str, int]:
        """The stream's seed and position as JSON data, for checkpoints."""
        return {"seed": self.seed, "count": self.count}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> RngStream:
        """Inverse of `state_dict`: `state` is `{'seed': int, 'count': int}`."""
        unknown = sorted(set(state) - {"seed", "count"})
        if unknown or "seed" not in state:
            raise ValueError(f"RngStream state {state!r}; expected keys 'seed' and 'count'")
        return cls(int(state["seed"]), int(state.get("count", 0)))

    def __repr__(self) -> str:
        return f"RngStream(seed={self.seed}, count={self.count})"
