"""Streaming sources, block shuffling and token stores: memory flat in the dataset, resume by seeking."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import jaxloom.data as jd

TOK = jd.load_processor()


def docs(n):
    return [{"text": f"document {i} " + "word " * (i % 13 + 1)} for i in range(n)]


def take(loader, k):
    return [next(loader) for _ in range(k)]


def same(a, b):
    return all(np.array_equal(x[k], y[k]) for x, y in zip(a, b, strict=True) for k in x)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def kinds(tmp_path):
    """Every kind of source over the same 90 records, in 2 shards (files) where the kind has files."""
    import datasets

    records = docs(90)
    halves = [records[:45], records[45:]]
    jsonl = [write_jsonl(tmp_path / f"p{i}.jsonl", h) for i, h in enumerate(halves)]
    text = []
    for i, h in enumerate(halves):
        text.append(tmp_path / f"p{i}.txt")
        text[-1].write_text("".join(r["text"] + "\n\n" for r in h))
    parquet = []
    for i, h in enumerate(halves):
        parquet.append(str(tmp_path / f"p{i}.parquet"))
        datasets.Dataset.from_list(h).to_parquet(parquet[-1], batch_size=10)  # several row groups
    ds = datasets.Dataset.from_list(records)
    return {
        "jsonl": jsonl,
        "text": text,
        "parquet": parquet,
        "hf": jd.HFDatasetSource(ds, num_shards=2),
        "hf_iterable": ds.to_iterable_dataset(num_shards=2),
        "generator": (lambda: iter(records)),
        "store": jd.prepare(jsonl, tmp_path / "store", progress=False) and tmp_path / "store",
    }


@pytest.mark.parametrize("kind", ["jsonl", "text", "parquet", "hf", "hf_iterable", "generator", "store"])
def test_every_source_resumes_exactly_across_blocks_shards_and_epochs(tmp_path, kind, caplog):
    data = kinds(tmp_path)[kind]
    cfg = jd.DataConfig(max_sequence_length=24, batch_size=3, shuffle_buffer_size=7, seed=5, prefetch=0)
    full = take(jd.DataLoader(data, TOK, cfg), 40)  # 90 records ≈ 28 batches: into the second epoch
    first = jd.DataLoader(data, TOK, cfg)
    take(first, 17)
    state = json.loads(json.dumps(first.state_dict()))
    assert state["block_record"] > 0 or state["shard_pos"] > 0  # deep inside the data, not in its first block
    with caplog.at_level("WARNING"):
        resumed = jd.DataLoader(data, TOK, cfg, state=state)
        assert same(take(resumed, 23), full[17:])
    seeks = kind not in ("hf_iterable", "generator")
    assert ("cannot seek" in caplog.text) == (not seeks and state["block_cursor"] > 0), caplog.text


def test_a_stream_is_read_one_block_at_a_time():
    """However long the stream, the loader holds one block of records: memory flat in the dataset's size."""
    pulled = []

    def endless():
        i = 0
        while True:
            pulled.append(i)
            yield {"text": f"record {i} " + "x " * (i % 5)}
            i += 1

    cfg = jd.DataConfig(max_sequence_length=16, batch_size=2, shuffle_buffer_size=32, prefetch=0)
    loader = jd.DataLoader(endless, TOK, cfg)
    take(loader, 3)
    assert len(pulled) <= 33  # one block (and the record that shows the block is full)
    take(loader, 40)
    assert 32 < len(pulled) <= 32 * (loader.state_dict()["block_record"] // 32 + 1) + 1


def test_jsonl_resume_reads_nothing_before_the_saved_block(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", docs(200))
    cfg = jd.DataConfig(max_sequence_length=16, batch_size=2, shuffle_buffer_size=16, prefetch=0)
    first = jd.DataLoader(path, TOK, cfg)
    take(first, 30)
    state = first.state_dict()
    assert state["block_cursor"] > 0
    opened = []

    class Counting(jd.JsonlSource):
        def open_shard(self, name, cursor=0):
            opened.append(cursor)
            return super().open_shard(name, cursor)

    resumed = jd.DataLoader(Counting(path), TOK, cfg, state=state)
    np.testing.assert_array_equal(next(resumed)["input_ids"], next(first)["input_ids"])
    assert opened == [state["block_cursor"]]  # a seek to the block's first byte, no replay
    # a file whose bytes moved: the cursor no longer starts a line
    path.write_text("x" + path.read_text())
    with pytest.raises(ValueError, match=r"byte \d+ of .*d.jsonl does not start a line"):
        next(jd.DataLoader(path, TOK, cfg, state=state))


def test_old_positions_are_refused_with_the_reason():
    old = {"epoch": 0, "shard_pos": 0, "row_pos": 3, "token_offset": 0}
    with pytest.raises(ValueError, match="saved by jaxloom-data < 0.6"):
        jd.DataLoader(docs(5), TOK, jd.DataConfig(), state=old)


@pytest.mark.parametrize("buffer", [1, 4, 1000])
def test_ranks_split_each_block_disjointly_and_cover_the_epoch(tmp_path, buffer):
    records = docs(31)
    path = write_jsonl(tmp_path / "one.jsonl", records)  # one shard, two ranks: every other record
    cfg = jd.DataConfig(
        max_sequence_length=64,
        batch_size=1,
        packing=False,
        num_epochs=1,
        prefetch=0,
        add_bos=False,
        add_eos=False,
        shuffle_buffer_size=buffer,
    )
    seen = []
    for rank in (0, 1):
        for b in jd.DataLoader(path, TOK, cfg, data_rank=rank, data_ranks=2):
            seen.append(TOK.decode(b["input_ids"][0][b["segment_ids"][0] > 0]))
    assert sorted(seen) == sorted(r["text"] for r in records)


def test_pretokenized_records_are_used_as_they_are():
    cfg = jd.DataConfig(max_sequence_length=8, batch_size=2, packing=False, shuffle=False, prefetch=0)
    records = [
        {"input_ids": [5, 6, 7], "labels": [-100, 6, 7]},
        {"input_ids": [9, 10, 11], "loss_mask": [1, 0, 1]},
    ]
    b = next(jd.DataLoader(records, TOK, cfg))
    assert b["input_ids"][0, :3].tolist() == [5, 6, 7] and b["loss_mask"][0, :3].tolist() == [0, 1, 1]
    assert b["input_ids"][1, :3].tolist() == [9, 10, 11] and b["loss_mask"][1, :3].tolist() == [1, 0, 1]
    for bad, match in [
        ({"input_ids": [1, 99999]}, r"expected ids in \[0, 4096\)"),
        ({"input_ids": [1, 2], "loss_mask": [1]}, "one per token"),
        ({"input_ids": [9, 10], "loss_mask": [1, 0]}, "no target token"),  # the first token is never predicted
    ]:
        with pytest.raises(ValueError, match=match):
            next(jd.DataLoader([bad], TOK, cfg))


def test_a_store_gives_the_batches_of_its_source(tmp_path):
    """Prepared once, read by memory map: the same batches as tokenizing the JSONL while training."""
    path = write_jsonl(tmp_path / "c.jsonl", docs(120) + [{"prompt": "p q", "completion": "r s"}] * 3)
    manifest = jd.prepare(path, tmp_path / "store", progress=False)
    assert manifest["documents"] == 123 and manifest["tokens"] > 0 and manifest["tokenizer"]["hash"]
    assert jd.is_store(tmp_path / "store") and not (tmp_path / "store.partial").exists()
    assert any(s["masked"] for s in manifest["shards"])  # the prompt/completion records keep their loss mask
    for packing in (True, False):
        cfg = jd.DataConfig(max_sequence_length=20, batch_size=4, packing=packing, shuffle_buffer_size=16, seed=2)
        assert same(take(jd.DataLoader(path, TOK, cfg), 20), take(jd.DataLoader(tmp_path / "store", TOK, cfg), 20))
    # a second prepare with the same arguments finds the finished store; other settings are an error
    assert jd.prepare(path, tmp_path / "store", progress=False) == manifest
    with pytest.raises(FileExistsError, match="made from other data or settings"):
        jd.prepare(path, tmp_path / "store", max_sequence_length=8, progress=False)


def test_prepare_splits_long_documents_into_rows(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"text": "word " * 50}])
    jd.prepare(path, tmp_path / "s", max_sequence_length=16, progress=False)
    rows = jd.TokenStore(tmp_path / "s").read_shard("shard-00000")
    whole = jd.tokenize_record({"text": "word " * 50}, TOK, jd.DataConfig())[0]
    assert [len(r["input_ids"]) for r in rows][:-1] == [16] * (len(rows) - 1)
    np.testing.assert_array_equal(np.concatenate([r["input_ids"] for r in rows]), whole)


