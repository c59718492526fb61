"""Tools in GRPO's rollouts (issue 54, TRL 1.16's `tools=`): the prompt, the tool turns and the parsed calls are
token for token what TRL and transformers' chat templates make (Qwen3's and Llama 3.1's formats, the templates TRL
ships), the tool turns are read but never trained on, and faults of a tool are reported to the model, not raised."""

import time
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("trl")
import trl  # noqa: E402
from trl.chat_template_utils import add_response_schema, parse_response  # noqa: E402
from trl.trainer.grpo_trainer import GRPOTrainer as TRLGRPOTrainer  # noqa: E402

import jaxloom.data as jd  # noqa: E402
from jaxloom.trainer.grpo.loss import aggregate, per_token_loss  # noqa: E402
from jaxloom.trainer.grpo.tools import ToolSet, exchange  # noqa: E402

QWEN_TOKENS = ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
QWEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
FORMATS = {
    "qwen2_5": ("qwen2_5.jinja", QWEN_TOKENS, "<|im_end|>", QWEN_CALL),
    "qwen3": (  # Qwen3-2507 Instruct's template (the thinking one renders a turn that its tool turn does not extend)
        "qwen3_instruct_2507.jinja",
        ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
        "<|im_end|>",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
    ),
    "llama3": (
        "llama3_1.jinja",
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"],
        "<|eot_id|>",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
    ),
}


def get_weather(city: str) -> str:
    """The weather in a city.

    Args:
        city: The city's name.
    """
    return f"sunny in {city}"


def family_tokenizer(style: str):
    """The bundled tokenizer with `style`'s special tokens and TRL's copy of the family's chat template."""
    import transformers

    template, tokens, eos, _ = FORMATS[style]
    tok = transformers.AutoTokenizer.from_pretrained(str(jd.bundled_tokenizer_path()))
    special = tokens if style == "llama3" else tokens[:2]  # Qwen's tool tags are added tokens, not special ones
    tok.add_special_tokens({"additional_special_tokens": special})
    tok.add_tokens([t for t in tokens if t not in special] + (["<think>", "</think>"] if style != "llama3" else []))
    tok.add_special_tokens({"eos_token": eos})
    from pathlib import Path

    tok.chat_template = (Path(trl.__file__).parent / "chat_templates" / template).read_text()
    return tok


def trl_suffix(tok, tool_messages):
    """TRL's own `_get_tool_suffix_ids`, on a stand-in for its trainer."""
    stub = SimpleNamespace(
        processing_class=tok, _is_vlm=False, chat_template=None, chat_template_kwargs={}, _tokenizer=tok
    )
    return TRLGRPOTrainer._get_tool_suffix_ids(stub, tool_messages)


