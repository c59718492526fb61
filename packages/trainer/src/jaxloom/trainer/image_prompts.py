"""`jaxloom generate DIR --image PATH`: prompts with images, made as the model's processor makes them (Qwen2.5-VL's
placeholders expanded per image, Gemma 3's through transformers' own processor) and decoded with the images in the
prefill; each completion printed whole."""

from __future__ import annotations

from pathlib import Path

PROMPT_MARK = ">>> "
"""`jaxloom generate` prints each prompt on its own line after this mark; its completions follow on the next
lines (numbered `[1] `, `[2] `, ... with `--num-return-sequences`)."""


def generate_with_images(ns, model, tokenizer, config) -> int:
    """`jaxloom generate --image PATH ...`: every prompt after the images (the user turn's image blocks with
    `--chat`), the pixels from the model directory's own image processor, decoded with the images in the prefill
    (`jaxloom.generation.generate(pixel_values=...)`); each completion printed whole."""
    import numpy as np

    import jaxloom.data as jd
    import jaxloom.generation as jg

    if not hasattr(model, "image_inputs"):
        raise ValueError(
            f"--image: {type(model).__name__} reads no images; expected a vision-language model (Qwen2.5-VL)"
        )
    c = model.config
    if hasattr(model, "image_shape"):  # a model whose processor transformers builds here (Gemma 3): the prompt is its
        own = Path(ns.path) / "tokenizer"  # a run directory keeps its processor with its tokenizer
        where = own if (own / "processor_config.json").is_file() else ns.path
        return generate_with_processor(ns, model, jd.load_model_processor(where), config)
    pixels, grid = jd.process_images(jd.load_image_processor(ns.path), ns.image, "--image")
    tokens = (c.vision_start_token_id, c.image_token_id, c.vision_end_token_id)
    for i, prompt in enumerate(ns.prompt):
        ids = jd.image_prompt(tokenizer, prompt, len(ns.image), chat=ns.chat, tokens=tokens)
        ids = jd.expand_image_tokens(ids, grid, c.image_token_id, c.vision_config.spatial_merge_size, "--prompt")
        print(f"{PROMPT_MARK}{prompt}", flush=True)
        for j in range(ns.num_return_sequences):
            if ns.num_return_sequences > 1:
                print(f"[{j + 1}] ", end="", flush=True)
            seed = int(np.random.SeedSequence([ns.seed, i, j]).generate_state(1)[0] >> 1)
            out = jg.generate(
                model, np.asarray([ids]), None, config.replace(seed=seed), pixel_values=pixels, image_grid_thw=grid
            )
            done = np.asarray(out.completion_ids)[0][np.asarray(out.completion_mask)[0] > 0]
            print(tokenizer.decode(done.tolist(), skip_special_tokens=True), flush=True)
    return 0


def generate_with_processor(ns, model, processor, config) -> int:
    """`jaxloom generate --image` through transformers' own processor (`jaxloom.data.load_model_processor`): each
    prompt after the images (its chat template's image blocks with `--chat`; else one image placeholder each, as the
    processor takes plain text), the processor's ids and pixels decoded as transformers' `generate` decodes them."""
    import numpy as np

    import jaxloom.data as jd
    import jaxloom.generation as jg

    images = [jd.open_image(image, f"--image {image}") for image in ns.image]
    tokenizer = processor.tokenizer
    for i, prompt in enumerate(ns.prompt):
        if ns.chat:
            content = [{"type": "image"} for _ in images] + [{"type": "text", "text": prompt}]
            text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                                 tokenize=False)  # fmt: skip
        else:
            text = f"{tokenizer.bos_token or ''}{processor.image_token * len(images)}{prompt}"
        try:
            inputs = processor(text=[text], images=[images], return_tensors="np", add_special_tokens=False)
        except (ValueError, TypeError) as e:
            raise ValueError(f"--image: the model's processor rejected the prompt and images ({e})") from None
        print(f"{PROMPT_MARK}{prompt}", flush=True)
        for j in range(ns.num_return_sequences):
            if ns.num_return_sequences > 1:
                print(f"[{j + 1}] ", end="", flush=True)
            seed = int(np.random.SeedSequence([ns.seed, i, j]).generate_state(1)[0] >> 1)
            out = jg.generate(model, np.asarray(inputs["input_ids"]), None, config.replace(seed=seed),
                              pixel_values=np.asarray(inputs["pixel_values"], np.float32))  # fmt: skip
            done = np.asarray(out.completion_ids)[0][np.asarray(out.completion_mask)[0] > 0]
            print(tokenizer.decode(done.tolist(), skip_special_tokens=True), flush=True)
    return 0
