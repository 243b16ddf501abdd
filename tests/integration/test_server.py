"""strata serve end to end on the embedded tiny model: the official openai and anthropic clients
(chat, streaming, usage, tools, completions, messages), raw HTTP for malformed input (bad JSON,
wrong types, huge bodies, slow clients), the API key, CORS, config validation, the prompt cache,
the queue, a client that leaves, SIGTERM, and a small load run (bench/server_load.py)."""
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

ROOT = Path(__file__).resolve().parents[2]
BIN = os.environ.get("STRATA_BIN", str(ROOT / "build" / "strata"))
MODEL = ROOT / "models" / "tiny-coder.gguf"
sys.path.insert(0, str(ROOT / "bench"))
import server_load  # noqa: E402

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, tmp_path, *args, config=None):
        self.port = free_port()
        self.log = tmp_path / f"serve-{self.port}.log"
        cmd = [BIN, "serve", "--model", str(MODEL), "--port", str(self.port), *map(str, args)]
        if config is not None:
            cfg = tmp_path / f"strata-{self.port}.json"
            cfg.write_text(json.dumps(config))
            cmd = [BIN, "serve", "--config", str(cfg), "--port", str(self.port), *map(str, args)]
        self.logf = open(self.log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.logf, stderr=subprocess.STDOUT, cwd=ROOT)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"strata serve exited with {self.proc.returncode}:\n{self.text()}")
            try:
                if self.get("/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        self.proc.kill()
        pytest.fail(f"strata serve did not answer /health:\n{self.text()}")

    def text(self):
        if not self.logf.closed:
            self.logf.flush()
        return self.log.read_text(errors="replace")

    def request(self, method, path, body=None, headers=None, timeout=300):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            if isinstance(body, (dict, list)):
                body = json.dumps(body)
            c.request(method, path, body, headers or {})
            r = c.getresponse()
            data = r.read()
            return r.status, data, dict(r.getheaders())
        finally:
            c.close()

    def get(self, path, headers=None):
        status, data, _ = self.request("GET", path, headers=headers)
        return status, data

    def post_json(self, path, body, headers=None):
        status, data, h = self.request("POST", path, body, {"Content-Type": "application/json", **(headers or {})})
        return status, json.loads(data) if data else None, h

    def stop(self, expect_rc=0):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                rc = self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                pytest.fail(f"strata serve did not exit within 60 s of SIGTERM:\n{self.text()}")
        else:
            rc = self.proc.returncode
        self.logf.close()
        log = self.text()
        assert "AddressSanitizer" not in log and "runtime error" not in log, log[-6000:]
        if expect_rc is not None:
            assert rc == expect_rc, f"exit code {rc}:\n{log[-4000:]}"
        return log

    def metrics(self):
        status, data = self.get("/metrics")
        assert status == 200
        out = {}
        for line in data.decode().splitlines():
            if line and not line.startswith("#"):
                k, v = line.split()
                out[k] = float(v)
        return out


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve"), "--parallel", 2, "--batch", 16, "--timeout", 6)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)


def chat(client, content, **kw):
    kw.setdefault("max_tokens", 8)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], **kw)


# ---------------------------------------------------------------------------------------------
# Information endpoints

