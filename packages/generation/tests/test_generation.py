import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxloom.data as jd
import jaxloom.generation as jg
import jaxloom.models as jm
from jaxloom.generation.testing import naive_greedy
from jaxloom.mesh import MeshConfig

TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def prompts(lengths=(5, 9, 1, 12), width=12, seed=0):
    rng = np.random.default_rng(seed)
    ids = np.zeros((len(lengths), width), np.int32)
    mask = np.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n :] = rng.integers(1, 97, n)
        mask[i, width - n :] = 1
    return ids, mask


@pytest.mark.parametrize(
    ("config", "scan"),
    [
        (jm.LlamaConfig(**TINY), False),
        (jm.LlamaConfig(**TINY), True),
        (jm.MistralConfig(**TINY, sliding_window=6), True),
        (jm.MixtralConfig(**TINY, num_local_experts=4), False),
    ],
    ids=["llama-unrolled", "llama-scanned", "mistral-scanned", "mixtral-unrolled"],
)
def test_cached_greedy_equals_naive_recomputation(config, scan):
    """The KV cache (per layer, or stacked for a scanned stack) decodes what recomputation does. For
    Mistral (sliding window) the naive side runs `chunked` attention, the cached side `xla` over the
    cache. (The naive loop runs eagerly and recompiles per length: each cache layout and each family is
    covered once, not every pair.)"""
    model = jm.create_model(config, jm.RuntimeConfig(scan_layers=scan, attn_mechanism="auto"), seed=1)
    assert model.scanned == scan
    ids, mask = prompts()
    out = jg.generate(model, ids, mask, jg.GenerationConfig(max_new_tokens=10))
    naive = (
        model
        if not isinstance(config, jm.MistralConfig)
        else jm.create_model(
            config, jm.RuntimeConfig(scan_layers=scan, attn_mechanism="chunked", attn_block_size=4), seed=1
        )
    )
    expected = naive_greedy(naive, ids, mask, 10)
    np.testing.assert_array_equal(np.asarray(out.completion_ids), expected)
    np.testing.assert_array_equal(np.asarray(out.sequences)[:, :12], ids)


@pytest.mark.parametrize(
    ("config", "axes"),
    [
        (jm.LlamaConfig(**{**TINY, "vocab_size": 96}), dict(fsdp=2, tp=2)),  # tp=2 must divide the vocabulary
        (jm.MixtralConfig(**TINY, num_local_experts=4), dict(ep=2, fsdp=2)),  # experts split: tokens move
    ],
    ids=["llama-fsdp-tp", "mixtral-ep"],
)
def test_on_a_mesh_equals_one_device(config, axes):
    ids, mask = prompts()
    ref = jg.generate(jm.create_model(config, seed=2), ids, mask, jg.GenerationConfig(max_new_tokens=8))
    mesh = MeshConfig.from_axes(**axes).build(jax.devices()[:4])
    sharded = jm.create_model(config, seed=2, mesh=mesh)
    out = jg.generate(sharded, ids, mask, jg.GenerationConfig(max_new_tokens=8), mesh=mesh)
    np.testing.assert_array_equal(np.asarray(out.completion_ids), np.asarray(ref.completion_ids))
    # the paged engine on the sharded parameters (its pool whole on every device of the mesh)
    engine = jg.LLMEngine(sharded, max_num_seqs=2, decode_chunk=3, page_size=4, mesh=mesh)
    real = [row[m > 0].tolist() for row, m in zip(ids, mask, strict=True)]
    outs = engine.generate(real, max_new_tokens=8)
    np.testing.assert_array_equal([o.outputs[0].token_ids for o in outs], np.asarray(ref.completion_ids))


def test_eos_stops_each_sequence():
    model = jm.create_model(jm.LlamaConfig(**TINY), seed=1)
    ids, mask = prompts()
    free = np.asarray(jg.generate(model, ids, mask, jg.GenerationConfig(max_new_tokens=10)).completion_ids)
    eos = int(free[0, 3])  # the 4th token sequence 0 would emit
    out = jg.generate(model, ids, mask, jg.GenerationConfig(max_new_tokens=10, eos_token_id=eos, pad_token_id=0))
    comp, cm = np.asarray(out.completion_ids), np.asarray(out.completion_mask)
    for row in range(len(ids)):
        hits = np.where(free[row] == eos)[0]
        stop = hits[0] + 1 if len(hits) else 10
        np.testing.assert_array_equal(comp[row, :stop], free[row, :stop])
        assert cm[row].sum() == stop and (comp[row, stop:] == 0).all()


