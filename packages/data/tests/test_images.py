"""Images read for models that see: every form a record or the command line gives (a file, a PIL image, a `datasets`
image), one error naming where for each bad one, and transformers' own image processor turning them into patches."""

import numpy as np
import pytest
from PIL import Image

import jaxloom.data as jd


@pytest.fixture
def picture(tmp_path):
    path = tmp_path / "p.png"
    Image.fromarray(np.arange(12 * 20 * 3, dtype=np.uint8).reshape(12, 20, 3)).save(path)
    return path


def test_every_form_reads_as_the_same_rgb_image(picture):
    want = np.asarray(Image.open(picture).convert("RGB"))
    forms = [
        picture,
        str(picture),
        Image.open(picture).convert("L").convert("RGB"),  # another mode, made RGB
        {"bytes": picture.read_bytes(), "path": None},  # a datasets Image feature, undecoded
        {"bytes": None, "path": str(picture)},
    ]
    for form in forms[:2] + forms[3:]:
        assert np.array_equal(np.asarray(jd.open_image(form, "record 0")), want)
    assert jd.open_image(forms[2], "record 0").mode == "RGB"


def test_bad_images_are_one_error_naming_where(tmp_path):
    (tmp_path / "notes.png").write_text("not an image")
    cases = [
        (tmp_path / "missing.png", f"record 3: image file {tmp_path / 'missing.png'} does not exist"),
        ("https://example.com/x.png", "record 3: image 'https://example.com/x.png' is a URL; jaxloom reads images"),
        (tmp_path / "notes.png", "record 3: .*notes.png is not an image PIL reads"),
        ({"bytes": b"garbage", "path": None}, "record 3: its image bytes are not an image PIL reads"),
        (42, "record 3: an image of type int; expected a file path, a PIL image or a datasets image"),
    ]
    for value, words in cases:
        with pytest.raises(ValueError, match=words):
            jd.open_image(value, "record 3")


def test_the_image_processor_of_a_model_directory(tmp_path, picture):
    transformers = pytest.importorskip("transformers")
    with pytest.raises(ValueError, match="no preprocessor_config.json, so no image processor"):
        jd.load_image_processor(tmp_path)
    transformers.Qwen2VLImageProcessorPil(
        patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=16 * 16, max_pixels=32 * 48
    ).save_pretrained(str(tmp_path))
    processor = jd.load_image_processor(tmp_path)
    pixels, grid = jd.process_images(processor, [picture], "record 0")
    direct = processor(images=[Image.open(picture).convert("RGB")], return_tensors="np")
    assert np.array_equal(pixels, direct["pixel_values"]) and grid.tolist() == direct["image_grid_thw"].tolist()
    assert pixels.shape == (int(grid.prod()), 3 * 2 * 4 * 4)


def test_records_with_images_for_rows_that_read_none_are_refused(picture, tmp_path):
    """A text model's rows (no processor, `max_images` 0) would drop a record's images without a word: SFT, DPO and
    KTO records that hold images are one error naming the column (TRL refuses such data too); empty lists pass.
    Small files are checked before a run starts (`first_bad_record`)."""
    tok = jd.load_processor()
    config = jd.DataConfig(max_sequence_length=32, packing=False)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    for record, tokenize in (
        ({"messages": chat, "images": [str(picture)]}, jd.tokenize_record),
        ({"text": "a cat", "image": str(picture)}, jd.tokenize_record),
        ({"prompt": "p", "chosen": " a", "rejected": " b", "images": [str(picture)]}, jd.tokenize_pair),
    ):
        with pytest.raises(ValueError, match=r"column 'images' holds 1 image\(s\), and this run's model reads none"):
            tokenize(record, tok, config)
    labelled = jd.DataConfig(max_sequence_length=32, packing=False, label_column="label")
    with pytest.raises(ValueError, match="reads none"):
        jd.tokenize_labelled(
            {"prompt": "p", "completion": " a", "label": True, "images": [str(picture)]}, tok, labelled
        )
    assert len(jd.tokenize_record({"messages": chat, "images": []}, tok, config)[0])  # no images: read as text
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a"}\n{"text": "b", "images": ["%s"]}\n' % picture)
    assert "d.jsonl:2: column 'images' holds 1 image(s)" in jd.first_bad_record(str(path), config)
