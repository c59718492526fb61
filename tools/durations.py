"""Keep `.ci/durations.json` (each test case's seconds in a recent `nox -s tests`), which the root conftest.py uses
to start the longest cases first.

    JAXLOOM_RECORD_DURATIONS=/tmp/d.json python3 -m nox -s tests     # records every case's seconds
    python3 tools/durations.py /tmp/d.json                             # writes .ci/durations.json from them

Only cases of at least `KEEP` seconds are kept (the others are never moved); cases that no longer exist drop out
on the next write. `python3 tools/durations.py --show` prints the slowest cases the file holds.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / ".ci" / "durations.json"
KEEP = 5.0  # seconds


def write(recorded: dict[str, float], target: Path = TARGET) -> dict[str, float]:
    """`recorded` cut to the cases of at least KEEP seconds, rounded, written sorted by name."""
    kept = {k: round(float(v), 1) for k, v in sorted(recorded.items()) if float(v) >= KEEP}
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(kept, indent=1) + "\n")
    return kept


def main(argv: list[str]) -> int:
    if argv[:1] == ["--show"]:
        known = json.loads(TARGET.read_text())
        for name, seconds in sorted(known.items(), key=lambda kv: -kv[1])[:40]:
            print(f"{seconds:8.1f}  {name}")
        return 0
    if not argv:
        print(__doc__)
        return 2
    recorded: dict[str, float] = {}
    for path in argv:
        recorded.update(json.loads(Path(path).read_text()))
    kept = write(recorded)
    print(f"{TARGET.relative_to(ROOT)}: {len(kept)} cases of at least {KEEP:g} s ({sum(kept.values()):.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