def test_health_models_props_status(srv, client):
    assert json.loads(srv.get("/health")[1]) == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-coder"]
    status, data = srv.get("/props")
    props = json.loads(data)
    assert status == 200 and props["model"] == "tiny-coder" and props["n_ctx"] > 0
    assert props["settings"]["parallel"] == 2 and props["settings"]["api_key"] is False
    st = json.loads(srv.get("/status")[1])
    # The exact schema the web page's Monitor reads.
    assert set(st) == {"model", "backend", "ctx", "parallel", "uptime_s", "slots", "queue", "requests", "tokens",
                       "speed", "prompt_cache", "expert_cache", "system"}
    assert st["backend"] in ("cpu", "cuda") and st["parallel"] == 2 and len(st["slots"]) == 2
    assert set(st["slots"][0]) == {"id", "state", "n_past"} and st["slots"][0]["state"] in ("idle", "prompt", "generating")
    assert set(st["queue"]) == {"depth", "limit"} and set(st["requests"]) == {"total", "active", "errors"}
    assert set(st["tokens"]) == {"prompt", "generated"} and set(st["speed"]) == {"prompt_tps", "decode_tps"}
    assert set(st["prompt_cache"]) == {"hits", "misses"} and st["expert_cache"] is None
    assert set(st["system"]) == {"cpu_percent", "ram_used_bytes", "ram_total_bytes", "process_rss_bytes", "gpus"}
    assert st["system"]["gpus"] == [] and st["system"]["ram_total_bytes"] > 0
    m = srv.metrics()
    for k in ("strata_requests_total", "strata_prompt_tokens_total", "strata_generated_tokens_total",
              "strata_queue_depth", "strata_prompt_cache_hits_total", "strata_decode_tokens_per_second"):
        assert k in m


def test_web_page_is_served(srv):
    status, data, h = srv.request("GET", "/")
    assert status == 200 and h["Content-Type"].startswith("text/html") and b"<html" in data.lower()
    assert srv.get("/no-such-file.js")[0] == 404


# ---------------------------------------------------------------------------------------------
# OpenAI chat

def test_chat_usage_and_greedy_determinism(client):
    a = chat(client, "def add(a, b):")
    b = chat(client, "def add(a, b):")  # the second reuses the prompt cache: the same tokens
    assert a.choices[0].message.content and a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].finish_reason == "length"
    assert a.usage.completion_tokens == 8 and a.usage.prompt_tokens > 5
    assert a.usage.total_tokens == a.usage.prompt_tokens + 8


def test_seeded_sampling(client):
    kw = dict(temperature=1.0, top_k=0, top_p=1.0, max_tokens=12)
    a = client.chat.completions.create(model="t", messages=[{"role": "user", "content": "x ="}], seed=7,
                                       extra_body={"top_k": 0, "min_p": 0.0}, **{k: v for k, v in kw.items() if k != "top_k"})
    b = client.chat.completions.create(model="t", messages=[{"role": "user", "content": "x ="}], seed=7,
                                       extra_body={"top_k": 0, "min_p": 0.0}, **{k: v for k, v in kw.items() if k != "top_k"})
    assert a.choices[0].message.content == b.choices[0].message.content