def test_a_store_from_another_tokenizer_or_truncated_is_one_clear_error(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", docs(40))
    jd.prepare(path, tmp_path / "s", progress=False)
    other = jd.load_processor()
    other.add_tokens(["<extra-token>"])
    with pytest.raises(ValueError, match=r"was made with tokenizer .* \(hash \w+\), the run uses .* \(hash \w+\)"):
        jd.DataLoader(tmp_path / "s", other, jd.DataConfig())
    with pytest.raises(ValueError, match="was made with add_bos=True, the run has add_bos=False"):
        jd.DataLoader(tmp_path / "s", TOK, jd.DataConfig(add_bos=False))
    tokens = tmp_path / "s" / "shard-00000.tokens"
    tokens.write_bytes(tokens.read_bytes()[:-10])
    with pytest.raises(ValueError, match="shard shard-00000 is truncated or changed"):
        next(jd.DataLoader(tmp_path / "s", TOK, jd.DataConfig(prefetch=0)))


def _tree_hash(root: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(root.rglob("*")):
        if f.is_file():
            h.update(f.relative_to(root).as_posix().encode() + f.read_bytes())
    return h.hexdigest()


def test_a_killed_prepare_resumes_to_the_same_store_and_processes_do_not_change_it(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", docs(3000))  # ~100 KB: 25 units of 4 KB
    reference = tmp_path / "ref"
    jd.prepare(path, reference, unit_bytes=4096, progress=False)
    assert len(json.loads((reference / "manifest.json").read_text())["shards"]) > 10
    two = tmp_path / "two"
    jd.prepare(path, two, unit_bytes=4096, num_proc=2, progress=False)
    assert _tree_hash(two) == _tree_hash(reference)

    killed = tmp_path / "killed"
    code = (
        "import time, jaxloom.data as jd, jaxloom.data.store_prepare as s\n"
        "real = s._tokenize_unit\n"
        "def slow(args, **kw):\n    time.sleep(0.2)\n    return real(args, **kw)\n"
        "s._tokenize_unit = slow\n"
        f"jd.prepare({str(path)!r}, {str(killed)!r}, unit_bytes=4096, progress=False)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "JAX_PLATFORMS": "cpu"})
    partial = tmp_path / "killed.partial"
    deadline = time.monotonic() + 120
    while len(list(partial.glob("*.done.json"))) < 3 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not killed.exists() and 3 <= len(list(partial.glob("*.done.json"))) < 25
    jd.prepare(path, killed, unit_bytes=4096, progress=False)
    assert _tree_hash(killed) == _tree_hash(reference)


def test_a_mixture_follows_its_weights_and_resumes_exactly(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": "alpha " * (i % 7 + 3)} for i in range(300)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": "beta " * (i % 11 + 2)} for i in range(300)])
    mix = jd.Mixture([{"path": a, "weight": 0.7}, {"path": b, "weight": 0.3}])
    for packing in (True, False):
        cfg = jd.DataConfig(max_sequence_length=32, batch_size=4, packing=packing, shuffle_buffer_size=16, prefetch=0)
        loader = jd.DataLoader(mix, TOK, cfg)
        batches = take(loader, 200)
        tokens = loader.state_dict()["tokens"]
        real = sum(int(np.count_nonzero(b["segment_ids"])) for b in batches)
        assert sum(tokens) == real
        assert abs(tokens[0] / real - 0.7) < 0.02, tokens
        alpha = TOK.encode(" alpha", add_special_tokens=False)[0]
        beta = TOK.encode(" beta", add_special_tokens=False)[0]
        seen = sum(int(np.isin(b["input_ids"], [alpha, beta]).sum()) for b in batches)
        assert seen and abs(sum(int((b["input_ids"] == alpha).sum()) for b in batches) / seen - 0.7) < 0.05
        again = jd.DataLoader(mix, TOK, cfg)
        take(again, 77)
        resumed = jd.DataLoader(mix, TOK, cfg, state=json.loads(json.dumps(again.state_dict())))
        assert same(take(resumed, 20), batches[77:97])


def test_a_mixture_on_a_mesh_gathers_its_position(tmp_path):
    from jaxloom.mesh import MeshConfig

    a = write_jsonl(tmp_path / "a.jsonl", docs(50))
    b = write_jsonl(tmp_path / "b.jsonl", docs(70)[20:])
    mix = jd.Mixture([(a, 1), (b, 3)])
    mesh = MeshConfig.from_axes(fsdp=4, tp=2).build()
    cfg = jd.DataConfig(max_sequence_length=16, prefetch=0, shuffle_buffer_size=8)
    first = jd.MeshLoader(mix, TOK, cfg, mesh, 8)
    take(first, 5)
    state = first.global_state_dict()
    assert len(state["streams"]) == 4 and all(len(s["components"]) == 2 for s in state["streams"])
    again = jd.MeshLoader(mix, TOK, cfg, mesh, 8, state=json.loads(json.dumps(state)))
    np.testing.assert_array_equal(next(again)["input_ids"], next(first)["input_ids"])


@pytest.mark.parametrize(
    "parts, match",
    [
        ([{"path": "a", "weight": -1}], r"mixture part 0 \(a\) has weight -1; expected a finite number >= 0"),
        ([("a", 0), ("b", 0)], r"mixture weights \[0, 0\] sum to 0; expected a positive sum"),
        ([{"weight": 1}], "mixture part 0 has no path"),
        ([], "at least one part"),
    ],
)
def test_bad_mixtures_are_refused_before_reading(parts, match):
    with pytest.raises(ValueError, match=match):
        jd.Mixture(parts)


def test_a_missing_mixture_part_is_named(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", docs(5))
    with pytest.raises(FileNotFoundError, match=r"dataset file .*missing.jsonl does not exist"):
        jd.DataLoader(jd.Mixture([(a, 1), (tmp_path / "missing.jsonl", 1)]), TOK, jd.DataConfig())


def test_prepare_says_how_far_it_is_without_a_terminal(tmp_path, monkeypatch, caplog):
    """`jaxloom data prepare` printed nothing until done (29 s for 30 MB, issue 42): without a terminal it logs
    bytes read of the total, rate, documents, tokens and time left as it goes, and the totals at the end."""
    import logging

    from jaxloom.data import store_prepare

    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i} " + "word " * 50}) + "\n" for i in range(3000)))
    monkeypatch.setattr(store_prepare, "PROGRESS_EVERY_S", 0.0)  # a line per batch of records
    with caplog.at_level(logging.INFO, logger="jaxloom.data"):
        manifest = jd.prepare(path, tmp_path / "store", progress=False, unit_bytes=200_000)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("prepare: ")]
    assert len(lines) > 3, lines
    size = path.stat().st_size
    assert lines[-1].startswith(f"prepare: {store_prepare._size(size)} of {store_prepare._size(size)} (100 %)")
    assert f"{manifest['documents']:,} documents" in lines[-1] and f"{manifest['tokens']:,} tokens" in lines[-1]
    assert any("ETA" in line and "(100 %)" not in line for line in lines)
