import json
import subprocess
import sys

import numpy as np
import pytest

import jaxloom.data as jd

TOK = jd.load_processor()
CHAT = [
    {
        "messages": [
            {"role": "user", "content": f"question {i}?"},
            {"role": "assistant", "content": f"answer number {i}."},
        ]
    }
    for i in range(40)
]


def docs(n=60):
    return [{"text": f"document {i} " + "word " * (i % 17 + 1)} for i in range(n)]


def take(loader, k):
    return [next(loader) for _ in range(k)]


def same(a, b):
    return all(np.array_equal(x[k], y[k]) for x, y in zip(a, b, strict=True) for k in x)


@pytest.mark.parametrize(
    "data, packing",
    [
        ("corpus", True),
        ("docs", False),
        ("chat", True),
        ("chat", False),
    ],
)
def test_resume_gives_exactly_the_next_batches(data, packing):
    records = {"corpus": jd.bundled_corpus_path(), "docs": docs(), "chat": CHAT}[data]
    cfg = jd.DataConfig(max_sequence_length=64, batch_size=4, packing=packing, shuffle=True, seed=3)
    full = take(jd.DataLoader(records, TOK, cfg), 12)
    first = jd.DataLoader(records, TOK, cfg)
    take(first, 5)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = jd.DataLoader(records, TOK, cfg, state=state)
    assert same(take(resumed, 7), full[5:])


