import jax
import numpy as np
import pytest

import jaxloom.data as jd
from jaxloom.mesh import MeshConfig

TOK = jd.load_processor()


def test_bundled_assets_and_tokenizer():
    assert jd.bundled_corpus_path().stat().st_size > 2_000_000
    lines = jd.JsonlSource(jd.bundled_corpus_path()).read_shard(str(jd.bundled_corpus_path()))
    assert len(lines) > 500 and all("text" in r and "source" in r for r in lines)
    assert (jd.bundled_corpus_path().parent / "SOURCE.md").is_file()
    ids = TOK.encode("The interpreter prints an error message.")
    assert TOK.decode(ids) == "The interpreter prints an error message." and len(ids) < 12
    assert TOK.chat_template and len(TOK) == 4096


def test_hf_and_parquet_sources(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list([{"text": f"row {i}"} for i in range(10)])
    src = jd.HFDatasetSource(ds, num_shards=3)
    assert sum(len(src.read_shard(n)) for n in src.shard_names) == 10
    it = jd.as_source(ds.to_iterable_dataset(num_shards=2))
    assert sorted(r["text"] for n in it.shard_names for r in it.read_shard(n)) == sorted(ds["text"])
    ds.to_parquet(str(tmp_path / "d.parquet"))
    assert len(jd.as_source(str(tmp_path / "d.parquet")).read_shard(str(tmp_path / "d.parquet"))) == 10
    (tmp_path / "t.txt").write_text("one\n\ntwo\n")
    text = jd.as_source(str(tmp_path / "t.txt"))
    assert text.read_shard(str(tmp_path / "t.txt")) == [{"text": "one"}, {"text": "two"}]
    assert jd.extract_column_names(ds) == ["text"] and jd.extract_column_names(object()) is None
    # a streaming dataset whose features are unknown until read: its first record names them, none consumed
    import datasets

    def gen():
        yield from ({"prompt": f"p{i}", "completion": f"c{i}"} for i in range(3))

    streaming = datasets.IterableDataset.from_generator(gen)
    assert jd.extract_column_names(streaming) == ["prompt", "completion"]
    assert len(list(streaming)) == 3


def test_loader_for_mesh_builds_global_arrays():
    mesh = MeshConfig.from_axes(fsdp=4, tp=2).build()
    loader = jd.DataLoader.for_mesh(jd.bundled_corpus_path(), TOK, jd.DataConfig(max_sequence_length=32), mesh, 8)
    assert (loader.rank, loader.ranks, loader.config.batch_size) == (0, 1, 8)
    batch = jd.to_global(next(loader), mesh, 8)
    assert batch["input_ids"].shape == (8, 32)
    assert batch["input_ids"].sharding.spec == jax.sharding.PartitionSpec(("fsdp", "dp"))  # PartitionAxis().batch_axis
    with pytest.raises(ValueError, match="global batch size 6 is not divisible by the data-parallel size 4"):
        jd.DataLoader.for_mesh([], TOK, jd.DataConfig(), mesh, 6)


def test_easydel_helpers():
    collate = jd.create_collect_function(5, "keep_end", pad_token_id=0)
    out = collate([{"input_ids": [1, 2, 3, 4, 5, 6, 7]}, {"input_ids": [9]}])
    assert out["input_ids"].tolist() == [[3, 4, 5, 6, 7], [9, 0, 0, 0, 0]]
    assert out["attention_mask"].tolist() == [[1] * 5, [1, 0, 0, 0, 0]]
    s = jd.process_sample_data(TOK, "hello world", 16, padding_side="left")
    assert s["input_ids"].shape == (16,) and s["attention_mask"][-1] == 1 and s["attention_mask"][0] == 0
    chat = [{"role": "user", "content": "hi"}]
    right = jd.process_messages_data(TOK, chat, 24, padding_side="right")
    left = jd.process_messages_data(TOK, chat, 24, padding_side="left")
    assert right["input_ids"].shape == left["input_ids"].shape == (24,)
    n = int(right["attention_mask"].sum())
    assert 0 < n < 24 and right["attention_mask"][0] == 1 and left["attention_mask"][0] == 0
    # the same tokens, padded on the side asked for
    assert right["input_ids"][:n].tolist() == left["input_ids"][-n:].tolist()
    with pytest.raises(ValueError, match="padding_side 'middle'"):
        jd.process_messages_data(TOK, chat, 24, padding_side="middle")


def test_synthetic_task():
    recs = jd.addition_records(50, seed=1)
    assert all(int(r["completion"]) == sum(map(int, r["prompt"][:-1].split("+"))) for r in recs)
    assert jd.exact_match([r["completion"] for r in recs], recs) == 1.0
    assert jd.exact_match(["0"] * 50, recs) < 0.1
    assert np.all(np.array([len(r["prompt"]) for r in recs]) <= 6)


def test_mesh_loader_is_one_stream_per_data_parallel_shard():
    mesh = MeshConfig.from_axes(fsdp=4, tp=2).build()  # 4 data-parallel shards
    cfg = jd.DataConfig(max_sequence_length=32, prefetch=0)
    loader = jd.MeshLoader(jd.bundled_corpus_path(), TOK, cfg, mesh, 8, accumulation=2)
    streams = [
        jd.DataLoader(
            jd.bundled_corpus_path(),
            TOK,
            jd.DataConfig(max_sequence_length=32, prefetch=0, batch_size=4),
            data_rank=d,
            data_ranks=4,
        )
        for d in range(4)
    ]
    for _ in range(2):
        batch = next(loader)["input_ids"].reshape(2, 8, 32)  # [micro-batch, global rows, length]
        parts = [next(s)["input_ids"].reshape(2, 2, 32) for s in streams]
        for micro in range(2):  # shard d's rows of each micro-batch come from stream d, in order
            np.testing.assert_array_equal(batch[micro], np.concatenate([p[micro] for p in parts]))


def test_mesh_loader_state_resumes_exactly_and_checks_its_form(caplog):
    mesh = MeshConfig.from_axes(fsdp=4, tp=2).build()
    cfg = jd.DataConfig(max_sequence_length=32, prefetch=0)
    first = jd.MeshLoader(jd.bundled_corpus_path(), TOK, cfg, mesh, 8)
    for _ in range(3):
        next(first)
    state = first.global_state_dict()
    assert state["data_parallel"] == 4 and len(state["streams"]) == 4
    assert all(s != jd.pipeline.START for s in state["streams"])
    again = jd.MeshLoader(jd.bundled_corpus_path(), TOK, cfg, mesh, 8, state=state)
    np.testing.assert_array_equal(next(again)["input_ids"], next(first)["input_ids"])
    with pytest.raises(ValueError, match="expected {'data_parallel': D"):
        jd.MeshLoader(jd.bundled_corpus_path(), TOK, cfg, mesh, 8, state={"streams": []})
    two = MeshConfig.from_axes(fsdp=2, tp=4).build()
    with caplog.at_level("WARNING"):
        restarted = jd.MeshLoader(jd.bundled_corpus_path(), TOK, cfg, two, 8, state=state)
    assert "saved for 4 data-parallel shards and the mesh now has 2" in caplog.text
    assert all(s == jd.pipeline.START for s in restarted.global_state_dict()["streams"])
