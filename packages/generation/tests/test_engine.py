"""`LLMEngine`: continuous batching over a paged KV cache (issue 71)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxloom.data as jd
import jaxloom.generation as jg
import jaxloom.models as jm
from test_generation import TINY  # the tiny shape the decoder's tests share


def prompt_list(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 97, n).tolist() for n in lengths]


def completions(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def llama():
    return jm.create_model(jm.LlamaConfig(**TINY), seed=1)


@pytest.mark.parametrize(
    ("config", "scan"),
    [
        (jm.LlamaConfig(**TINY), False),
        (jm.LlamaConfig(**TINY), True),
        (jm.MistralConfig(**TINY, sliding_window=6), True),
        (jm.MixtralConfig(**TINY, num_local_experts=4), False),
    ],
    ids=["llama-unrolled", "llama-scanned", "mistral-window", "mixtral"],
)
def test_greedy_equals_generate_with_more_requests_than_slots(config, scan):
    """Seven prompts through three slots, pages of 4 positions, chunks of 3 steps: each completion is what the
    static decoder gives the prompt alone (which equals transformers' `generate`, test_hf_generate.py)."""
    model = jm.create_model(config, jm.RuntimeConfig(scan_layers=scan), seed=0)
    prompts = prompt_list((5, 12, 1, 12, 20, 5, 1))  # four lengths: the reference compiles once per length
    engine = jg.LLMEngine(model, max_num_seqs=3, decode_chunk=3, page_size=4)
    outs = engine.generate(prompts, max_new_tokens=10)
    for p, o in zip(prompts, outs, strict=True):
        ref = jg.generate(model, np.asarray([p]), None, jg.GenerationConfig(max_new_tokens=10))
        assert o.outputs[0].token_ids == np.asarray(ref.completion_ids)[0].tolist()
        assert o.outputs[0].finish_reason == "length" and o.prompt_token_ids == p
    assert engine.stats["prefill_tokens"] == sum(map(len, prompts))
    assert engine.pool.free == engine.pool.usable  # every page back


def test_a_sample_depends_on_seed_request_and_position_only(llama):
    """Sampled completions are the same whatever the slots, chunk, page size or pool (a pool so small that
    sequences are preempted and recompute their cache), and whatever else runs beside them."""
    config = jg.GenerationConfig(do_sample=True, temperature=1.2, top_k=40, seed=7)
    prompts = prompt_list((4, 11, 6, 2, 9))
    kw = dict(max_new_tokens=14, eos_token_id=[3, 4, 5], n=2)
    runs = {  # other slots, chunks and pages; and a pool so small that sequences are preempted (one run: compiles)
        "wide": jg.LLMEngine(llama, config, max_num_seqs=16, decode_chunk=8, page_size=16),
        "narrow, preempting": jg.LLMEngine(llama, config, max_num_seqs=3, decode_chunk=3, page_size=4, num_pages=12),
    }
    got = {name: engine.generate(prompts, **kw) for name, engine in runs.items()}
    assert runs["narrow, preempting"].stats["preemptions"] > 0
    assert completions(got["narrow, preempting"]) == completions(got["wide"])
    for a, b in zip(got["narrow, preempting"], got["wide"], strict=True):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)
    wide = dict(max_num_seqs=16, decode_chunk=8, page_size=16)  # the wide run's programs, compiled once
    alone = jg.LLMEngine(llama, config, **wide).generate([prompts[3]], request_id=3, **kw)
    assert completions(alone) == completions(got["wide"])[3:4]
    flat = completions(got["wide"])
    assert any(a != b for a, b in flat) and any(len(c) < 14 for pair in flat for c in pair)  # samples differ, some end
    other_seed = jg.LLMEngine(llama, config.replace(seed=8), **wide).generate(prompts, **kw)
    assert completions(other_seed) != flat


def test_recorded_log_probs_equal_a_forward_pass(llama):
    """Each token's recorded log-prob is what a forward pass over prompt + completion gives it (float32 logits
    over the temperature, before top-k)."""
    config = jg.GenerationConfig(do_sample=True, temperature=0.7, top_k=30, seed=1)
    prompt = prompt_list((6,))[0]
    (out,) = jg.LLMEngine(llama, config, page_size=4, decode_chunk=3).generate([prompt], max_new_tokens=9, n=3)
    for c in out.outputs:
        seq = jnp.asarray([prompt + c.token_ids])
        logp = jax.nn.log_softmax(llama(seq).logits.astype(jnp.float32) / 0.7, axis=-1)[0]
        forward = [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(c.token_ids)]
        np.testing.assert_allclose(c.logprobs, forward, atol=1e-5)


