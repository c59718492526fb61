"""Token stores and sources as an adversarial user meets them (issue 43): every store is checked when read
(offsets an index of its tokens, ids below the vocabulary, a manifest as `prepare` writes it), a prepare is tied
to its sources (an edited file is refused, never silently kept) and has one writer; and over generated damage
(hypothesis) a reader either raises one clear error naming the store or file, or reads exactly the data."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import jaxloom.data as jd

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

TOK = jd.load_processor()
CONFIG = jd.DataConfig(max_sequence_length=16, batch_size=2, packing=False, shuffle_buffer_size=1, prefetch=0)


def store(tmp_path, n=40, name="store"):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i} " + "word " * (i % 7)}) + "\n" for i in range(n)))
    jd.prepare(path, tmp_path / name, progress=False)
    return tmp_path / name


def read_all(path):
    source = jd.TokenStore(path)
    source.check(TOK, jd.DataConfig())
    return [np.asarray(r["input_ids"]).tolist() for name in source.shard_names for r, _ in source.open_shard(name)]


def test_offsets_out_of_order_or_past_the_end_are_refused(tmp_path):
    good = store(tmp_path)
    offsets = np.load(good / "shard-00000.offsets.npy")
    for damage in ("swap", "past_end"):
        bad = tmp_path / damage
        shutil.copytree(good, bad)
        o = offsets.copy()
        if damage == "swap":
            o[3], o[4] = o[4], o[3]
        else:
            o[-1] += 5
        np.save(bad / "shard-00000.offsets.npy", o)
        with pytest.raises(ValueError, match=rf"token store {bad}: shard shard-00000's offsets are not a valid index"):
            read_all(bad)


def test_ids_past_the_vocabulary_are_refused_naming_the_document(tmp_path):
    bad = store(tmp_path)
    tokens = np.fromfile(bad / "shard-00000.tokens", dtype=np.uint16)
    tokens[7] = len(TOK) + 3
    tokens.tofile(bad / "shard-00000.tokens")
    with pytest.raises(ValueError, match=rf"token store {bad} shard shard-00000 document \d+: token id {len(TOK) + 3}"):
        read_all(bad)


def test_a_malformed_manifest_is_one_clear_error(tmp_path):
    bad = store(tmp_path)
    manifest = json.loads((bad / "manifest.json").read_text())
    del manifest["shards"][0]["documents"]
    (bad / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="a malformed token store manifest .*prepare the store again"):
        jd.TokenStore(bad)


def test_an_edited_source_is_not_silently_kept(tmp_path):
    """Resumed after its source was edited, a prepare refused to mix old and new tokens; a finished store of an
    edited source is not returned as if it were of the new one."""
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(50)))
    jd.prepare(path, tmp_path / "done", progress=False)
    (tmp_path / "half.partial").mkdir()
    header = jd.prepare.__globals__["_file_identities"]([str(path)])
    (tmp_path / "half.partial" / "plan.json").write_text(json.dumps({"source_files": header}))
    with open(path, "a") as f:
        f.write(json.dumps({"text": "an edit"}) + "\n")
    os.utime(path, ns=(1, 1))  # and another time
    with pytest.raises(FileExistsError, match="made from other data or settings"):
        jd.prepare(path, tmp_path / "done", progress=False)
    with pytest.raises(FileExistsError, match=rf"holds an unfinished store of {path}, which has changed since"):
        jd.prepare(path, tmp_path / "half", progress=False)


def test_one_writer_at_a_time(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(50)))
    work = tmp_path / "s.partial"
    work.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (work / "prepare.lock").write_text(str(sleeper.pid))  # a live writer
        with pytest.raises(
            FileExistsError, match=rf"is being written by another `jaxloom data prepare` \(pid {sleeper.pid}\)"
        ):
            jd.prepare(path, tmp_path / "s", progress=False)
    finally:
        sleeper.kill()
        sleeper.wait()
    jd.prepare(path, tmp_path / "s", progress=False)  # its writer is gone: taken over
    assert jd.is_store(tmp_path / "s") and not (tmp_path / "s" / "prepare.lock").exists()


@settings(  # the same examples on every CI run; JAXLOOM_HYPOTHESIS_EXAMPLES=400 to search wider (400 pass)
    max_examples=int(os.environ.get("JAXLOOM_HYPOTHESIS_EXAMPLES", "40")),
    deadline=None,
    derandomize="JAXLOOM_HYPOTHESIS_EXAMPLES" not in os.environ,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    data=st.data(),
    target=st.sampled_from(["offsets", "tokens", "manifest"]),
)
def test_damaged_stores_give_a_clear_error_or_the_exact_data(tmp_path_factory, data, target):
    root = tmp_path_factory.mktemp("h")
    good = store(root)
    expected = read_all(good)
    bad = root / "bad"
    shutil.copytree(good, bad)
    where = data.draw(st.floats(0, 1))  # a position as a fraction: the same strategy whatever the sizes

    def at(n):
        return min(int(where * n), n - 1)

    if target == "offsets":
        o = np.load(bad / "shard-00000.offsets.npy")
        o[at(len(o))] = int(data.draw(st.floats(-0.1, 1.1)) * int(o[-1]))
        np.save(bad / "shard-00000.offsets.npy", o)
    elif target == "tokens":
        t = np.fromfile(bad / "shard-00000.tokens", dtype=np.uint16)
        t[at(len(t))] = data.draw(st.integers(0, 65535))
        cut = data.draw(st.booleans())
        (t[:-3] if cut else t).tofile(bad / "shard-00000.tokens")
    else:
        text = (bad / "manifest.json").read_text()
        i = at(len(text))
        text = text[:i] + data.draw(st.sampled_from(["", "x", "]", "-1", '"', "0"])) + text[i + 1 :]
        (bad / "manifest.json").write_text(text)
    try:
        got = read_all(bad)
    except ValueError as e:
        assert str(bad) in str(e), str(e)  # names the store
        return
    ids_ok = all(max(doc, default=0) < len(TOK) for doc in got)
    assert ids_ok  # never an id the model cannot embed
    if target != "tokens":
        assert got == expected  # a harmless edit (e.g. a value written the same) reads the same data


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lines=st.lists(
        st.one_of(st.text(max_size=30), st.binary(max_size=30).map(lambda b: b.decode("latin-1"))),
        min_size=1,
        max_size=8,
    )
)
def test_malformed_jsonl_gives_an_error_with_file_and_line_or_trains(tmp_path_factory, lines):
    path = tmp_path_factory.mktemp("j") / "data.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8", errors="surrogatepass")
    loader = jd.DataLoader(jd.as_source(str(path)), TOK, CONFIG)
    try:
        for _ in range(3):
            batch = next(iter(loader))
            assert batch["input_ids"].shape == (2, 16)
    except (ValueError, FileNotFoundError) as e:
        assert "data.jsonl" in str(e), str(e)  # names the file (and its line, for a bad line)
    except StopIteration:
        pass


def test_a_pretokenized_row_with_no_target_is_a_bad_record(tmp_path):
    """Rows whose labels are all -100 "trained" at loss 0.0 (issue 43): a bad record naming file:line."""
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"input_ids": [5, 6, 7, 8], "labels": [-100, -100, -100, -100]}) + "\n")
    loader = jd.DataLoader(jd.as_source(str(path)), TOK, CONFIG)
    with pytest.raises(ValueError, match=rf"{path}:1: a pre-tokenized row of 4 tokens has no target token"):
        next(iter(loader))