def test_sampling_repeats_with_a_seed_and_respects_top_k_top_p():
    model = jm.create_model(jm.LlamaConfig(**TINY), seed=1)
    ids, mask = prompts()
    cfg = jg.GenerationConfig(max_new_tokens=6, do_sample=True, temperature=1.0, top_k=5, seed=3)
    a, b = (np.asarray(jg.generate(model, ids, mask, cfg).completion_ids) for _ in range(2))
    np.testing.assert_array_equal(a, b)
    c = np.asarray(jg.generate(model, ids, mask, cfg.replace(seed=4)).completion_ids)
    assert not np.array_equal(a, c)
    greedy = np.asarray(jg.generate(model, ids, mask, jg.GenerationConfig(max_new_tokens=6)).completion_ids)
    zero_t = np.asarray(jg.generate(model, ids, mask, cfg.replace(temperature=0.0)).completion_ids)
    np.testing.assert_array_equal(greedy, zero_t)
    # a crafted distribution: probabilities .5 .3 .15 .05 over 4 tokens
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 2000))
    for top_k, top_p, allowed in [(2, None, {0, 1}), (None, 0.7, {0, 1}), (None, 0.5, {0}), (3, 0.9, {0, 1, 2})]:
        cfg = jg.GenerationConfig(do_sample=True, top_k=top_k, top_p=top_p)
        tokens = np.asarray(jg.next_token(logits, jax.random.PRNGKey(0), cfg))
        assert set(tokens.tolist()) == allowed, (top_k, top_p)


def test_unified_with_text_and_chat():
    tok = jd.load_processor()
    model = jm.create_model(jm.LlamaConfig(**{**TINY, "vocab_size": len(tok)}), seed=0)
    res = jg.generate_unified(model, tok, prompts=["The interpreter", "A list"], max_new_tokens=5)
    assert len(res.generation_results) == 2 and res.prompt_ids.shape[0] == 2
    assert res.prompt_mask[0, -1] == 1 and res.completion_ids.shape == (2, 5)
    assert res.decoded_prompts[0] == "The interpreter"
    assert res.completion_prompts[1].startswith("A list")
    chat = jg.generate_unified(
        model, tok, prompts=[[{"role": "user", "content": "hi"}]], apply_chat_template=True, max_new_tokens=3
    )
    assert "hi" in tok.decode(chat.prompt_ids[0][chat.prompt_mask[0] > 0])
    seqs, comp, cm = jg.create_generate_function(jg.GenerationConfig(max_new_tokens=4))(
        model, res.prompt_ids, res.prompt_mask
    )
    assert comp.shape == (2, 4)


def test_prompts_follow_the_tokenizers_own_bos_policy():
    """As transformers encodes them: BOS only where the tokenizer adds it itself (the trainer's tokenizer
    does, as training did: `jaxloom.data.match_bos`); a chat template writes its own."""
    tok = jd.load_processor()
    assert jg.encode_prompts(tok, "A list") == [tok("A list").input_ids] == [tok.encode("A list")]
    with_bos = jd.match_bos(tok, add_bos=True)
    assert jg.encode_prompts(with_bos, ["A list"])[0] == [tok.bos_token_id, *tok.encode("A list")]
    chat = [{"role": "user", "content": "hi"}]
    for t in (tok, with_bos):  # the template's BOS, once
        ids = jg.encode_prompts(t, chat, apply_chat_template=True)[0]
        assert ids == tok.apply_chat_template(chat, add_generation_prompt=True)["input_ids"]
        assert ids[:2].count(tok.bos_token_id) == 1
    # a text with the chat template is the user's message (issue 53: it was read as a list of messages), alone or
    # in a list
    as_user = tok.apply_chat_template(chat, add_generation_prompt=True)["input_ids"]
    assert jg.encode_prompts(tok, "hi", apply_chat_template=True) == [as_user]
    assert jg.encode_prompts(tok, ["hi", chat], apply_chat_template=True) == [as_user, as_user]


def test_chat_generation_stops_at_the_templates_end_of_turn_token():
    tok = jd.load_processor()
    eot = tok.convert_tokens_to_ids("<|end|>")
    assert jg.end_of_turn_ids(tok) == (eot,) and tok.eos_token_id != eot
    model = jm.create_model(jm.LlamaConfig(**{**TINY, "vocab_size": len(tok)}), seed=0)
    chat = [[{"role": "user", "content": "hi"}]]
    before = jg.generate_unified(model, tok, prompts=chat, apply_chat_template=True, max_new_tokens=1)
    first = int(before.completion_ids[0, 0])
    kernel = model.lm_head.kernel  # make the model answer <|end|> at once: its logit now beats the old argmax
    kernel[...] = kernel[...].at[:, eot].set(3 * kernel[:, first])
    unstopped = jg.generate(model, before.prompt_ids, before.prompt_mask, jg.GenerationConfig(max_new_tokens=6))
    assert int(unstopped.completion_ids[0, 0]) == eot and int(unstopped.completion_mask.sum()) == 6
    res = jg.generate_unified(model, tok, prompts=chat, apply_chat_template=True, max_new_tokens=6)
    assert res.completion_ids[0, 0] == eot and res.completion_mask.sum() == 1 and res.generation_results == [""]


