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
