"""HF-faithful outputs (issue 24): `jaxloom generate` on a Hugging Face directory encodes prompts and stops
as `transformers` does, so greedy output equals `transformers.generate` token for token, and a chat reply
ends at the template's end-of-turn token. Subprocesses of the `jaxloom` command, a real torch model."""

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from util import TOK  # noqa: E402

ENV = {
    **os.environ,
    "XLA_FLAGS": f"--xla_force_host_platform_device_count=1 {os.environ.get('JAXLOOM_TEST_XLA_FLAGS', '')}",
}
NEW = 12


def _hf_model(path, seed=0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=len(TOK),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=TOK.bos_token_id,
        eos_token_id=TOK.eos_token_id,
        pad_token_id=TOK.pad_token_id,
    )
    return transformers.LlamaForCausalLM(config).eval()


def _jaxloom_generate(path, prompt, *flags):
    out = subprocess.run(
        [sys.executable, "-m", "jaxloom.trainer.cli", "generate", str(path), "--prompt", prompt, "--greedy"]
        + ["--max-new-tokens", str(NEW), *flags],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.rstrip("\n")


def _reference(hf, tok, ids, **kw):
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, **kw)
    return out[0, len(ids) :].tolist()


def test_greedy_generate_on_an_hf_directory_equals_transformers(tmp_path):
    """The bundled tokenizer adds no BOS of its own, so transformers feeds the prompt without one; so must
    we (an extra BOS changes every token after it)."""
    hf = _hf_model(tmp_path)
    hf.save_pretrained(tmp_path)
    TOK.save_pretrained(str(tmp_path))
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    prompt = "The interpreter reads"
    ids = tok(prompt).input_ids
    assert ids[0] != tok.bos_token_id  # the case where a hand-added BOS would differ
    ref = _reference(hf, tok, ids)
    assert _jaxloom_generate(tmp_path, prompt) == f">>> {prompt}\n" + tok.decode(ref, skip_special_tokens=True)
    with_bos = _reference(hf, tok, [tok.bos_token_id, *ids])
    assert with_bos != ref  # so the comparison above tells the two apart


def test_a_chat_reply_stops_at_the_end_of_turn_token(tmp_path):
    """The model is made to answer `<|end|>` (the template's end of turn) first: jaxloom stops there, as
    transformers does when generation_config lists it, and prints an empty reply; without that stop the
    model goes on talking."""
    hf = _hf_model(tmp_path, seed=1)
    tok = TOK
    eot = tok.convert_tokens_to_ids("<|end|>")
    chat = [{"role": "user", "content": "hello"}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True)["input_ids"]
    first = _reference(hf, tok, ids, eos_token_id=None)[0]
    with torch.no_grad():
        hf.lm_head.weight[eot] = 3 * hf.lm_head.weight[first]
    hf.save_pretrained(tmp_path)
    TOK.save_pretrained(str(tmp_path))
    went_on = _reference(hf, tok, ids, eos_token_id=tok.eos_token_id)
    assert went_on[0] == eot and tok.decode(went_on, skip_special_tokens=True).strip()  # it would go on
    assert _reference(hf, tok, ids, eos_token_id=[tok.eos_token_id, eot]) == [eot]
    assert _jaxloom_generate(tmp_path, "hello", "--chat") == ">>> hello"  # the prompt, then an empty reply
    assert _jaxloom_generate(tmp_path, "hello") != ">>> hello"  # (plain text is not a chat turn: it goes on)


def test_an_export_stops_and_encodes_as_training_did(tmp_path):
    """A run's HF export: its tokenizer adds BOS as training did, and its generation_config.json lists the
    EOS and the chat template's end-of-turn token, so transformers' generate() stops at either."""
    from util import CLI_TINY

    run = tmp_path / "run"
    train = subprocess.run(
        [sys.executable, "-m", "jaxloom.trainer.cli", "train", *CLI_TINY, "max_training_steps=1"]
        + ["eval_batches=1", "generation_interval=null", "generation_prompts=[]", f"save_directory={run}"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert train.returncode == 0, train.stderr[-3000:]
    hf_dir = tmp_path / "hf"
    conv = subprocess.run(
        [sys.executable, "-m", "jaxloom.trainer.cli", "convert", "--to-hf", str(run), str(hf_dir)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert conv.returncode == 0, conv.stderr[-3000:]
    tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    assert tok("A list").input_ids == [TOK.bos_token_id, *TOK.encode("A list")]  # as the training data
    for copy in (run / "tokenizer", hf_dir):  # the run's own copy too
        assert transformers.AutoTokenizer.from_pretrained(str(copy))("x").input_ids[0] == TOK.bos_token_id
    generation = json.loads((hf_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [TOK.eos_token_id, TOK.convert_tokens_to_ids("<|end|>")]
    assert generation["bos_token_id"] == TOK.bos_token_id and generation["pad_token_id"] == TOK.pad_token_id
    loaded = transformers.GenerationConfig.from_pretrained(str(hf_dir))
    assert loaded.eos_token_id == generation["eos_token_id"]


def test_serve_answers_openai_requests_with_what_transformers_generates(tmp_path):
    """`jaxloom serve HF_DIR` (port 0: a free one): `/v1/models` names the directory, a greedy completion is
    transformers' text, a bad request gets a 400 with its reason, and Ctrl-C stops it with status 0."""
    import signal
    import urllib.error
    import urllib.request

    hf = _hf_model(tmp_path)
    hf.save_pretrained(tmp_path)
    TOK.save_pretrained(str(tmp_path))
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    prompt = "The interpreter reads"
    ref = tok.decode(_reference(hf, tok, tok(prompt).input_ids), skip_special_tokens=True)
    cmd = [sys.executable, "-m", "jaxloom.trainer.cli", "serve", str(tmp_path), "--port", "0", "--max-num-seqs", "2"]
    # started ignoring SIGINT, as under a test runner's workers: the command's own handler still stops it
    ignoring = lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)  # noqa: E731
    proc = subprocess.Popen(
        cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=ignoring
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith(f"serving {tmp_path.name} at http://127.0.0.1:"), line + proc.stderr.read()[-3000:]
        base = line.split()[3]

        def post(body):
            req = urllib.request.Request(f"{base}/completions", json.dumps(body).encode(), method="POST")
            with urllib.request.urlopen(req, timeout=240) as r:
                return json.loads(r.read())

        with urllib.request.urlopen(f"{base}/models", timeout=60) as r:
            assert [m["id"] for m in json.loads(r.read())["data"]] == [tmp_path.name]
        out = post({"model": tmp_path.name, "prompt": prompt, "max_tokens": NEW, "temperature": 0})
        assert out["choices"][0]["text"] == ref and out["object"] == "text_completion"
        with pytest.raises(urllib.error.HTTPError) as e:
            post({"prompt": prompt, "n": 0})
        assert e.value.code == 400 and "n = 0" in json.loads(e.value.read())["error"]["message"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