def test_a_group_shares_its_prompt_pages_and_one_prefill(llama):
    """`n` completions of a prompt run it once: the prefill counts its tokens once, its full pages are held by
    every member (copy only of the partial page), and greedy members agree."""
    prompt = prompt_list((10,))[0]
    engine = jg.LLMEngine(llama, max_num_seqs=4, decode_chunk=2, page_size=4)
    engine.add_request(prompt, max_new_tokens=6, n=4)
    engine.step()
    assert engine.stats["prefill_tokens"] == 10 and engine.stats["extend_calls"] == 1
    shared = [p for p in range(engine.pool.num_pages) if engine.pool.refs[p] == 4]
    assert len(shared) == 2  # positions 0-7 in two pages held by all four; 8-9 in a page of each
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    ids = [c.token_ids for c in outs[0].outputs]
    assert ids == [ids[0]] * 4 and len(ids[0]) == 6
    assert engine.pool.free == engine.pool.usable and not any(engine.pool.refs)


def test_every_page_returns_after_a_thousand_requests(llama):
    """1,000 requests of mixed lengths (some ending at an end id) through 32 slots: all finish, in order, each
    with what its own settings allow, and the pool ends as it began."""
    rng = np.random.default_rng(3)
    engine = jg.LLMEngine(
        llama, jg.GenerationConfig(do_sample=True, seed=2), max_num_seqs=32, decode_chunk=4, page_size=4, num_pages=96
    )
    budgets = rng.integers(1, 9, 1000)
    ids = [
        engine.add_request(rng.integers(1, 97, rng.integers(1, 12)).tolist(), max_new_tokens=int(m), eos_token_id=5)
        for m in budgets
    ]
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step())
    assert sorted(done) == ids
    for i, m in zip(ids, budgets, strict=True):
        c = done[i].outputs[0]
        assert 1 <= len(c.token_ids) <= m and (c.finish_reason == "length") == (c.token_ids[-1] != 5)
    assert engine.pool.free == engine.pool.usable and not any(engine.pool.refs)
    assert engine.stats["decode_chunks"] < 1000  # many requests share each chunk


def test_a_tool_turn_runs_only_its_own_tokens(llama):
    """A kept completion continued after a tool's answer runs only the last sampled token and the answer's
    tokens (its history stays in its pages) and decodes what a fresh request over the whole history does."""
    prompt, tool = prompt_list((9,))[0], prompt_list((5,), seed=1)[0]
    engine = jg.LLMEngine(llama, max_num_seqs=2, decode_chunk=3, page_size=4)
    (first,) = engine.generate([prompt], max_new_tokens=7, keep=True, request_id=0)
    before = engine.stats["prefill_tokens"]
    engine.extend(0, tool, max_new_tokens=8)
    (second,) = _drain(engine)
    assert engine.stats["prefill_tokens"] - before == 1 + len(tool)
    history = prompt + first.outputs[0].token_ids + tool
    (fresh,) = jg.LLMEngine(llama).generate([history], max_new_tokens=8)
    assert second.outputs[0].token_ids == fresh.outputs[0].token_ids
    engine.release(0)
    assert engine.pool.free == engine.pool.usable
    with pytest.raises(ValueError, match="not a finished completion of a request kept"):
        engine.extend(0, tool)


def _drain(engine):
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


def test_stop_strings_end_a_completion_and_are_cut_from_its_text():
    tok = jd.load_processor()
    model = jm.create_model(jm.LlamaConfig(**{**TINY, "vocab_size": len(tok)}), seed=5)
    prompt = tok("The interpreter")["input_ids"]
    engine = jg.LLMEngine(model, tokenizer=tok)
    (free,) = engine.generate([prompt], max_new_tokens=12)
    text = free.outputs[0].text
    assert text == tok.decode(free.outputs[0].token_ids, skip_special_tokens=True) and len(text) > 4
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    (cut,) = jg.LLMEngine(model, tokenizer=tok).generate([prompt], max_new_tokens=12, stop=stop)
    c = cut.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop and c.text == text[: text.index(stop)]
    assert c.token_ids == free.outputs[0].token_ids[: len(c.token_ids)] and len(c.token_ids) < 12


def test_requests_that_can_never_run_are_refused_before_any_work(llama):
    engine = jg.LLMEngine(llama, page_size=4, num_pages=9)
    with pytest.raises(ValueError, match=r"130 tokens \(prompt 10 \+ max_new_tokens 120\) exceed the model's context"):
        engine.add_request(list(range(1, 11)), max_new_tokens=120)
    engine.add_request(list(range(1, 11)), max_new_tokens=30)
    full = r"40 tokens \(n = 1\) need 10 pages of 4; the KV cache pool has 8 \(32 tokens\)"
    with pytest.raises(ValueError, match=full):
        engine.step()
    with pytest.raises(ValueError, match="n = 65 completions exceed max_num_seqs 64"):
        jg.LLMEngine(llama).add_request([1, 2], n=65)
    with pytest.raises(ValueError, match="stop strings"):
        jg.LLMEngine(llama).add_request([1, 2], stop="x")
    with pytest.raises(ValueError, match="max_num_seqs = 0"):
        jg.LLMEngine(llama, max_num_seqs=0)
    phi = jm.create_model(
        jm.Phi3Config(
            **TINY,
            rope_scaling={
                "rope_type": "longrope",
                "short_factor": [1.0] * 8,
                "long_factor": [2.0] * 8,
                "original_max_position_embeddings": 64,
            },
        ),
        seed=0,
    )
    with pytest.raises(ValueError, match="decode this model with jaxloom.generation.generate"):
        jg.LLMEngine(phi)


