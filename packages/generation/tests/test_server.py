"""`OpenAIServer`: OpenAI's API on the paged engine, answered by the `openai` client (issue 71)."""

import json
import urllib.error
import urllib.request

import pytest
from test_engine import TINY

import jaxloom.data as jd
import jaxloom.generation as jg
import jaxloom.models as jm

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def served():
    tok = jd.load_processor()
    model = jm.create_model(jm.LlamaConfig(**{**TINY, "vocab_size": len(tok), "max_position_embeddings": 256}), seed=3)
    engine = jg.LLMEngine(model, max_num_seqs=4, decode_chunk=4, page_size=8)
    server = jg.OpenAIServer(engine, tok, model_name="tiny")
    host, port = server.start()
    client = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="none", max_retries=0, timeout=120)
    yield client, tok, model, server
    server.shutdown()


def test_completions_and_chat_answer_what_the_engine_decodes(served):
    client, tok, model, server = served
    assert server.host == "127.0.0.1"
    assert [m.id for m in client.models.list().data] == ["tiny"]
    out = client.completions.create(model="tiny", prompt="The interpreter", max_tokens=10, temperature=0)
    ids = tok("The interpreter")["input_ids"]
    (ref,) = jg.LLMEngine(model).generate([ids], max_new_tokens=10)
    assert out.choices[0].text == tok.decode(ref.outputs[0].token_ids, skip_special_tokens=True)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 10
    assert out.usage.prompt_tokens == len(ids)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0, n=2
    )
    assert len(chat.choices) == 2 and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy: equal


def test_streaming_gives_the_same_text_in_pieces(served):
    client, *_ = served
    whole = client.completions.create(model="tiny", prompt="A list is", max_tokens=12, temperature=0)
    pieces = list(
        client.completions.create(model="tiny", prompt="A list is", max_tokens=12, temperature=0, stream=True)
    )
    assert "".join(p.choices[0].text for p in pieces) == whole.choices[0].text and len(pieces) > 1
    assert pieces[-1].choices[0].finish_reason == "length"
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0, stream=True
    )
    chunks = list(chat)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason is not None
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    again = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0
    )
    assert text == again.choices[0].message.content


def test_bad_requests_get_a_reason_and_the_server_goes_on(served):
    client, _, _, server = served
    with pytest.raises(openai.BadRequestError, match="temperature = 5.0; expected a value in"):
        client.completions.create(model="tiny", prompt="x", temperature=5)
    with pytest.raises(openai.BadRequestError, match="exceed the model's context of 256"):
        client.completions.create(model="tiny", prompt="x", max_tokens=1000)
    with pytest.raises(openai.NotFoundError, match="'gpt-4' is not served here"):
        client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError, match="messages must be a non-empty list"):
        client.chat.completions.create(model="tiny", messages=[])
    url = f"http://{server.host}:{server.port}/v1/completions"
    bad = urllib.request.Request(url, data=b"{not json", headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(bad, timeout=30)
    assert e.value.code == 400 and "not JSON" in json.loads(e.value.read())["error"]["message"]
    ok = client.completions.create(model="tiny", prompt="still here", max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens == 3


def test_stop_strings_are_never_streamed(served):
    client, *_ = served
    whole = client.completions.create(model="tiny", prompt="The", max_tokens=16, temperature=0).choices[0].text
    stop = whole[len(whole) // 2 : len(whole) // 2 + 3]
    cut = client.completions.create(model="tiny", prompt="The", max_tokens=16, temperature=0, stop=stop)
    assert cut.choices[0].text == whole[: whole.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model="tiny", prompt="The", max_tokens=16, temperature=0, stop=stop, stream=True
    )
    assert "".join(p.choices[0].text for p in streamed) == cut.choices[0].text