def test_resume_in_a_fresh_process():
    cfg = dict(max_sequence_length=32, batch_size=2, packing=True, seed=1)
    loader = jd.DataLoader(jd.bundled_corpus_path(), TOK, jd.DataConfig(**cfg))
    take(loader, 3)
    state = loader.state_dict()
    expected = [b["input_ids"].tolist() for b in take(loader, 2)]
    code = (
        "import json, sys, jaxloom.data as jd\n"
        f"l = jd.DataLoader(jd.bundled_corpus_path(), jd.load_processor(), jd.DataConfig(**{cfg!r}),"
        f" state={state!r})\n"
        "print(json.dumps([next(l)['input_ids'].tolist() for _ in range(2)]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == expected


def epoch_texts(records, ranks, rank, n_files_tmp=None):
    cfg = jd.DataConfig(
        max_sequence_length=64, batch_size=1, packing=False, num_epochs=1, prefetch=0, add_bos=False, add_eos=False
    )
    loader = jd.DataLoader(records, TOK, cfg, data_rank=rank, data_ranks=ranks)
    texts = []
    for b in loader:
        texts.append(TOK.decode(b["input_ids"][0][b["segment_ids"][0] > 0]))
    return texts


@pytest.mark.parametrize("n_files", [1, 2, 3])
def test_ranks_see_disjoint_records_covering_the_epoch(tmp_path, n_files):
    records = docs(30)
    files = []
    for f in range(n_files):
        path = tmp_path / f"part{f}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records[f::n_files]))
        files.append(path)
    a, b = epoch_texts(files, 2, 0), epoch_texts(files, 2, 1)
    assert not set(a) & set(b)
    assert sorted(a + b) == sorted(r["text"] for r in records)
    assert abs(len(a) - len(b)) <= n_files


def test_packing_keeps_every_token_once_with_right_segments():
    records = docs(25)
    cfg = jd.DataConfig(max_sequence_length=48, batch_size=3, packing=True, shuffle=False, num_epochs=1, prefetch=0)
    batches = []
    loader = jd.DataLoader(records, TOK, cfg)
    try:
        while True:
            batches.append(next(loader))
    except StopIteration:
        pass
    rows = [(b["input_ids"][i], b["segment_ids"][i], b["positions"][i]) for b in batches for i in range(3)]
    stream = np.concatenate([ids[seg > 0] for ids, seg, _ in rows])
    expected = np.concatenate([jd.tokenize_record(r, TOK, cfg)[0] for r in records])
    np.testing.assert_array_equal(stream[: len(expected)], expected)
    for _, seg, pos in rows:
        for s in set(seg[seg > 0].tolist()):
            p = pos[seg == s]
            np.testing.assert_array_equal(p, np.arange(p[0], p[0] + len(p)))  # positions count up per document
        # attention from these segment ids never crosses documents
        t = np.arange(len(seg))
        mask = (seg[:, None] == seg[None, :]) & (seg[None, :] > 0) & (t[None, :] <= t[:, None])
        assert not np.any(mask & (seg[:, None] != seg[None, :]))


def test_sft_and_chat_loss_masks():
    cfg = jd.DataConfig(add_bos=True, add_eos=True)
    ids, mask = jd.tokenize_record({"prompt": "12+7=", "completion": "19"}, TOK, cfg)
    assert TOK.decode(ids[mask == 1]) == "19</s>" and TOK.decode(ids[mask == 0]) == "<s>12+7="
    ids, mask = jd.tokenize_record(CHAT[3], TOK, cfg)
    assert TOK.decode(ids[mask == 1]).strip().startswith("answer number 3.")
    assert "question" not in TOK.decode(ids[mask == 1])


def test_unpacked_truncation_and_padding_sides():
    long = {"text": "alpha beta gamma delta " * 20}
    ids, _ = jd.tokenize_record(long, TOK, jd.DataConfig())
    for mode, side in [("keep_end", "left"), ("keep_start", "right")]:
        cfg = jd.DataConfig(
            max_sequence_length=16, batch_size=1, packing=False, truncation_mode=mode, padding_side=side, prefetch=0
        )
        b = next(jd.DataLoader([long], TOK, cfg))
        expected = ids[-16:] if mode == "keep_end" else ids[:16]
        np.testing.assert_array_equal(b["input_ids"][0], expected)
        short = next(jd.DataLoader([{"text": "hi"}], TOK, cfg))
        assert (short["segment_ids"][0][0] == 0) == (side == "left")


def test_bad_inputs(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": oops}\n{"text": "fine"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: malformed JSONL line"):
        jd.JsonlSource(bad).read_shard(str(bad))
    assert [r["text"] for r in jd.JsonlSource(bad, on_error="skip").read_shard(str(bad))] == ["ok", "fine"]
    with pytest.raises(FileNotFoundError, match="nothere.jsonl does not exist"):
        jd.JsonlSource(tmp_path / "nothere.jsonl")
    cfg = jd.DataConfig(max_sequence_length=8, batch_size=1, prefetch=0)
    with pytest.raises(ValueError, match="the dataset is empty"):
        next(jd.DataLoader([], TOK, cfg))
    with pytest.raises(ValueError, match=r"columns present: \['body', 'id'\]"):
        next(jd.DataLoader([{"id": 1, "body": "x"}], TOK, cfg))
    with pytest.raises(ValueError, match="a record of .* tokens is longer than max_sequence_length 8"):
        next(
            jd.DataLoader(
                [{"text": "many words " * 20}],
                TOK,
                jd.DataConfig(max_sequence_length=8, batch_size=1, packing=False, long_records="raise"),
            )
        )
    with pytest.raises(ValueError, match="DataConfig: padding_side = 'middle'; expected 'left' or 'right'"):
        jd.DataConfig(padding_side="middle")
    with pytest.raises(ValueError, match="data iterator state"):
        jd.DataLoader(docs(), TOK, cfg, state={"epoch": -1})
    # errors raised in the prefetch thread reach the caller
    with pytest.raises(ValueError, match="columns present"):
        next(jd.DataLoader([{"body": "x"}], TOK, jd.DataConfig(max_sequence_length=8, batch_size=1, prefetch=2)))


def test_tokenizer_without_pad_or_eos(tmp_path, caplog):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw).save_pretrained(tmp_path / "none")
    with pytest.raises(ValueError, match="has neither a pad token nor an eos token"):
        jd.load_processor(tmp_path / "none")
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="b").save_pretrained(tmp_path / "eos")
    with caplog.at_level("WARNING"):
        tok = jd.load_processor(tmp_path / "eos")
    assert tok.pad_token == "b" and "padding with its eos token" in caplog.text


