"""Training data streamed from `s3://` (a real S3 server on loopback) reads the same records, with the same
byte-offset cursors, as the same files on a local disk: JSONL, text and Parquet through one path layer."""

import json

import fsspec

import jaxloom.data as jd
from jaxloom.state.testing import s3_server


def _records(source):
    out = []
    for name in source.shard_names:
        out += [(row, end) for row, end in source.open_shard(name)]
    return out


def test_jsonl_text_and_parquet_stream_from_s3_as_from_a_local_disk(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    local = tmp_path / "corpus.jsonl"
    local.write_bytes(jd.bundled_corpus_path().read_bytes())
    rows = [json.loads(line) for line in local.read_text().splitlines()[:50]]
    (tmp_path / "notes.txt").write_text("".join(r["text"].replace("\n", " ") + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "part.parquet")
    with s3_server() as bucket:
        fs, root = fsspec.core.url_to_fs(f"{bucket}/data")
        for name in ("corpus.jsonl", "notes.txt", "part.parquet"):
            fs.put_file(str(tmp_path / name), f"{root}/{name}")
        for name in ("corpus.jsonl", "notes.txt", "part.parquet"):
            remote, here = jd.as_source(f"{bucket}/data/{name}"), jd.as_source(str(tmp_path / name))
            got, want = _records(remote), _records(here)
            assert got == want and len(got) >= 50, name
        resumed = jd.as_source(f"{bucket}/data/corpus.jsonl")  # from a cursor in the middle, as a resume does
        name, (_, end) = resumed.shard_names[0], _records(resumed)[9]
        assert next(iter(resumed.open_shard(name, end)))[0] == _records(jd.as_source(str(local)))[10][0]
