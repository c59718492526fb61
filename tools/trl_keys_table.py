"""The table of TRL 1.16's config keys and how jaxloom answers each, generated from TRL's dataclasses.

    python tools/trl_keys_table.py            # print the table (docs/migration.md holds it between its markers)
    python tools/trl_keys_table.py --write    # rewrite that part of docs/migration.md

Every key of `SFTConfig`, `DPOConfig`, `RewardConfig`, `GRPOConfig`, `RLOOConfig`, `KTOConfig` and
`DistillationConfig` (with the `transformers.TrainingArguments` keys they inherit) is jaxloom's own key, an alias,
honoured under jaxloom's name, or accepted at the values that describe what jaxloom does and refused at others
(`jaxloom.trainer.trl_keys`). `answers()` is what the test checks: no key unanswered.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

BEGIN = "<!-- trl-keys:begin (tools/trl_keys_table.py --write) -->"
END = "<!-- trl-keys:end -->"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "migration.md"


def pairs() -> list[tuple[type, type]]:
    """(TRL's config class, jaxloom's matching arguments class)."""
    import trl
    from trl import DistillationConfig

    import jaxloom.trainer as jt

    return [
        (trl.SFTConfig, jt.TrainingArguments),
        (trl.DPOConfig, jt.DPOConfig),
        (trl.RewardConfig, jt.RewardConfig),
        (trl.GRPOConfig, jt.GRPOConfig),
        (trl.RLOOConfig, jt.RLOOConfig),
        (trl.KTOConfig, jt.KTOConfig),
        (DistillationConfig, jt.DistillationConfig),
    ]


def default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def answer(key: str, ours: type) -> str:
    """How jaxloom's `ours` answers TRL's `key` (empty: not answered)."""
    from jaxloom.trainer.arguments import ALIASES, RENAMED
    from jaxloom.trainer.pair_config import PairArguments
    from jaxloom.trainer.trl_keys import TRL_KEYS

    if key in ours._owner():
        return "the same key"
    if key in ALIASES:
        return f"accepted as `{ALIASES[key]}`" + ("; -1 (no limit) as none" if key == "max_steps" else "")
    if key == "max_length" and issubclass(ours, PairArguments):
        return "accepted as `max_sequence_length`"
    if key in TRL_KEYS:
        a = TRL_KEYS[key]
        if a.to is not None:
            return f"honoured: {a.why}"
        values = ", ".join(f"`{v!r}`" for v in a.ok)
        return f"accepted at {values}; otherwise refused: {a.why}"
    if key in RENAMED:
        return f"refused: use {RENAMED[key]}"
    return ""


def at_default(key: str, value: Any, ours: type) -> str:
    """What jaxloom's class does with TRL's key at TRL's default: `accepted`, or `refused` (its message names the
    key), or the bare error text when it does neither."""
    try:
        ours(**{key: value})
    except (ValueError, TypeError) as e:
        text = str(e).splitlines()[0]
        if key in text and "unknown training argument(s): " + repr(key) != text:
            return "refused"
        return text
    return "accepted"


def answers() -> list[dict[str, Any]]:
    """One row per (key, TRL config): the key, the config, TRL's default, jaxloom's answer and what the default does."""
    rows = []
    for theirs, ours in pairs():
        for f in dataclasses.fields(theirs):
            if not f.init or f.name.startswith("_"):
                continue
            value = default(f)
            rows.append(
                {
                    "key": f.name,
                    "config": theirs.__name__,
                    "default": value,
                    "answer": answer(f.name, ours),
                    "at_default": at_default(f.name, value, ours),
                }
            )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table: one line per key and answer (the configs that share it listed together)."""
    merged: dict[tuple[str, str, str, str], list[str]] = {}
    for r in rows:
        shown = repr(r["default"])
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        key = (r["key"], shown, r["answer"], r["at_default"])
        merged.setdefault(key, []).append(r["config"].removesuffix("Config"))
    lines = [
        "| TRL key | TRL configs | TRL's default | jaxloom | at TRL's default |",
        "| --- | --- | --- | --- | --- |",
    ]
    for (key, shown, said, got), configs in sorted(merged.items()):
        shown = shown.replace("|", "\\|")
        text = said.replace("|", "\\|")
        lines.append(f"| `{key}` | {', '.join(sorted(configs))} | `{shown}` | {text} | {got} |")
    return "\n".join(lines)


def section() -> str:
    rows = answers()
    keys = {r["key"] for r in rows}
    return f"{BEGIN}\n{len(keys)} keys of TRL {__import__('trl').__version__}'s seven configs.\n\n{table(rows)}\n{END}"


def main(argv: list[str]) -> int:
    text = section()
    if "--write" in argv:
        doc = DOCS.read_text()
        start, end = doc.index(BEGIN), doc.index(END) + len(END)
        DOCS.write_text(doc[:start] + text + doc[end:])
        print(f"wrote {DOCS}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