def test_plain_fast_tokenizer_loads_without_the_auto_registry(tmp_path):
    import json
    import subprocess
    import sys

    from transformers import AutoTokenizer

    def registry_and_torch_imported(path=None):
        code = (
            f"import sys, jaxloom.data as jd; jd.load_processor({path!r}); "
            "print('transformers.models.auto.tokenization_auto' in sys.modules, 'torch' in sys.modules)"
        )
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()

    assert registry_and_torch_imported() == ["False", "False"]
    auto = AutoTokenizer.from_pretrained(str(jd.bundled_tokenizer_path()))
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]
    assert type(TOK) is type(auto) and len(TOK) == len(auto)
    assert TOK.apply_chat_template(msgs, tokenize=False) == auto.apply_chat_template(msgs, tokenize=False)
    assert TOK("Some words, and more.").input_ids == auto("Some words, and more.").input_ids
    # a config naming custom code goes through AutoTokenizer, which decides what to do with it
    custom = tmp_path / "custom"
    TOK.save_pretrained(custom)
    meta = json.loads((custom / "tokenizer_config.json").read_text())
    (custom / "tokenizer_config.json").write_text(json.dumps({**meta, "auto_map": {"AutoTokenizer": [None, "x.Tok"]}}))
    assert registry_and_torch_imported(str(custom))[0] == "True"


def test_bad_records_name_their_file_and_line(tmp_path):
    """A record that cannot be tokenized, reached mid-stream, names file:line; so does invalid UTF-8."""
    good = [json.dumps({"text": f"record number {i}"}) for i in range(6)]
    lines = [*good[:3], "", json.dumps({"text": 42}), *good[3:]]  # line 5: text is a number
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n")
    loader = jd.DataLoader(
        jd.JsonlSource(path), TOK, jd.DataConfig(max_sequence_length=8, batch_size=1, packing=False, shuffle=False)
    )
    with pytest.raises(ValueError, match=rf"{path}:5: column 'text' holds int, expected text"):
        for _ in range(10):
            next(loader)
    raw = tmp_path / "latin1.jsonl"
    raw.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=rf"{raw}:2: not valid UTF-8 .*expected UTF-8 text"):
        jd.JsonlSource(raw).read_shard(str(raw))


def test_first_bad_record_reads_small_local_files_in_file_order(tmp_path):
    """Issue 57: the first bad record of small local JSONL data is found before training, in file order, with the
    same message (and way past it) that the loader gives when it meets the record; larger data is left to the
    loader; pairs and non-JSONL sources are not read."""
    cfg = jd.DataConfig(max_sequence_length=8, batch_size=1, packing=False, shuffle=True, seed=3)
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"text": f"fine {i}"}) + "\n" for i in range(5)))
    b.write_text("\n".join([json.dumps({"text": "ok"}), "", json.dumps({"text": 7}), json.dumps({"body": "x"})]) + "\n")
    found = jd.first_bad_record([str(a), str(b)], cfg)
    assert found is not None and found.startswith(f"{b}:3: column 'text' holds int, expected text; fix that record")
    assert "skip_bad_records=true" in found
    assert jd.first_bad_record(jd.Mixture([(str(a), 1.0), (str(b), 1.0)]), cfg) == found
    assert jd.first_bad_record(str(a), cfg) is None
    assert jd.first_bad_record([str(a), str(b)], cfg, max_bytes=a.stat().st_size) is None  # too big: streamed
    assert jd.first_bad_record(docs(4), cfg) is None  # in-memory records: checked as they stream
    b.write_text('{"text": "ok"}\n{"text": broken\n')
    assert jd.first_bad_record(str(b), cfg).startswith(f"{b}:2: malformed JSONL line")
    loader = jd.DataLoader(str(b), TOK, dataclasses_replace(cfg, shuffle=False))
    with pytest.raises(ValueError, match=rf"{b}:2: malformed JSONL line .*skip_bad_records=true"):
        take(loader, 3)