def test_stream_yields_the_same_tokens_as_generate():
    model = jm.create_model(jm.LlamaConfig(**TINY), seed=1)
    ids = np.random.default_rng(5).integers(1, 97, 7).astype(np.int32)
    for cfg in (jg.GenerationConfig(max_new_tokens=9, do_sample=True, seed=2), jg.GenerationConfig(max_new_tokens=9)):
        batch = np.asarray(jg.generate(model, ids[None], None, cfg).completion_ids)[0]
        assert list(jg.stream(model, ids, cfg)) == batch.tolist()
    eos = int(batch[2])  # from the greedy run
    assert list(jg.stream(model, ids, jg.GenerationConfig(max_new_tokens=9, eos_token_id=eos)))[-1] == eos


def test_config_from_transformers_generation_config():
    import transformers

    hf = transformers.GenerationConfig(max_new_tokens=7, do_sample=True, top_k=3, eos_token_id=[2, 5], pad_token_id=1)
    cfg = jg.GenerationConfig.from_hf(hf, seed=9)
    assert (cfg.max_new_tokens, cfg.do_sample, cfg.top_k, cfg.eos_ids, cfg.pad_token_id, cfg.seed) == (
        7,
        True,
        3,
        (2, 5),
        1,
        9,
    )


def test_bad_inputs():
    model = jm.create_model(jm.LlamaConfig(**TINY))
    with pytest.raises(ValueError, match="max_new_tokens = 0; expected a positive integer"):
        jg.GenerationConfig(max_new_tokens=0)
    with pytest.raises(ValueError, match=r"non-empty \[batch, length\] array, got shape \(0, 3\)"):
        jg.generate(model, np.zeros((0, 3), np.int32))
    with pytest.raises(ValueError, match="exceeds the model's context of 128"):
        jg.generate(model, np.ones((1, 120), np.int32), config=jg.GenerationConfig(max_new_tokens=20))
    with pytest.raises(ValueError, match="the prompt list is empty"):
        jg.generate_unified(model, jd.load_processor(), prompts=[])
    with pytest.raises(ValueError, match="top_p = 1.5"):
        jg.GenerationConfig(top_p=1.5)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_a_group_shares_one_prefill_and_samples_what_repeated_prompts_do(scan):
    """`num_return_sequences=g` runs each prompt once and repeats its KV cache for its g completions: greedy, the
    completions equal decoding the prompt repeated g times; sampled with one key, the tokens equal those of the
    repeated prompts too (same logits, same key per row), so sharing the prefill changes no sample."""
    model = jm.create_model(jm.LlamaConfig(**TINY), jm.RuntimeConfig(scan_layers=scan), seed=2)
    ids, mask = prompts((4, 7), width=7)
    rep_ids, rep_mask = np.repeat(ids, 3, axis=0), np.repeat(mask, 3, axis=0)
    for config in (
        jg.GenerationConfig(max_new_tokens=6),
        jg.GenerationConfig(max_new_tokens=6, do_sample=True, temperature=1.3, top_k=20),
    ):
        key = jax.random.PRNGKey(5)
        shared = jg.generate(model, ids, mask, config, rng=key, num_return_sequences=3)
        repeated = jg.generate(model, rep_ids, rep_mask, config, rng=key)
        np.testing.assert_array_equal(np.asarray(shared.completion_ids), np.asarray(repeated.completion_ids))
        np.testing.assert_array_equal(np.asarray(shared.sequences), np.asarray(repeated.sequences))
        np.testing.assert_allclose(
            np.asarray(shared.completion_logps), np.asarray(repeated.completion_logps), atol=1e-6
        )
    assert len({tuple(r) for r in np.asarray(shared.completion_ids)}) > 2  # sampled rows of a group differ
    with pytest.raises(ValueError, match="num_return_sequences = 0"):
        jg.generate(model, ids, mask, config, num_return_sequences=0)


