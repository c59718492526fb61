"""Every key of TRL 1.16's seven configs is answered by jaxloom's matching class: its own key, an alias, honoured
under jaxloom's name, or accepted at what jaxloom does and refused otherwise by name — never a bare "unknown
argument"; docs/migration.md's table is the one generated from TRL's dataclasses now."""

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("trl")

TOOL = Path(__file__).resolve().parents[3] / "tools" / "trl_keys_table.py"


@pytest.fixture(scope="module")
def tool():
    if not TOOL.is_file():
        pytest.skip("tools/ is not beside this checkout of the package")
    spec = importlib.util.spec_from_file_location("trl_keys_table", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_key_of_trls_configs_is_unanswered_and_the_docs_table_is_current(tool):
    rows = tool.answers()
    assert len({r["key"] for r in rows}) > 200  # the seven configs and TrainingArguments' keys
    unanswered = sorted({(r["config"], r["key"]) for r in rows if not r["answer"]})
    assert not unanswered, unanswered
    bare = sorted(
        {(r["config"], r["key"], r["at_default"]) for r in rows if r["at_default"] not in ("accepted", "refused")}
    )
    assert not bare, bare  # at TRL's default each is accepted, or refused with a message naming it
    refused = sorted({r["key"] for r in rows if r["at_default"] == "refused"})
    assert refused == ["per_device_eval_batch_size", "per_device_train_batch_size"], refused  # rows per device
    docs = TOOL.parents[1] / "docs" / "migration.md"
    assert tool.section() in docs.read_text(), "docs/migration.md is stale: python tools/trl_keys_table.py --write"


def test_a_refused_value_names_the_key_the_value_and_what_jaxloom_does():
    from jaxloom.trainer import GRPOConfig, KTOConfig, TrainingArguments

    with pytest.raises(ValueError, match=r"use_vllm = True: jaxloom samples rollouts with its own engine"):
        GRPOConfig(use_vllm=True)
    with pytest.raises(ValueError, match=r"sync_ref_model = True: the reference is frozen"):
        KTOConfig(sync_ref_model=True)
    with pytest.raises(ValueError, match=r"deepspeed = 'ds.json': jaxloom shards with its device mesh"):
        TrainingArguments(deepspeed="ds.json")
    with pytest.raises(ValueError, match=r"resume_from_checkpoint = 'out/checkpoint-500': jaxloom resumes"):
        TrainingArguments(resume_from_checkpoint="out/checkpoint-500")
    assert GRPOConfig(use_vllm=False, vllm_mode="colocate", multi_objective_aggregation="sum_then_normalize")


def test_the_loss_mask_keys_train_on_what_trl_trains_on():
    """`completion_only_loss=false` (prompt + completion records) and `assistant_only_loss=false` (chat records, TRL's
    default) train on every token; the defaults on the completion and the assistant turns."""
    import jaxloom.data as jd
    from jaxloom.trainer import TrainingArguments
    from jaxloom.trainer.batches import DataSpec

    tok = jd.load_processor()
    records = [
        {"prompt": "say", "completion": " yes"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
    ]
    masks = {}
    for only in (True, False):
        a = TrainingArguments(
            completion_only_loss=only, assistant_only_loss=only, packing=False, max_sequence_length=64
        )
        settings = {**DataSpec.tokens(a).settings, "batch_size": 2, "shuffle": False}
        batch = next(iter(jd.DataLoader(records, tok, jd.DataConfig(**settings))))
        masks[only] = (batch["loss_mask"] * (batch["segment_ids"] > 0)).sum(1), (batch["segment_ids"] > 0).sum(1)
    (part, n), (whole, n_all) = masks[True], masks[False]
    assert (whole == n_all).all() and (part < n).all() and (part > 0).all()
    assert TrainingArguments(completion_only_loss=None).completion_only_loss is True  # TRL's None