def dataclasses_replace(cfg, **changes):
    import dataclasses

    return dataclasses.replace(cfg, **changes)


def test_a_dataset_that_shrank_since_the_position_was_saved_is_an_error(tmp_path):
    """Resuming past the end of data that shrank between runs would silently start another epoch."""
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": f"record number {i} of many"}) + "\n" for i in range(40)))
    cfg = jd.DataConfig(max_sequence_length=8, batch_size=2, packing=False, shuffle=False, prefetch=0)
    loader = jd.DataLoader(jd.JsonlSource(path), TOK, cfg)
    for _ in range(5):
        next(loader)
    state = loader.state_dict()
    assert state["row_pos"] == 10
    again = jd.DataLoader(jd.JsonlSource(path), TOK, cfg, state=state)  # the same data: continues
    assert next(again)["input_ids"].shape == (2, 8)
    path.write_text("".join(json.dumps({"text": f"record number {i}"}) + "\n" for i in range(6)))
    shrunk = jd.DataLoader(jd.JsonlSource(path), TOK, cfg, state=state)
    with pytest.raises(
        ValueError,
        match=r"the dataset changed since this data position was saved: shard .*d.jsonl "
        r"has 6 record\(s\) for data rank 0 from cursor 0, the position is after record 10",
    ):
        next(shrunk)


def test_match_bos_makes_the_tokenizer_and_its_saved_copy_encode_as_training_does(tmp_path):
    """Training puts BOS before each document (DataConfig.add_bos); the bundled tokenizer's own encoding
    does not. `match_bos` returns a copy that does, and a saved copy keeps it when transformers loads it."""
    from transformers import AutoTokenizer

    text = "Some words, and more."
    plain = TOK(text, add_special_tokens=False).input_ids
    assert not jd.adds_bos(TOK) and TOK(text).input_ids == plain
    matched = jd.match_bos(TOK, add_bos=True)
    assert matched is not TOK and not jd.adds_bos(TOK)  # the caller's tokenizer is left as it was
    assert matched(text).input_ids == [TOK.bos_token_id, *plain]
    assert jd.match_bos(matched, add_bos=True) is matched  # already so: nothing to do
    matched.save_pretrained(tmp_path / "tok")
    assert AutoTokenizer.from_pretrained(str(tmp_path / "tok"))(text).input_ids == [TOK.bos_token_id, *plain]
    assert jd.load_processor(tmp_path / "tok")(text).input_ids == [TOK.bos_token_id, *plain]
    # the other way round: a tokenizer that adds BOS, for a run that trains without it
    assert jd.match_bos(matched, add_bos=False)(text).input_ids == plain
    # the training pipeline itself never relies on the tokenizer's policy: same ids either way
    config = jd.DataConfig(max_sequence_length=32, batch_size=1, prefetch=0)
    rows = [{"text": text}]
    first = next(jd.DataLoader(rows, TOK, config))["input_ids"]
    np.testing.assert_array_equal(first, next(jd.DataLoader(rows, matched, config))["input_ids"])
    assert first[0, 0] == TOK.bos_token_id


def test_a_hub_id_that_cannot_be_reached_fails_at_once(monkeypatch):
    """A tokenizer named by a Hub id, not cached, with the Hub unreachable: one error at once saying that
    nothing is downloaded (huggingface_hub alone retries for about a minute)."""
    import socket
    import time

    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    for k in ("HF_HUB_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(k, raising=False)
    start = time.monotonic()
    with pytest.raises(FileNotFoundError, match=r"cannot be reached.*nothing is downloaded"):
        jd.load_processor("jaxloom-test-org/no-such-tokenizer")
    assert time.monotonic() - start < 30
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE is set: nothing is downloaded"):
        jd.load_processor("jaxloom-test-org/no-such-tokenizer")
