"""Chat data in the formats of the families jaxloom loads (Gemma's, Qwen2.5's ChatML, Qwen3's with its think
block): the tokens are the whole conversation as the template renders it (what the model reads at inference),
and the targets are each assistant reply through its end-of-turn token (where generation must stop), never a
role header or a user turn."""

import dataclasses

import numpy as np
import pytest

pytest.importorskip("transformers")

import jaxloom.data as jd  # noqa: E402
from chat_styles import END_OF_TURN, chat_tokenizer  # noqa: E402
from jaxloom.data.tokenize import tokenize_pair, tokenize_record  # noqa: E402

CONVERSATION = [
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "Four."},
    {"role": "user", "content": "And three plus three?"},
    {"role": "assistant", "content": "Six, of course."},
]


def runs(ids, mask):
    """The target tokens as contiguous runs."""
    out, current = [], []
    for token, m in zip(ids, mask, strict=True):
        if m:
            current.append(int(token))
        elif current:
            out.append(current)
            current = []
    return out + ([current] if current else [])


@pytest.mark.parametrize("style", ["gemma", "chatml", "qwen3"])
def test_sft_targets_are_the_replies_through_their_end_of_turn(style):
    tok = chat_tokenizer(style)
    ids, mask = tokenize_record({"messages": CONVERSATION}, tok, jd.DataConfig())
    whole = tok(tok.apply_chat_template(CONVERSATION, tokenize=False), add_special_tokens=False)["input_ids"]
    assert ids.tolist() == whole  # the render the model reads at inference, not turns glued together
    eot = tok.convert_tokens_to_ids(END_OF_TURN[style])
    replies = runs(ids, mask)
    assert len(replies) == 2
    for reply, content in zip(replies, ("Four.", "Six, of course."), strict=True):
        text = tok.decode(reply)
        assert content in text and eot in reply, (style, text)
        assert "user" not in text and "model\n" not in text and "assistant" not in text, (style, text)
    if style == "qwen3":  # the earlier reply is rendered without a think block in the whole conversation
        assert "<think>" not in tok.decode(replies[0])


@pytest.mark.parametrize("style", ["gemma", "qwen3"])
def test_preference_pairs_in_a_family_format(style):
    """A chat preference pair: the prompt (with the generation prompt) is not a target; the chosen and the
    rejected reply are, through their end-of-turn token."""
    tok = chat_tokenizer(style)
    record = {
        "prompt": [{"role": "user", "content": "Name a colour."}],
        "chosen": [{"role": "assistant", "content": "Red."}],
        "rejected": [{"role": "assistant", "content": "Seven."}],
    }
    config = jd.DataConfig(max_sequence_length=128)
    chosen, chosen_mask, rejected, rejected_mask = tokenize_pair(record, tok, config)
    eot = tok.convert_tokens_to_ids(END_OF_TURN[style])
    for ids, mask, content in ((chosen, chosen_mask, "Red."), (rejected, rejected_mask, "Seven.")):
        target = tok.decode(np.asarray(ids)[np.asarray(mask) == 1])
        assert content in target and eot in np.asarray(ids)[np.asarray(mask) == 1].tolist()
        assert "Name a colour" not in target


def test_a_pairs_margin_column_is_read_per_row_and_checked(tmp_path):
    """`margin_column` (TRL's optional `margin`): each pair row carries its record's number (0 where the record has
    none); a value that is not a finite number is a bad record naming its file and line, or skipped and counted."""
    tok = jd.load_processor()
    records = [{"prompt": "say", "chosen": " yes", "rejected": " no", "margin": m} for m in (0.5, None, 2, -1.25)]
    records[1].pop("margin")
    config = jd.DataConfig(
        max_sequence_length=16, batch_size=4, pairs=True, packing=False, margin_column="margin", shuffle=False
    )
    batch = next(iter(jd.DataLoader(records, tok, config)))
    assert batch["margin"].shape == (4, 1) and batch["margin"][:, 0].tolist() == [0.5, 0.0, 2.0, -1.25]
    assert "margin" not in next(iter(jd.DataLoader(records, tok, dataclasses.replace(config, margin_column=None))))
    bad = tmp_path / "pairs.jsonl"
    lines = [f'{{"prompt": "say", "chosen": " a", "rejected": " b", "margin": {m}}}\n' for m in ("1", '"x"')]
    bad.write_text("".join(lines))
    with pytest.raises(ValueError, match=r"pairs.jsonl:2.*margin = 'x'; expected a finite number"):
        next(iter(jd.DataLoader(str(bad), tok, dataclasses.replace(config, batch_size=2))))
    skipping = jd.DataLoader(str(bad), tok, dataclasses.replace(config, batch_size=1, bad_records="skip"))
    assert next(iter(skipping))["margin"][0, 0] == 1.0


