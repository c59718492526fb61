"""`jaxloom.core.paths` on local paths: atomic writes, moves, listings with sizes, removal, refusals."""

import pytest

from jaxloom.core import paths


def test_local_paths_are_pathlib_and_uris_are_not(tmp_path):
    assert not paths.is_uri(tmp_path) and paths.is_uri("gs://bucket/run")
    assert paths.as_path(tmp_path / "x") == (tmp_path / "x").absolute()


def test_write_atomic_move_list_and_remove(tmp_path):
    target = tmp_path / "a" / "config.json"
    target.parent.mkdir()
    paths.write_atomic(target, '{"x": 1}')
    assert target.read_text() == '{"x": 1}' and not list(target.parent.glob("*.tmp*"))
    paths.write_atomic(target, '{"x": 2}')  # replaced whole
    assert target.read_text() == '{"x": 2}'
    (tmp_path / "a" / "sub").mkdir()
    (tmp_path / "a" / "sub" / "b.bin").write_bytes(b"12345")
    sizes = paths.files_with_sizes(tmp_path / "a")
    assert sizes == {"config.json": 8, "sub/b.bin": 5}
    paths.move(tmp_path / "a", tmp_path / "b")
    assert not (tmp_path / "a").exists() and (tmp_path / "b" / "sub" / "b.bin").read_bytes() == b"12345"
    paths.remove_tree(tmp_path / "b")
    assert not (tmp_path / "b").exists()


def test_gs_and_s3_are_uris_and_other_paths_are_local():
    assert paths.is_uri("s3://bucket/run") and paths.is_uri("gs://bucket/run")
    assert not paths.is_uri("runs/a") and paths.as_path("runs/a").is_absolute()
    with pytest.raises(ValueError, match=r"no conditional write for file://"):
        paths.write_if("file:///tmp/x", b"", None)


def test_a_file_in_the_way_of_a_directory_is_named_before_anything_is_made(tmp_path):
    """Issue 57: `save_directory=afile/run` with `afile` a regular file is one line naming the key and the file."""
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match=r"save_directory = '.*afile/run/deeper': .*afile is a file where a directory"):
        paths.check_writable_target(tmp_path / "afile" / "run" / "deeper", "save_directory")
    with pytest.raises(ValueError, match=r"out = .*: .*afile is a file"):
        paths.check_writable_target(tmp_path / "afile", "out")
    paths.check_writable_target(tmp_path / "new" / "run", "save_directory")  # parents made later: fine
    paths.check_writable_target("s3://bucket/afile/run", "save_directory")  # a store has no files in the way
    assert not (tmp_path / "new").exists()