def test_stream_matches_and_reports_usage(client):
    whole = chat(client, "class Stack:", max_tokens=10).choices[0].message.content
    chunks = list(chat(client, "class Stack:", max_tokens=10, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices


def test_content_parts_system_and_penalties(client):
    r = client.chat.completions.create(
        model="t", max_completion_tokens=6, temperature=0, frequency_penalty=0.5, presence_penalty=0.5,
        extra_body={"repetition_penalty": 1.1, "min_p": 0.05, "top_k": 10},
        messages=[{"role": "developer", "content": "You write Python."},
                  {"role": "user", "content": [{"type": "text", "text": "def f():"}, {"type": "text", "text": "pass"}]}])
    assert r.usage.completion_tokens <= 6 and r.choices[0].message.role == "assistant"


def test_stop_string(client):
    full = chat(client, "def fib(n):", max_tokens=24).choices[0].message.content
    words = [w for w in full.split() if w.isalpha() and len(w) > 2]
    if not words:
        pytest.skip("no clean word in the tiny model's answer")
    stop = words[0]
    r = chat(client, "def fib(n):", max_tokens=24, stop=[stop, "zzz-never"])
    assert r.choices[0].finish_reason == "stop"
    assert stop not in r.choices[0].message.content
    assert full.startswith(r.choices[0].message.content.rstrip())


def test_tools_render_and_are_accepted(client):
    plain = chat(client, "What is the weather in Paris?")
    with_tools = chat(client, "What is the weather in Paris?", tools=TOOLS, tool_choice="auto")
    # The tiny template has no tools section: the server puts them in the system message.
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 20
    assert with_tools.choices[0].finish_reason in ("length", "stop", "tool_calls")
    named = chat(client, "Weather?", tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.usage.prompt_tokens > plain.usage.prompt_tokens
    none = chat(client, "What is the weather in Paris?", tools=TOOLS, tool_choice="none")
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    # A conversation that already holds a call and its result renders too.
    r = client.chat.completions.create(model="t", max_tokens=4, temperature=0, tools=TOOLS, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}])
    assert r.usage.completion_tokens <= 4


def test_streamed_tools_and_stream_shapes(srv):
    # Raw SSE: every event is a JSON chunk, the stream ends with [DONE].
    status, data, h = srv.request("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "max_tokens": 6, "stream": True},
        {"Content-Type": "application/json"})
    assert status == 200 and h["Content-Type"] == "text/event-stream"
    events = [e for e in data.decode().split("\n\n") if e.strip() and not e.startswith(":")]
    assert events[-1] == "data: [DONE]"
    for e in events[:-1]:
        assert json.loads(e[len("data: "):])["object"] == "chat.completion.chunk"


def test_json_response_format(srv):
    status, r, _ = srv.post_json("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Give me a JSON object with a key a."}],
        "response_format": {"type": "json_object"}, "max_tokens": 8, "temperature": 0})
    assert status == 200 and isinstance(r["strata_json_valid"], bool)
    status, r, _ = srv.post_json("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}})
    assert status == 400 and r["error"]["param"] == "response_format"


def test_thinking_switches_are_accepted(client):
    r = chat(client, "hi", extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.usage.completion_tokens == 8
    r = chat(client, "hi", reasoning_effort="low")
    assert r.usage.completion_tokens == 8


def test_return_progress(srv):
    long_prompt = "def f(x):\n    return x\n" * 12  # several 16-token chunks (--batch 16)
    status, data, _ = srv.request("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": long_prompt}], "max_tokens": 2, "stream": True,
        "return_progress": True}, {"Content-Type": "application/json"})
    assert status == 200
    chunks = [json.loads(e[6:]) for e in data.decode().split("\n\n") if e.startswith("data: {")]
    progress = [c["prompt_progress"] for c in chunks if "prompt_progress" in c]
    assert len(progress) >= 3
    assert progress[-1]["processed"] == progress[-1]["total"]
    assert all(a["processed"] <= b["processed"] for a, b in zip(progress, progress[1:]))


# ---------------------------------------------------------------------------------------------
# Completions and Anthropic

def test_completions(client):
    r = client.completions.create(model="t", prompt="def fib(n):", max_tokens=6, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text and r.usage.completion_tokens == 6
    s = "".join(c.choices[0].text for c in client.completions.create(
        model="t", prompt="def fib(n):", max_tokens=6, temperature=0, stream=True) if c.choices)
    assert s == r.choices[0].text


def test_anthropic_messages(srv):
    c = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0)
    m = c.messages.create(model="claude-x", max_tokens=8, extra_body={"temperature": 0}, system="You write Python.",
                          messages=[{"role": "user", "content": "def add(a, b):"}])
    assert m.role == "assistant" and m.stop_reason == "max_tokens" and m.usage.output_tokens == 8
    text = "".join(b.text for b in m.content if b.type == "text")
    with c.messages.stream(model="claude-x", max_tokens=8, extra_body={"temperature": 0}, system="You write Python.",
                           messages=[{"role": "user", "content": "def add(a, b):"}]) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text and final.stop_reason == "max_tokens"
    # Tools, a tool_use turn and its tool_result render and are accepted.
    m = c.messages.create(model="claude-x", max_tokens=4, tools=[
        {"name": "get_weather", "description": "weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
        messages=[{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}])
    assert m.usage.output_tokens <= 4
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model="x", max_tokens=4, messages=[{"role": "system", "content": "no"}])
    assert "messages[0].role" in str(e.value)


# ---------------------------------------------------------------------------------------------
# Malformed input

@pytest.mark.parametrize("body,param,words", [
    ('{"messages": [', None, "not valid JSON"),
    ("[1, 2]", None, "JSON object"),
    ({"messages": "hi"}, "messages", "expected an array"),
    ({"messages": []}, "messages", "must not be empty"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages", "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "got an integer"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content", "image_url"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature", "expected a number"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": -1}, "temperature", "not in"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens", "not in"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1.5}, "max_tokens", "expected an integer"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": 5}, "stop", "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 17}, "stop", "at most"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n", "only 1"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream", "boolean"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": {}}, "tools", "expected an array"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools", "tools[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": TOOLS, "tool_choice": "maybe"}, "tool_choice", "maybe"),
    ({"messages": [{"role": "user", "content": "x"}], "seed": "s"}, "seed", "integer"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs", "not supported"),
    ({"messages": [{"role": "user", "content": " ".join(map(str, range(30000)))}]}, "messages", "context"),
])
def test_bad_chat_requests(srv, body, param, words):
    status, data, h = srv.request("POST", "/v1/chat/completions", body if isinstance(body, str) else json.dumps(body),
                                  {"Content-Type": "application/json"})
    assert status == 400, data
    err = json.loads(data)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and words in err["message"], err