def test_unpaired_preference_records_carry_their_label_and_tokenize_as_pairs_do(tmp_path):
    """`label_column` (TRL's KTO data): each row is prompt + completion, masked on the completion as a pair's
    sequence is (the same tokens as the chosen side of the same pair), with `label [rows, 1]` 1.0/0.0; a label that
    is not a boolean, or a chosen/rejected pair, is a bad record naming its line; chat records render as pairs do."""
    tok = jd.load_processor()
    records = [{"prompt": "say", "completion": c, "label": lab} for c, lab in ((" yes", True), (" no", False))]
    config = jd.DataConfig(max_sequence_length=16, batch_size=2, packing=False, label_column="label", shuffle=False)
    batch = next(iter(jd.DataLoader(records, tok, config)))
    assert batch["label"].tolist() == [[1.0], [0.0]]
    pair = {"prompt": "say", "chosen": " yes", "rejected": " no"}
    chosen, chosen_mask, rejected, rejected_mask = jd.tokenize_pair(pair, tok, dataclasses.replace(config, pairs=True))
    for row, (ids, mask) in enumerate(((chosen, chosen_mask), (rejected, rejected_mask))):
        n = len(ids)
        assert batch["input_ids"][row, :n].tolist() == ids.tolist()
        assert batch["loss_mask"][row, :n].tolist() == mask.tolist() and not batch["segment_ids"][row, n:].any()
    chat = [
        {"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "yo"}]}
        | {"label": True}
    ]
    ids, mask, label = jd.tokenize_labelled(chat[0], tok, config)
    assert label == 1.0 and 0 < mask.sum() < len(ids) and mask[-1] == 1
    bad = tmp_path / "kto.jsonl"
    lines = ['{"prompt": "a", "completion": " b", "label": true}', '{"prompt": "a", "completion": " b", "label": 1}']
    lines.append('{"prompt": "a", "chosen": " b", "rejected": " c", "label": true}')
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"kto.jsonl:2.*label = 1; expected true"):
        next(iter(jd.DataLoader(str(bad), tok, dataclasses.replace(config, batch_size=2))))
    bad.write_text(lines[0] + "\n" + lines[2] + "\n")
    with pytest.raises(ValueError, match=r"kto.jsonl:2.*a preference pair"):
        next(iter(jd.DataLoader(str(bad), tok, dataclasses.replace(config, batch_size=2))))
    with pytest.raises(ValueError, match="label_column = 'label' needs packing=False"):
        jd.DataLoader(records, tok, dataclasses.replace(config, packing=True))


ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two numbers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
    },
}


def test_a_records_tools_are_rendered_by_the_template_as_trl_renders_them(caplog):
    """TRL's `tools` column (issue 70): SFT rendered `{"messages", "tools"}` without the tools, so a tool-calling
    prior never saw its tool prompt. The tools (a list of schemas, or its JSON text as `datasets` may store it) and
    `chat_template_kwargs` go to the chat template as TRL's SFTTrainer passes them; the targets stay the replies;
    a column nothing reads is named once; a bad `tools` value is one error before anything is tokenized."""
    import json
    import logging

    tok = chat_tokenizer("chatml_tools")
    record = {"messages": CONVERSATION, "tools": [ADD_TOOL]}
    ids, mask = tokenize_record(record, tok, jd.DataConfig())
    expected = tok.apply_chat_template(CONVERSATION, tools=[ADD_TOOL], tokenize=False)  # TRL's tokenize_fn
    assert ids.tolist() == tok(expected, add_special_tokens=False)["input_ids"]
    assert '"name": "add"' in tok.decode(ids) and "<tools>" in tok.decode(ids)
    plain, plain_mask = tokenize_record({"messages": CONVERSATION}, tok, jd.DataConfig())
    assert "<tools>" not in tok.decode(plain) and len(plain) < len(ids)
    assert [tok.decode(r) for r in runs(ids, mask)] == [tok.decode(r) for r in runs(plain, plain_mask)]  # the replies
    as_text = tokenize_record({"messages": CONVERSATION, "tools": json.dumps([ADD_TOOL])}, tok, jd.DataConfig())[0]
    assert as_text.tolist() == ids.tolist()
    with caplog.at_level(logging.WARNING):
        tokenize_record({"messages": CONVERSATION, "source": "x", "id": 1}, tok, jd.DataConfig())
        tokenize_record({"messages": CONVERSATION, "source": "y", "id": 2}, tok, jd.DataConfig())
    named = [r.getMessage() for r in caplog.records if "are not read" in r.getMessage()]
    assert len(named) == 1 and "['id', 'source']" in named[0]
    with pytest.raises(ValueError, match="column 'tools' holds dict; expected a list of tool schemas"):
        jd.tokenize.check_record({"messages": CONVERSATION, "tools": ADD_TOOL}, jd.DataConfig())
