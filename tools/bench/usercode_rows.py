"""User code in RL rollouts (issue 78; `nox -s bench`, or alone): `python tools/bench/usercode_rows.py` → JSON.

1. A tool turn whose rows each call a tool that waits 0.5 s (a sandbox, an API): the turn's wall time with the rows'
   calls run concurrently (`ToolSet.run_turn`, 16 workers) against one row at a time (how turns ran before), for
   1, 8 and 32 rows.
2. Two `async def` reward functions that each wait 1 s for a judge: awaited concurrently (`concurrently`) against
   one after the other.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

WAIT = 0.5


def lookup(city: str) -> str:
    """A lookup that waits for a slow service.

    Args:
        city: A city.
    """
    time.sleep(WAIT)
    return "ok"


async def judge_a(prompts, completions, **kwargs):
    await asyncio.sleep(1.0)
    return [1.0] * len(completions)


async def judge_b(prompts, completions, **kwargs):
    await asyncio.sleep(1.0)
    return [0.5] * len(completions)


def main() -> dict:
    from tool_calling import chat_tokenizer

    from jaxloom.trainer.grpo.rewards import call_reward, concurrently
    from jaxloom.trainer.grpo.tools import ToolSet

    tools, out = ToolSet([lookup], chat_tokenizer(), timeout=60), {"tool_wait_s": WAIT, "tools": {}}
    call = [{"type": "function", "function": {"name": "lookup", "arguments": {"city": "Oslo"}}}]
    for rows in (1, 8, 32):
        started = time.perf_counter()
        tools.run_turn([(call, None)] * rows)
        together = time.perf_counter() - started
        started = time.perf_counter()
        for _ in range(rows):
            tools.run(call)
        apart = time.perf_counter() - started
        out["tools"][rows] = {"turn_s": together, "one_row_at_a_time_s": apart, "speedup": apart / together}
    funcs = [judge_a, judge_b]

    def score(f):
        return call_reward(f, ["p"], ["c"], {}, timeout=30)

    started = time.perf_counter()
    concurrently(score, funcs, [True, True])
    together = time.perf_counter() - started
    started = time.perf_counter()
    for f in funcs:
        score(f)
    apart = time.perf_counter() - started
    out["judges"] = {"concurrent_s": together, "one_after_the_other_s": apart, "speedup": apart / together}
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