def test_the_pool_follows_the_memory_it_is_given(llama):
    """`kv_cache_memory` sizes the pool in bytes (a page of 16 positions here: 2 layers × k, v × 16 × 2 heads ×
    16 dims × 4 bytes = 8 KiB); without it, on CPU, every slot gets the model's whole context."""
    engine = jg.LLMEngine(llama, kv_cache_memory=64 * 8192)
    engine.step()
    assert engine.pool.num_pages == 65
    default = jg.LLMEngine(llama, max_num_seqs=4)
    default.step()
    assert default.pool.usable == 4 * 128 // 16


def test_each_request_samples_with_its_own_settings(llama):
    """Temperature, top-k and top-p are per request (a server's requests differ): a greedy request beside
    sampled ones decodes what it does alone; a top-k 1 request is greedy; rows never leave their top-k set; and
    the per-row filter equals `filter_logits` for one setting."""
    prompts = prompt_list((5, 8, 3))
    engine = jg.LLMEngine(llama, jg.GenerationConfig(do_sample=True, seed=4), max_num_seqs=4, decode_chunk=3)
    hot = engine.add_request(prompts[0], max_new_tokens=8, temperature=1.5)
    cold = engine.add_request(prompts[1], max_new_tokens=8, temperature=0.0)
    k1 = engine.add_request(prompts[2], max_new_tokens=8, top_k=1)
    done = {o.request_id: o.outputs[0].token_ids for o in _drain(engine)}
    greedy = jg.LLMEngine(llama).generate(prompts, max_new_tokens=8)
    assert done[cold] == greedy[1].outputs[0].token_ids and done[k1] == greedy[2].outputs[0].token_ids
    assert done[hot] != greedy[0].outputs[0].token_ids
    logits = jax.random.normal(jax.random.PRNGKey(0), (6, 50)) * 3
    keys = jax.random.split(jax.random.PRNGKey(1), 6)
    for top_k, top_p in ((5, 1.0), (0, 0.6), (8, 0.7), (0, 1.0)):
        want = jg.filter_logits(logits / 0.9, top_k or None, top_p if top_p < 1 else None)
        allowed = np.asarray(want > jnp.finfo(want.dtype).min)
        for draw in range(20):
            ks = jax.vmap(jax.random.fold_in, (0, None))(keys, draw)
            token, _ = jg.sample_rows(logits, ks, jnp.full(6, 0.9), jnp.full(6, top_k, jnp.int32), jnp.full(6, top_p))
            assert allowed[np.arange(6), np.asarray(token)].all(), (top_k, top_p)


def test_an_moe_models_experts_are_kept_per_token_as_a_forward_chooses_them(monkeypatch):
    """`record_routes=True`: each completion's `routes [prompt + completion, L, k]` are the experts a forward over
    its sequence chooses for every token run (the prompt once for its group; each decode chunk's fed tokens, through
    more sequences than slots, so some wait), -1 on the last token (never fed). Without it the compiled steps return
    no experts at all (no buffer left on the device), and the completions are the same."""
    from jaxloom.generation import paged

    returned, real = [], paged.compiled

    def spy(*key):  # each compiled step's experts: returned, or None
        fn = real(*key)

        def call(*args):
            out = fn(*args)
            returned.append(out[-1] is not None)
            return out

        return call

    monkeypatch.setattr(paged, "compiled", spy)
    config = jm.MixtralConfig(**TINY, num_local_experts=4)
    model = jm.create_model(config, jm.RuntimeConfig(scan_layers=True), seed=2)
    gen = jg.GenerationConfig(do_sample=True, seed=3)
    prompts = prompt_list((6, 11, 3), seed=4)
    engine = jg.LLMEngine(model, gen, max_num_seqs=4, decode_chunk=3, page_size=4, record_routes=True)
    outs = engine.generate(prompts, max_new_tokens=8, n=2, eos_token_id=list(range(3, 10)))
    for p, o in zip(prompts, outs, strict=True):
        for c in o.outputs:
            seq = p + c.token_ids
            forward = np.asarray(model(jnp.asarray([seq])).routes)[:, 0].transpose(1, 0, 2)  # [T, L, k]
            assert c.routes.shape == (len(seq), 2, 2) and c.routes.dtype == np.int16
            np.testing.assert_array_equal(np.sort(c.routes[:-1], -1), np.sort(forward[:-1], -1))
            assert (c.routes[-1] == -1).all()
    assert returned and all(returned)
    returned.clear()
    plain = jg.LLMEngine(model, gen, max_num_seqs=4, decode_chunk=3, page_size=4)
    again = plain.generate(prompts, max_new_tokens=8, n=2, eos_token_id=list(range(3, 10)))
    assert completions(again) == completions(outs) and again[0].outputs[0].routes is None
    assert returned and not any(returned)