def test_bad_requests_other_endpoints(srv, client):
    assert srv.post_json("/v1/completions", {"prompt": 5})[0] == 400
    assert srv.post_json("/v1/completions", {"prompt": [1, 99999999]})[1]["error"]["param"] == "prompt"
    status, r, _ = srv.post_json("/v1/messages", {"messages": [{"role": "user", "content": "x"}]})
    assert status == 400 and r["error"]["param"] == "max_tokens" and r["type"] == "error"
    assert srv.request("GET", "/v1/chat/completions")[0] == 405
    assert srv.request("POST", "/health")[0] == 405
    status, data, _ = srv.request("GET", "/v1/nothing")
    assert status == 404 and json.loads(data)["error"]["type"] == "not_found_error"
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "x", temperature=7000)
    assert "temperature" in str(e.value)


def test_huge_bodies_are_refused(srv):
    big = b'{"messages": [{"role": "user", "content": "' + b"a" * (9 << 20) + b'"}]}'
    status, data, _ = srv.request("POST", "/v1/chat/completions", big, {"Content-Type": "application/json"})
    assert status == 413 and "max-body-mib" in json.loads(data)["error"]["message"]
    # Chunked (no Content-Length): refused once it grows past the limit.
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=60)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
              b"Content-Type: application/json\r\n\r\n")
    piece = b"a" * (1 << 20)
    for _ in range(9):
        s.sendall(b"%x\r\n" % len(piece) + piece + b"\r\n")
    s.sendall(b"0\r\n\r\n")
    reply = s.recv(4096)
    s.close()
    assert b" 413 " in reply.split(b"\r\n")[0]
    assert srv.get("/health")[0] == 200


def test_slow_and_broken_clients(srv):
    # A client that sends half a request and stalls is dropped after --timeout (6 s) ...
    slow = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
    slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"mess")
    t0 = time.monotonic()
    garbage = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
    garbage.sendall(b"\x00\xff GARBAGE \r\n\r\n")
    # ... while others are served meanwhile.
    assert srv.get("/health")[0] == 200
    assert slow.recv(1024) == b""  # closed by the server
    assert 4 < time.monotonic() - t0 < 25
    garbage.close()
    slow.close()
    assert srv.get("/health")[0] == 200


