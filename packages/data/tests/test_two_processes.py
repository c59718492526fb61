"""Two real JAX processes read a streamed JSONL and a token store through one 4-way data-parallel mesh:
each opens only its own streams' shards, and a position gathered from both continues exactly in two
fresh processes (nothing replayed)."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import jaxloom.data as jd

WORKER = Path(__file__).with_name("two_proc_loader.py")


def _two(root: Path, data: str, steps: int, state: Path | None, tag: str) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    outs = [root / f"{tag}-{rank}.json" for rank in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(port), str(rank), data, str(steps), str(state or "-"), str(outs[rank])],
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    for p in procs:
        try:
            _, err = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a process hung")
        assert p.returncode == 0, err[-3000:]
    return [json.loads(o.read_text()) for o in outs]


@pytest.mark.parametrize("kind", ["stream", "store"])
def test_two_processes_resume_a_stream_exactly(tmp_path, kind):
    files = []
    for f in range(4):  # one file per data-parallel stream: each process opens only its two
        path = tmp_path / f"part{f}.jsonl"
        path.write_text("".join(json.dumps({"text": f"part {f} doc {i} " + "w " * (i % 9)}) + "\n" for i in range(60)))
        files.append(str(path))
    if kind == "store":
        jd.prepare(files, tmp_path / "store", unit_bytes=1 << 30, progress=False)
        data = str(tmp_path / "store")
    else:
        data = str(tmp_path / "part*.jsonl")
    full = _two(tmp_path, data, 12, None, "full")
    first = _two(tmp_path, data, 5, None, "first")
    assert first[0]["position"] == first[1]["position"]  # gathered: every stream's position on both
    assert all(s["block_cursor"] > 0 or s["block_record"] > 0 for s in first[0]["position"]["streams"])
    (tmp_path / "state.json").write_text(json.dumps(first[0]["position"]))
    resumed = _two(tmp_path, data, 7, tmp_path / "state.json", "resumed")
    for rank in range(2):
        assert resumed[rank]["batches"] == full[rank]["batches"][5:]
        assert first[rank]["batches"] == full[rank]["batches"][:5]
    assert resumed[0]["position"] == full[0]["position"]
    # each process's first stream reads one shard of its own: nothing is read by both
    assert full[0]["opened"] != full[1]["opened"] and len(full[0]["opened"]) == 1