@pytest.mark.parametrize("style", ["qwen2_5", "qwen3", "llama3"])
def test_a_tool_exchange_is_token_for_token_trls(style):
    """The prompt renders the tool's schema as transformers' template does with TRL's `tools=`; the model's call
    parses as TRL's response schema parses it; the tool turn is TRL's suffix; the exchange's tokens are TRL's
    concatenation prompt + completion + suffix + continuation, the suffix alone marked as not the model's."""
    tok = family_tokenizer(style)
    tools = ToolSet([get_weather], tok, timeout=5.0)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    want_prompt = tok.apply_chat_template(
        messages, tools=[get_weather], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert tools.encode(messages) == list(want_prompt)

    call_text = FORMATS[style][3]
    call_ids = tok.encode(call_text, add_special_tokens=False)
    content, calls = tools.parse(tok.decode(call_ids, skip_special_tokens=False))
    trl_parsed = parse_response(add_response_schema(tok), call_ids, prefix=list(want_prompt), tools=[get_weather])
    assert calls == trl_parsed["tool_calls"] and content == (trl_parsed.get("content") or "")

    results, failed = tools.run(calls)
    assert failed == 0 and results == [{"role": "tool", "name": "get_weather", "content": "sunny in Paris"}]
    assert tools.suffix_ids(results) == list(trl_suffix(tok, results))

    reply = tok.encode("It is sunny." + FORMATS[style][2], add_special_tokens=False)
    seen = []

    def generate(histories, budget, iteration, rows):
        seen.append(histories)
        return [(reply, [-0.5] * len(reply))]

    prompt = tools.encode(messages)
    out = exchange(tools, [prompt], [(call_ids, [-1.0] * len(call_ids))], generate, max_completion_length=200,
                   positions=4096, max_iterations=None)  # fmt: skip
    suffix = trl_suffix(tok, results)
    assert out.ids[0] == call_ids + list(suffix) + reply
    assert seen == [[prompt + call_ids + list(suffix)]]  # the model continued from its whole history
    assert out.keep[0] == [1] * len(call_ids) + [0] * len(suffix) + [1] * len(reply)
    assert out.logps[0] == [-1.0] * len(call_ids) + [0.0] * len(suffix) + [-0.5] * len(reply)
    assert [m["role"] for m in out.messages[0]] == ["assistant", "tool", "assistant"]
    assert out.messages[0][0]["tool_calls"] == calls and out.messages[0][2]["content"] == "It is sunny."
    assert (out.calls, out.failures, out.turns) == (1, 0, 1)


def test_the_turns_are_bounded_and_the_completion_budget_holds():
    """`max_tool_calling_iterations` bounds the tool turns; a tool turn that would pass `max_completion_length`
    is not added (TRL's rule) and the row ends as it is."""
    tok = family_tokenizer("qwen3")
    tools = ToolSet([get_weather], tok)
    call = tok.encode(FORMATS["qwen3"][3], add_special_tokens=False)

    def always_calls(histories, budget, iteration, rows):
        return [(call[:budget], [0.0] * min(len(call), budget)) for _ in histories]

    prompt = tools.encode([{"role": "user", "content": "weather?"}])
    two = exchange(tools, [prompt], [(call, [0.0] * len(call))], always_calls, max_completion_length=1000,
                   positions=4096, max_iterations=2)  # fmt: skip
    assert two.turns == 2 and two.calls == 2 and [m["role"] for m in two.messages[0]].count("tool") == 2
    short = exchange(tools, [prompt], [(call, [0.0] * len(call))], always_calls, max_completion_length=len(call) + 5,
                     positions=4096, max_iterations=None)  # fmt: skip
    assert short.ids[0] == call and short.turns == 0 and short.calls == 1  # called, but no room for the result


def slow(city: str) -> str:
    """Takes its time.

    Args:
        city: A city.
    """
    time.sleep(3)
    return "late"


def broken(city: str) -> str:
    """Raises.

    Args:
        city: A city.
    """
    raise RuntimeError(f"no data for {city}")


def numeric(city: str) -> str:
    """Returns a number.

    Args:
        city: A city.
    """
    return 7  # type: ignore[return-value]


def test_faults_of_a_tool_go_back_to_the_model_and_are_counted():
    """A tool that sleeps past its limit is cut (the call returns at the limit), one that raises or returns a
    non-string, a call of an unknown tool and one that is not JSON: each a tool message carrying the error (TRL's
    `{'error': ...}` text), each counted, none raised."""
    tools = ToolSet([slow, broken, numeric], family_tokenizer("qwen3"), timeout=0.3)
    calls = [
        {"type": "function", "function": {"name": n, "arguments": {"city": "Oslo"}}}
        for n in ("slow", "broken", "numeric", "missing")
    ]
    _, bad_json = tools.parse("<tool_call>\n{not json}\n</tool_call>")
    start = time.monotonic()
    out = tools.run_turn([([c], None) for c in calls + bad_json])  # five rows, one call each
    assert time.monotonic() - start < 2.0 and [failed for _, failed in out] == [1] * 5
    texts = [m[0]["content"] for m, _ in out]
    assert "slow took longer than 0.3 s and was cut" in texts[0]
    assert texts[1] == str({"error": "no data for Oslo"})
    assert "numeric returned int; expected a string" in texts[2]
    assert texts[3] == str({"error": "Tool missing not found."})
    assert "error" in texts[4]


def test_a_template_without_tools_is_refused_by_name():
    tok = jd.load_processor()
    with pytest.raises(ValueError, match="renders no tool-call format"):
        ToolSet([get_weather], tok)


def test_tool_tokens_carry_no_gradient():
    """The loss of a row whose middle tokens are a tool turn (loss mask 0 there): its gradient with respect to those
    positions' log-probs is zero, and the model's own tokens on both sides have gradient."""
    rng = np.random.default_rng(0)
    logp = jnp.asarray(rng.normal(-2, 0.3, (2, 12)), jnp.float32)
    keep = np.ones((2, 12), np.float32)
    keep[:, 4:8] = 0  # the tool turn
    adv = jnp.asarray([1.0, -1.0])

    def loss(lp):
        old = jax.lax.stop_gradient(lp)  # one iteration: ratio 1, nothing clipped
        per_token, _, _ = per_token_loss(lp, old, lp - 0.1, adv, beta=0.04, epsilon_low=0.2, epsilon_high=0.2,
                                         mask=jnp.asarray(keep))  # fmt: skip
        total, units = aggregate(per_token, jnp.asarray(keep), "dapo", 12)
        return total / units

    grad = np.asarray(jax.grad(loss)(logp))
    assert np.all(grad[:, 4:8] == 0) and np.all(grad[:, :4] != 0) and np.all(grad[:, 8:] != 0)


@pytest.mark.parametrize("staleness", [0, 1])
def test_grpo_trains_on_tool_exchanges_with_the_tool_turns_masked(tmp_path, monkeypatch, staleness):
    """`GRPOTrainer(tools=[...])` with chat prompts: the prompts carry the tool's schema, a completion that calls the
    tool gets the tool's turn and the model's continuation; the rewards receive the turns as messages; the rows'
    loss mask is 0 exactly on the tool turn's tokens; TRL's tool metrics are logged. (Generation is scripted here:
    a random tiny model calls no tool.) Asynchronous (`max_staleness=1`): the rollout drawn ahead, saved with the
    checkpoint of step 1 (its exchange as messages), restored from it scores as it did."""
    import json

    import jaxloom.models as jm
    from jaxloom.trainer import GRPOConfig, GRPOTrainer
    from jaxloom.trainer.grpo import sampler
    from util import mesh

    tok = family_tokenizer("qwen2_5")
    call = tok.encode(QWEN_CALL, add_special_tokens=False)
    reply = tok.encode("It is sunny.<|im_end|>", add_special_tokens=False)

    def scripted(self, prompt, mask, key, *, group=None, max_new_tokens=None, model=None):
        rows = len(prompt) * (group or self.rl.num_generations)
        width = max_new_tokens or self.rl.max_completion_length
        script = call if group is None else reply  # the first turn calls the tool, the second replies
        ids, m = np.zeros((rows, width), np.int32), np.zeros((rows, width), np.int32)
        ids[:, : len(script)], m[:, : len(script)] = script[:width], 1
        return ids, m, np.zeros((rows, width), np.float32)

    monkeypatch.setattr(sampler.Sampler, "generate", scripted)
    seen = []

    def used_the_tool(prompts, completions, **kwargs):
        seen.append(completions)
        return [float(any(m["role"] == "tool" for m in c)) for c in completions]

    config = jm.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip
    args = GRPOConfig(
        num_generations=2, max_completion_length=96, total_batch_size=4, max_training_steps=1 + staleness,
        logging_steps=1,
        save_directory=str(tmp_path), progress_bar=False, use_tensorboard=False, max_staleness=staleness,
    )  # fmt: skip
    t = GRPOTrainer(
        args,
        model=jm.create_model(config, lazy=True),
        dataset_train=[{"prompt": [{"role": "user", "content": f"Weather in {c}?"}]} for c in ("Oslo", "Rome")],
        processing_class=tok,
        mesh=mesh(1),
        reward_funcs=[used_the_tool],
        tools=[get_weather],
    )
    saved = []
    if staleness:  # the data position of step 1's checkpoint: the next rollout, drawn, with its exchange
        from jaxloom.trainer.callbacks import Callback

        t.callbacks.append(Callback(on_step_end=lambda run, step, m: saved.append(t.batches.checkpoint_state())))
    t.train()
    if staleness:
        (drawn,) = saved[0]["pipeline"]["drawn"]
        assert drawn["index"] == 1 and drawn["version"] == 0 and drawn["turns"]["counts"][0] == 4
        rows, metrics, _ = t.batches.drawer.finish(t.batches.redraw(1, json.loads(json.dumps(drawn))))
        assert seen[-1] == seen[1] and metrics["tools/call_frequency"] == 1.0  # scored again as it was
        assert rows["loss_mask"].sum() == np.asarray(t.batches.cached[1]["loss_mask"]).sum()
    assert [m["role"] for m in seen[0][0]] == ["assistant", "tool", "assistant"]
    assert seen[0][0][1]["content"] == "sunny in Paris" and seen[0][0][2]["content"] == "It is sunny."
    batch = t.batches.cached[1]
    ids, loss_mask, seg = (np.asarray(batch[k])[0] for k in ("input_ids", "loss_mask", "segment_ids"))
    suffix = ToolSet([get_weather], tok).suffix_ids(
        [{"role": "tool", "name": "get_weather", "content": "sunny in Paris"}]
    )
    width = int(np.argmax(loss_mask[0] > 0))  # the first completion column
    row = ids[0, width:][seg[0, width:] > 0].tolist()
    assert row == call + suffix + reply
    assert loss_mask[0, width:][seg[0, width:] > 0].tolist() == [1] * len(call) + [0] * len(suffix) + [1] * len(reply)
    schema_text = tok.decode(ids[0, :width])
    assert '"name": "get_weather"' in schema_text  # the prompt carries the tool's schema
    logged = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert logged["train/tools/call_frequency"] == 1.0 and logged["train/tools/failure_frequency"] == 0.0
    assert logged["train/reward"] == 1.0