@pytest.mark.parametrize("stream", [True, False])
def test_client_that_leaves_stops_its_generation(srv, stream):
    m0 = srv.metrics()
    before, errors = m0["strata_generated_tokens_total"], m0["strata_requests_errors_total"]
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
    body = json.dumps({"messages": [{"role": "user", "content": "def long():"}], "max_tokens": 3000,
                       "stream": stream, "temperature": 0.7, "seed": 3})
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body.encode())
    if stream:
        s.recv(4096)  # the stream began
    time.sleep(1.0)
    s.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        st = json.loads(srv.get("/status")[1])
        if st["requests"]["active"] == 0 and all(x["state"] == "idle" for x in st["slots"]):
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"the generation went on after the client left: {st}")
    m1 = srv.metrics()
    assert 0 < m1["strata_generated_tokens_total"] - before < 1000
    assert m1["strata_requests_errors_total"] == errors + 1  # cut short, not finished


# ---------------------------------------------------------------------------------------------
# Prompt cache, queue, load

def test_prompt_cache_hit_on_follow_up_turn(srv, client):
    hits = srv.metrics()["strata_prompt_cache_hits_total"]
    msgs = [{"role": "system", "content": "You are a careful Python programmer. " * 8},
            {"role": "user", "content": "Write a function that reverses a string."}]
    a = client.chat.completions.create(model="t", messages=msgs, max_tokens=8, temperature=0)
    msgs += [{"role": "assistant", "content": a.choices[0].message.content},
             {"role": "user", "content": "Now make it handle None."}]
    b = client.chat.completions.create(model="t", messages=msgs, max_tokens=8, temperature=0)
    cached = b.usage.prompt_tokens_details.cached_tokens
    assert cached >= a.usage.prompt_tokens - 2, (cached, a.usage.prompt_tokens)  # the whole first turn
    assert srv.metrics()["strata_prompt_cache_hits_total"] >= hits + 1
    # The answer is the one a cold read gives (the cache restores the exact state).
    cold = Server(srv.log.parent, "--prompt-cache", 0)
    try:
        c2 = openai.OpenAI(base_url=cold.url + "/v1", api_key="none", max_retries=0)
        r = c2.chat.completions.create(model="t", messages=msgs, max_tokens=8, temperature=0)
        assert r.usage.prompt_tokens_details.cached_tokens == 0
        assert r.choices[0].message.content == b.choices[0].message.content
    finally:
        cold.stop()


