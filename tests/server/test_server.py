"""`kiln serve` end to end: a real server subprocess (default SmolLM2, fp32 CPU) and the openai client."""

import json
import os
import re
import subprocess
import sys
import time

import httpx
import pytest

# the client these tests drive (CI installs it; the GPU machines have none: `pytest -m gpu tests` skips them)
openai = pytest.importorskip("openai")
from tests.kiln_server import free_port, kiln_server

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = "SmolLM2-135M-Instruct"
LONG_PROMPT = "Here is a list of facts about rivers, mountains and oceans of the world. " * 8


SERVER = {}


@pytest.fixture(scope="module")
def server():
    with kiln_server(["--device", "cpu", "--log-level", "warning"]) as (url, proc):
        SERVER["proc"] = proc
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


def metric(server: str, name: str) -> float:
    text = httpx.get(server + "/metrics").text
    m = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def chat_args(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "Name three colors."}],
            "max_tokens": 16, "temperature": 0.0, **kw}


def test_chat_and_streaming_agree(client):
    full = client.chat.completions.create(**chat_args())
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert full.usage.prompt_tokens > 0 and 0 < full.usage.completion_tokens <= 16
    chunks = list(client.chat.completions.create(**chat_args(), stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completions_and_streaming_agree(client):
    args = {"model": MODEL, "prompt": "The three primary colors are", "max_tokens": 12, "temperature": 0.0}
    full = client.completions.create(**args)
    text = "".join(c.choices[0].text for c in client.completions.create(**args, stream=True) if c.choices)
    assert full.choices[0].text and text == full.choices[0].text
    batch = client.completions.create(**{**args, "prompt": ["Hello", "The sky is"], "n": 2})
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]


def test_n_choices(client):
    out = client.chat.completions.create(**chat_args(temperature=1.0, n=3, seed=7))
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert len({c.message.content for c in out.choices}) > 1


def test_stop_string(client):
    base = client.chat.completions.create(**chat_args(max_tokens=24)).choices[0].message.content
    word = base.split()[2]
    out = client.chat.completions.create(**chat_args(max_tokens=24, stop=[word])).choices[0]
    assert out.finish_reason == "stop" and out.message.content == base[: base.index(word)]


def test_logprobs(client):
    out = client.chat.completions.create(**chat_args(max_tokens=5, logprobs=True, top_logprobs=3))
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.bytes and bytes(entry.bytes).decode(errors="replace") == entry.token
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely
    text = "".join(e.token for e in content)
    assert text.startswith(out.choices[0].message.content[:3])
    comp = client.completions.create(model=MODEL, prompt="One, two,", max_tokens=4, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4


def test_cached_tokens_on_repeated_prompt(client):
    args = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 2, "temperature": 0.0}
    client.completions.create(**args)
    again = client.completions.create(**args)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


def test_models(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    # The model path is accepted as a name too.
    root = httpx.get(server + "/v1/models").json()["data"][0]["root"]
    assert client.chat.completions.create(**{**chat_args(max_tokens=2), "model": root}).choices


def test_generate_native(server):
    r = httpx.post(server + "/generate", json={
        "input_ids": [504, 3458, 282], "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    meta = body["meta_info"]
    assert len(body["output_ids"]) == meta["completion_tokens"] == 4
    assert meta["prompt_tokens"] == 3 and meta["finish_reason"]["type"] == "length"
    assert [e[1] for e in meta["output_token_logprobs"]] == body["output_ids"]
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])
    assert len(meta["input_token_logprobs"]) == 3 and meta["input_token_logprobs"][0][0] is None
    r = httpx.post(server + "/generate", json={"text": ["Hi", "Yo"], "sampling_params": {"max_new_tokens": 2}},
                   timeout=60)
    assert r.status_code == 200 and len(r.json()) == 2 and all("text" in x for x in r.json())


def test_metrics_and_flush(server, client):
    client.chat.completions.create(**chat_args(max_tokens=2))  # tokens to count, whatever ran before
    text = httpx.get(server + "/metrics").text
    for name in ("kiln_num_running_reqs", "kiln_num_queue_reqs", "kiln_generation_tokens_total",
                 "kiln_prompt_tokens_total", "kiln_cached_tokens_total", "kiln_cache_hit_rate",
                 "kiln_kv_usage", "kiln_gen_throughput"):
        assert re.search(rf"^{name} ", text, re.MULTILINE), name
    assert metric(server, "kiln_generation_tokens_total") > 0
    assert httpx.post(server + "/flush_cache").json()["success"]
    assert httpx.get(server + "/flush_cache").status_code == 200
    info = httpx.get(server + "/model_info").json()
    assert info["served_model_name"] == MODEL and info["context_length"] > 0
    assert httpx.get(server + "/server_info").status_code == 200


CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


def test_structured_output(client, server):
    """response_format (json_schema, json_object) on the OpenAI routes and SGLang's regex on
    /generate constrain what the real model writes."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 10**8}},
              "required": ["city", "population"], "additionalProperties": False}
    out = client.chat.completions.create(**chat_args(
        messages=[{"role": "user", "content": "Give the largest city of France as JSON."}], max_tokens=48,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}))
    assert out.choices[0].finish_reason == "stop"  # bounded fields: the schema's end comes within max_tokens
    value = json.loads(out.choices[0].message.content)
    assert set(value) == {"city", "population"} and 0 <= value["population"] <= 10**8
    out = client.chat.completions.create(**chat_args(max_tokens=48, response_format={"type": "json_object"}))
    assert out.choices[0].finish_reason == "stop" and isinstance(json.loads(out.choices[0].message.content), dict)
    r = httpx.post(server + "/generate", json={"text": "My phone number is", "sampling_params": {
        "max_new_tokens": 16, "temperature": 0, "regex": r" \d{3}-\d{4}"}}, timeout=60)
    assert r.status_code == 200, r.text
    assert re.fullmatch(r" \d{3}-\d{4}", r.json()["text"]), r.json()["text"]


def test_tool_choice_forces_tool_calls(client):
    """tool_choice "required" and a named function make the real model's answer tool calls (the
    answer constrained to the tools' schemas), with no --tool-call-parser."""
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
    clock = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
    ask = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(**chat_args(messages=ask, max_tokens=48, tools=[weather, clock],
                                                     tool_choice=named))
    (call,) = out.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and set(args) == {"city", "days"} and 1 <= args["days"] <= 7
    assert out.choices[0].finish_reason == "tool_calls"
    # parallel_tool_calls=False: one call (SmolLM2 repeats the same call until max_tokens otherwise)
    out = client.chat.completions.create(**chat_args(messages=ask, max_tokens=96, tools=[weather, clock],
                                                     tool_choice="required", parallel_tool_calls=False))
    calls = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and len(calls) == 1, out.choices[0].message.content
    for c in calls:
        args = json.loads(c.function.arguments)
        assert (c.function.name, set(args)) in (("get_weather", {"city", "days"}), ("get_time", {"zone"}))


def test_logit_bias(client, server):
    """OpenAI's logit_bias on /v1/completions and SGLang's on /generate: +100 forces a token."""
    out = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=3, temperature=0.0,
                                    logit_bias={"42": 100}, logprobs=0)
    assert out.choices[0].logprobs.tokens == [out.choices[0].logprobs.tokens[0]] * 3
    r = httpx.post(server + "/generate", json={"text": "The sky is", "sampling_params": {
        "max_new_tokens": 3, "temperature": 0, "logit_bias": {"42": 100}}}, timeout=60)
    assert r.status_code == 200 and r.json()["output_ids"] == [42, 42, 42], r.text


def test_completions_echo_scores_the_prompt(client, server):
    """echo=true with logprobs (what lm-eval-harness's loglikelihood requests send): the prompt
    comes back ahead of the completion, its tokens with the logprobs /generate reports for it
    (the first token has none), streamed or not."""
    prompt = "The capital of France is Paris"
    args = dict(model=MODEL, prompt=prompt, max_tokens=1, temperature=0.0, logprobs=1, echo=True)
    out = client.completions.create(**args)
    choice = out.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(prompt) and len(lp.tokens) == out.usage.prompt_tokens + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens) == choice.text and lp.text_offset[0] == 0
    assert all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens))
    r = httpx.post(server + "/generate", json={"text": prompt, "return_logprob": True, "logprob_start_len": 0,
                                               "sampling_params": {"max_new_tokens": 1, "temperature": 0}}, timeout=60)
    want = [e[0] for e in r.json()["meta_info"]["input_token_logprobs"]]
    assert lp.token_logprobs[1:-1] == pytest.approx(want[1:], abs=1e-4)
    streamed = list(client.completions.create(**args, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice.text
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == lp.tokens
    plain = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2, temperature=0.0, echo=True)
    assert plain.choices[0].text.startswith(httpx.post(server + "/detokenize", json={"tokens": [1, 2, 3]}).json()["text"])


def test_tokenize_gives_what_generation_prefills(client, server):
    """/tokenize's ids are the ones the generation endpoints prefill, and /detokenize inverts them."""
    text = "The sky is"
    r = httpx.post(server + "/tokenize", json={"prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    done = client.completions.create(model=MODEL, prompt=text, max_tokens=1, temperature=0.0)
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"]) == done.usage.prompt_tokens
    assert body["max_model_len"] == httpx.get(server + "/v1/models").json()["data"][0]["max_model_len"]
    native = httpx.post(server + "/generate", json={"input_ids": body["tokens"], "sampling_params": {
        "max_new_tokens": 4, "temperature": 0}}).json()
    assert native["text"] == client.completions.create(model=MODEL, prompt=text, max_tokens=4,
                                                       temperature=0.0).choices[0].text
    back = httpx.post(server + "/detokenize", json={"tokens": body["tokens"]}).json()
    assert back["text"] == back["prompt"] == text
    # the chat form: the ids /v1/chat/completions prefills; without the generation prompt, fewer
    chat = httpx.post(server + "/v1/tokenize", json={"messages": MSG, "model": MODEL}).json()
    assert chat["count"] == client.chat.completions.create(
        model=MODEL, messages=MSG, max_tokens=1).usage.prompt_tokens
    bare = httpx.post(server + "/tokenize", json={"messages": MSG, "add_generation_prompt": False}).json()
    assert chat["tokens"][:bare["count"]] == bare["tokens"] and bare["count"] < chat["count"]
    # batches give lists, in order
    batch = httpx.post(server + "/tokenize", json={"prompt": [text, "Hello"]}).json()
    assert batch["tokens"][0] == body["tokens"] and batch["count"] == [len(t) for t in batch["tokens"]]
    texts = httpx.post(server + "/v1/detokenize", json={"tokens": batch["tokens"]}).json()["text"]
    assert texts == [text, "Hello"]
    # special tokens: kept or dropped on request
    special = chat["tokens"][0]
    assert httpx.post(server + "/detokenize", json={"tokens": [special]}).json()["text"] == ""
    assert httpx.post(server + "/detokenize", json={"tokens": [special], "skip_special_tokens": False}
                      ).json()["text"].startswith("<|")


BAD_INPUTS = [
    (CHAT, b'{"messages": [', "not valid JSON"),
    (CHAT, b'[1, 2]', "Input should be a valid dictionary"),
    (CHAT, {"messages": MSG, "temperature": "hot"}, "temperature"),
    (CHAT, {"messages": "hello"}, "messages"),
    (CHAT, {"max_tokens": 4}, "'messages' is required"),
    (CHAT, {"messages": []}, "'messages' is empty"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "text parts only"),
    (CHAT, {"messages": [{"role": "user", "content": "word " * 9000}]}, "context length"),
    (CHAT, {"messages": MSG, "max_tokens": 0}, "max_tokens must be"),
    (CHAT, {"messages": MSG, "max_tokens": -5}, "max_tokens must be"),
    (CHAT, {"messages": MSG, "temperature": -1}, "temperature must be"),
    (CHAT, {"messages": MSG, "top_p": 1.5}, "top_p must be"),
    (CHAT, {"messages": MSG, "top_k": -3}, "top_k must be"),
    (CHAT, {"messages": MSG, "n": 0}, "n must be"),
    (CHAT, {"messages": MSG, "presence_penalty": 5}, "presence_penalty must be"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 99}, "logprobs must be"),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, "needs logprobs=true"),
    (CHAT, {"messages": MSG, "stop_token_ids": [10**7]}, "stop_token_ids"),
    (CHAT, {"messages": MSG, "model": "gpt-17"}, "does not exist"),
    ("/v1/completions", {"prompt": ""}, "prompt is empty"),
    ("/v1/completions", {"prompt": []}, "'prompt' is empty"),
    ("/v1/completions", {"prompt": [[1, 2], [99999999]]}, "token ids must be"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ("/generate", {"sampling_params": {"max_new_tokens": 2}}, "exactly one of"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 0}}, "max_tokens must be"),
    ("/generate", {"text": "hi", "sampling_params": {"regex": "(oops"}}, "regex does not compile"),
    ("/generate", {"text": "hi", "sampling_params": {"regex": "a", "ebnf": "root ::= \"a\""}}, "at most one of"),
    (CHAT, {"messages": MSG, "response_format": {"type": "yaml"}}, "'yaml' is not supported"),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_schema"}}, "json_schema needs"),
    (CHAT, {"messages": MSG, "tool_choice": "required"}, "has no tools"),
    (CHAT, {"messages": MSG, "logit_bias": {"abc": 1}}, "logit_bias keys must be token ids"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999999": 5}}, "logit_bias keys must be token ids in"),
    ("/generate", {"text": "hi", "sampling_params": {"logit_bias": {"3": 500}}}, "logit_bias values must be in"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}}}, "'g', which is not in tools (f)"),
    ("/tokenize", {}, "exactly one of 'prompt'"),
    ("/tokenize", {"prompt": "hi", "messages": MSG}, "exactly one of 'prompt'"),
    ("/tokenize", {"prompt": "hi", "model": "gpt-17"}, "does not exist"),
    ("/v1/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ("/detokenize", {"tokens": [1, -2]}, "Token ids must be integers in [0, "),
    ("/detokenize", {"tokens": [[1], [10**7]]}, "in tokens[1]"),
    ("/detokenize", {"tokens": "hello"}, "tokens"),
]


@pytest.mark.parametrize("path, body, match", BAD_INPUTS, ids=[f"{i}-{b[2][:20]}" for i, b in enumerate(BAD_INPUTS)])
def test_bad_input_is_400(server, path, body, match):
    if isinstance(body, bytes):
        r = httpx.post(server + path, content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(server + path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == 400
    assert match in err["message"], err["message"]


def test_openai_client_sees_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="top_p must be"):
        client.chat.completions.create(**chat_args(top_p=7))


def test_still_serving_after_bad_inputs(client, server):
    assert client.chat.completions.create(**chat_args(max_tokens=4)).choices[0].message.content
    assert metric(server, "kiln_num_running_reqs") == 0


def wait_idle(server: str, timeout: float = 15.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if metric(server, "kiln_num_running_reqs") == 0 and metric(server, "kiln_num_queue_reqs") == 0:
            return True
        time.sleep(0.2)
    return False


def test_streaming_disconnect_aborts(server):
    before = metric(server, "kiln_generation_tokens_total")
    body = {"model": MODEL, "messages": MSG, "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server + CHAT, json=body, timeout=60) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen += 1
                if seen == 3:
                    break
    assert wait_idle(server), "the disconnected stream's request is still running"
    assert metric(server, "kiln_generation_tokens_total") - before < 1000


def test_non_streaming_disconnect_aborts(server):
    before = metric(server, "kiln_generation_tokens_total")
    body = {"model": MODEL, "messages": MSG, "max_tokens": 4000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + CHAT, json=body, timeout=httpx.Timeout(60, read=1.5))
    assert wait_idle(server), "the disconnected request is still running"
    assert metric(server, "kiln_generation_tokens_total") - before < 1000


def test_abort_request_endpoint(server):
    import threading

    result = {}

    def run():
        result["r"] = httpx.post(server + "/generate", json={
            "text": "Tell me a story.", "rid": "abort-me",
            "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}, timeout=60)

    t = threading.Thread(target=run)
    t.start()
    deadline = time.time() + 10
    while time.time() < deadline and metric(server, "kiln_num_running_reqs") == 0:
        time.sleep(0.1)
    assert httpx.post(server + "/abort_request", json={"rid": "abort-me"}).json()["success"]
    t.join(30)
    meta = result["r"].json()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 4000
    assert wait_idle(server)


def test_api_key(smollm2_source, tmp_path):
    """--api-key: 401 in OpenAI's shape without the key, through the app (no engine needed)."""
    from fastapi.testclient import TestClient

    from kiln.config import EngineConfig
    from kiln.engine.core import ModelInfo
    from kiln.server.app import create_app
    from kiln.server.tokenizer_manager import TokenizerManager

    config = EngineConfig(api_key="sekret")
    info = ModelInfo(MODEL, smollm2_source.model_dir, 49152, 8192, [2])
    tm = TokenizerManager(config, info, f"ipc://{tmp_path}/a", f"ipc://{tmp_path}/b")
    with TestClient(create_app(config, tm)) as c:
        r = c.get("/v1/models")
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
        assert c.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer sekret"}).json()["data"][0]["id"] == MODEL
        assert c.get("/health").status_code == 200


@pytest.mark.parametrize("flags, match", [
    (["--model-path", "/does/not/exist"], "does not exist"),
    (["--max-total-tokens", "1"], "The engine failed to start"),  # raised in the engine process
])
def test_startup_errors_are_reported(flags, match):
    r = subprocess.run([sys.executable, "-m", "kiln", "serve", "--port", str(free_port()), "--device", "cpu",
                        "--log-level", "warning", *flags], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and match in r.stderr, r.stderr[-2000:]


def child_pids(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return out


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc")
def test_sigterm_stops_server_and_engine(server):
    """Runs last: SIGTERM ends the API process and its engine process."""
    proc = SERVER["proc"]
    children = child_pids(proc.pid)
    assert children, "the engine process should be a child of the server"
    proc.terminate()
    assert proc.wait(timeout=30) is not None
    deadline = time.time() + 15
    while time.time() < deadline and any(os.path.exists(f"/proc/{c}") for c in children):
        time.sleep(0.2)
    assert not any(os.path.exists(f"/proc/{c}") for c in children), "the engine outlived the server"