def test_recorded_log_probs_equal_a_forward_pass_over_the_sequence():
    """`completion_logps` are what a forward pass over prompt + completion gives each generated token (float32
    logits / temperature, before top-k filtering), and 0 after a row ends."""
    model = jm.create_model(jm.LlamaConfig(**TINY), jm.RuntimeConfig(), seed=3)
    ids, mask = prompts((5, 9, 2), width=9)
    config = jg.GenerationConfig(
        max_new_tokens=8, do_sample=True, temperature=0.7, top_k=30, eos_token_id=tuple(range(3, 23))
    )
    out = jg.generate(model, ids, mask, config, rng=jax.random.PRNGKey(1), num_return_sequences=2)
    seq = np.asarray(out.sequences)
    seg = np.concatenate([np.repeat(mask, 2, axis=0), np.asarray(out.completion_mask)], axis=1)
    logits = model(jnp.asarray(seq), segment_ids=jnp.asarray(seg)).logits.astype(jnp.float32) / 0.7
    logp = jax.nn.log_softmax(logits, axis=-1)
    p = ids.shape[1]
    forward = np.take_along_axis(np.asarray(logp[:, p - 1 : -1]), seq[:, p:, None], axis=-1)[..., 0]
    m = np.asarray(out.completion_mask) > 0
    recorded = np.asarray(out.completion_logps)
    assert np.abs(recorded - forward)[m].max() <= 1e-6, np.abs(recorded - forward)[m].max()
    assert (recorded[~m] == 0).all() and (~m).any()  # some rows ended early (EOS ids 3..22)


def test_finished_rows_are_compacted_away_without_changing_a_sample(monkeypatch):
    """A batch of `COMPACT_ROWS` rows or more decodes in narrowing phases as its rows end (finished rows stop
    costing); each row samples with its own key, so the tokens are those of decoding the whole batch to the end."""
    import jaxloom.generation.decode as decode

    model = jm.create_model(jm.LlamaConfig(**TINY), jm.RuntimeConfig(scan_layers=True), seed=4)
    ids, mask = prompts((3, 6, 2, 5), width=6)
    config = jg.GenerationConfig(max_new_tokens=12, do_sample=True, eos_token_id=tuple(range(3, 15)))
    compacted = jg.generate(model, ids, mask, config, rng=jax.random.PRNGKey(2), num_return_sequences=16)
    lengths = np.asarray(compacted.completion_mask).sum(1)
    assert compacted.completion_ids.shape == (64, 12) and lengths.min() < 6 and lengths.max() > 9
    monkeypatch.setattr(decode, "COMPACT_ROWS", 10**6)
    decode._compiled.cache_clear()
    whole = jg.generate(model, ids, mask, config, rng=jax.random.PRNGKey(2), num_return_sequences=16)
    decode._compiled.cache_clear()
    np.testing.assert_array_equal(np.asarray(compacted.completion_ids), np.asarray(whole.completion_ids))
    np.testing.assert_array_equal(np.asarray(compacted.completion_mask), np.asarray(whole.completion_mask))
    np.testing.assert_allclose(np.asarray(compacted.completion_logps), np.asarray(whole.completion_logps), atol=1e-6)


def test_an_moe_models_experts_are_recorded_as_a_forward_over_the_sequence_chooses_them():
    """`record_routes=True`: the experts each layer sent each token to while decoding (the prompt in the prefill,
    each completion token when fed; the group sharing its prompt's), `[B, P + N, L, k]` — what a forward pass over
    the whole sequence chooses; -1 on padding, after a row ends and on its last token (never fed). The batch is
    wide enough to be compacted as rows end (rows keep their own places)."""
    config = jm.MixtralConfig(**TINY, num_local_experts=4)
    model = jm.create_model(config, jm.RuntimeConfig(scan_layers=True), seed=5)
    ids, mask = prompts((5, 9, 2, 7), width=9)
    gen = jg.GenerationConfig(max_new_tokens=10, do_sample=True, eos_token_id=tuple(range(3, 13)))
    out = jg.generate(model, ids, mask, gen, rng=jax.random.PRNGKey(3), num_return_sequences=8, record_routes=True)
    seq, routes = np.asarray(out.sequences), np.asarray(out.routes)
    assert routes.shape == (32, 19, 2, 2) and routes.dtype == np.int16
    comp = np.asarray(out.completion_mask)
    lengths = comp.sum(1)
    assert lengths.min() < 5 and lengths.max() == 10  # rows ended early: the decode was compacted
    seg = np.concatenate([np.repeat(mask, 8, axis=0), comp], axis=1)
    forward = np.transpose(np.asarray(model(jnp.asarray(seq), segment_ids=jnp.asarray(seg)).routes), (1, 2, 0, 3))
    fed = seg.copy()  # the tokens a decode step ran: the prompt's and every completion token but a row's last
    fed[np.arange(32), 9 + lengths - 1] = 0
    recorded = (routes >= 0).all(-1)
    np.testing.assert_array_equal(recorded, np.repeat(fed[:, :, None] > 0, 2, axis=2))
    np.testing.assert_array_equal(np.sort(routes, -1)[recorded], np.sort(forward, -1)[recorded])
    assert (routes[~recorded] == -1).all()
    plain = jg.generate(model, ids, mask, gen, rng=jax.random.PRNGKey(3), num_return_sequences=8)
    assert plain.routes is None  # only when asked; the tokens are the same
    np.testing.assert_array_equal(np.asarray(plain.sequences), seq)