def test_queue_overflow_answers_503(tmp_path):
    s = Server(tmp_path, "--parallel", 1, "--queue", 1)
    try:
        results = []

        def one():
            results.append(s.post_json("/v1/chat/completions", {
                "messages": [{"role": "user", "content": "def x():"}], "max_tokens": 40, "temperature": 0}))
        threads = [threading.Thread(target=one) for _ in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        codes = sorted(r[0] for r in results)
        assert codes.count(200) >= 2 and 503 in codes, codes
        busy = [r for r in results if r[0] == 503][0]
        assert busy[2].get("Retry-After") and busy[1]["error"]["type"] == "overloaded_error"
    finally:
        s.stop()


def test_small_load_all_answered(srv):
    r = server_load.run_load("127.0.0.1", srv.port, n_requests=20, n_clients=4, max_tokens=6, prompts=server_load.PROMPTS[:6])
    assert r["failures"] == [] and r["ok"] == 20


# ---------------------------------------------------------------------------------------------
# API key, CORS, config, shutdown

def test_api_key(tmp_path):
    s = Server(tmp_path, "--api-key", "sekrit")
    try:
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        assert s.post_json("/v1/chat/completions", body)[0] == 401
        assert s.post_json("/v1/chat/completions", body, {"Authorization": "Bearer wrong"})[0] == 401
        assert s.post_json("/v1/chat/completions", body, {"Authorization": "Bearer sekrit"})[0] == 200
        assert s.post_json("/v1/messages", {**body, "max_tokens": 2}, {"x-api-key": "sekrit"})[0] == 200
        for path in ("/v1/models", "/metrics", "/status", "/props"):
            assert s.get(path)[0] == 401
            assert s.get(path, {"Authorization": "Bearer sekrit"})[0] == 200
        assert s.get("/health")[0] == 200 and s.get("/")[0] == 200  # the page loads, then asks for the key
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="sekrit", max_retries=0)
        assert chat(c, "x", max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            chat(openai.OpenAI(base_url=s.url + "/v1", api_key="nope", max_retries=0), "x")
    finally:
        s.stop()


def test_cors_and_config_file(tmp_path):
    # The keys setup writes (and a few more); the --port flag wins over the config's port. The
    # model is read into memory (no_mmap) instead of mapped.
    cfg = {"model": str(MODEL), "gpu": "cpu", "host": "127.0.0.1", "port": 1, "parallel": 1, "ctx": 2048, "api_key": "",
           "cors_origins": ["http://allowed.example"], "sampling": {"temperature": 0}, "no_mmap": True,
           "args": ["--queue", "3", "--no-mmap"]}
    s = Server(tmp_path, config=cfg)
    try:
        props = json.loads(s.get("/props")[1])
        assert props["n_ctx"] == 2048 and props["settings"]["queue"] == 3 and props["settings"]["port"] == s.port
        assert props["settings"]["sampling"]["temperature"] == 0
        ok = s.request("OPTIONS", "/v1/chat/completions", headers={
            "Origin": "http://allowed.example", "Access-Control-Request-Method": "POST"})
        assert ok[0] == 204 and ok[2]["Access-Control-Allow-Origin"] == "http://allowed.example"
        bad = s.request("OPTIONS", "/v1/chat/completions", headers={"Origin": "http://evil.example"})
        assert bad[0] == 403 and "Access-Control-Allow-Origin" not in bad[2]
        status, _, h = s.post_json("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
                                   {"Origin": "http://allowed.example"})
        assert status == 200 and h["Access-Control-Allow-Origin"] == "http://allowed.example"
        status, _, h = s.post_json("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
                                   {"Origin": "http://evil.example"})
        assert "Access-Control-Allow-Origin" not in h
    finally:
        s.stop()


def test_config_validation_names_every_problem(tmp_path):
    cfg = tmp_path / "strata-bad.json"
    cfg.write_text(json.dumps({"model": str(MODEL), "port": 70000, "kv": "q4", "parallel": "two", "colour": "red",
                               "gpu": "fast", "sampling": {"top_p": 2, "warmth": 1}, "cors_origins": "x",
                               "no_mmap": "yes", "args": ["--ctx", "many", "--bogus", "1"]}))
    t0 = time.monotonic()
    r = subprocess.run([BIN, "serve", "--config", str(cfg)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and time.monotonic() - t0 < 30
    for words in ("port: 70000", "kv:", "parallel:", "colour: unknown key", "gpu:", "sampling.top_p", "sampling.warmth",
                  "cors_origins:", "no_mmap: expected true or false", "args[0] --ctx 'many'", "args[2] --bogus",
                  "11 problems"):
        assert words in r.stderr, (words, r.stderr)
    assert "loading" not in r.stderr  # checked before the model loads
    cfg.write_text("{\"port\": 1,")
    r = subprocess.run([BIN, "serve", "--config", str(cfg)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "not valid JSON" in r.stderr
    r = subprocess.run([BIN, "serve", "--model", "/nonexistent.gguf", "--port", "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "/nonexistent.gguf" in r.stderr and "port" in r.stderr
    r = subprocess.run([BIN, "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--max-body-mib" in r.stdout and "--config" in r.stdout


def test_sigterm_drains_and_exits_cleanly(tmp_path):
    s = Server(tmp_path)
    got = {}

    def long_request():
        got["r"] = s.post_json("/v1/chat/completions", {"messages": [{"role": "user", "content": "def x():"}],
                                                        "max_tokens": 40, "temperature": 0})
    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 30
    while json.loads(s.get("/status")[1])["requests"]["active"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    s.proc.send_signal(signal.SIGTERM)
    t.join(60)
    assert got["r"][0] == 200 and got["r"][1]["usage"]["completion_tokens"] == 40  # finished, not cut
    log = s.stop()
    assert "SIGTERM" in log and "stopped" in log
