"""response_format json_object end to end on the embedded tiny model (which is poor at JSON): with
decoding constrained, every reply that ended by completion parses as one JSON object, whatever the
seed and temperature, streamed or not; a reply cut by max_tokens is reported (finish_reason
"length", strata_json_valid false)."""
import json

import pytest

from test_server import Server  # the same server harness (start, /health wait, ASan log check)

openai = pytest.importorskip("openai")

PROMPTS = ["Give me a JSON object describing a cat.", "List three colors.", "def add(a, b):"]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve-json"), "--parallel", 2, "--batch", 16, "--timeout", 6)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)


def ask(srv, prompt, **kw):
    body = {"messages": [{"role": "user", "content": prompt}], "response_format": {"type": "json_object"}, **kw}
    status, r, _ = srv.post_json("/v1/chat/completions", body)
    assert status == 200, r
    return r


def test_completed_replies_are_json_objects(srv):
    completed = 0
    for i, (seed, temperature) in enumerate([(s, t) for s in (1, 2, 3) for t in (0, 0.7, 1.0, 1.5)]):
        r = ask(srv, PROMPTS[i % len(PROMPTS)], seed=seed, temperature=temperature, top_p=0.95, max_tokens=160)
        choice = r["choices"][0]
        content = choice["message"]["content"]
        if choice["finish_reason"] == "stop":
            completed += 1
            assert isinstance(json.loads(content), dict), content
            assert r["strata_json_valid"] is True
        else:
            assert choice["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 160
            assert r["strata_json_valid"] is False
            assert content.lstrip().startswith("{"), content  # a prefix of an object, nothing else
    assert completed >= 3  # the tiny model closes most objects well within the limit


def test_max_tokens_cut_is_reported(srv):
    r = ask(srv, PROMPTS[0], temperature=0, max_tokens=4)
    choice = r["choices"][0]
    assert choice["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 4
    assert r["strata_json_valid"] is False
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice["message"]["content"])


def test_streamed_reply_is_json(client):
    for seed in (5, 6):
        chunks = list(client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": PROMPTS[seed % 3]}], stream=True, seed=seed,
            temperature=1.0, max_tokens=160, response_format={"type": "json_object"}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        if finish == ["stop"]:
            assert isinstance(json.loads(text), dict), text
        else:
            assert finish == ["length"] and text.lstrip().startswith("{")


def test_thinking_is_off_and_text_format_unconstrained(srv):
    # Asking for thinking changes nothing: the answer is the object alone, no reasoning.
    r = ask(srv, PROMPTS[0], temperature=0, max_tokens=160, chat_template_kwargs={"enable_thinking": True})
    msg = r["choices"][0]["message"]
    assert not msg.get("reasoning_content")
    if r["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(msg["content"]), dict)
    # Without response_format the same request is free text (the constraint is per request).
    status, r, _ = srv.post_json("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "def add(a, b):"}], "temperature": 0, "max_tokens": 8})
    assert status == 200 and "strata_json_valid" not in r
