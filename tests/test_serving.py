"""The OpenAI-compatible server on loopback (an ephemeral port, the bundled target): what the openai client parses,
greedy over HTTP == lab.generate, many streams at once, hang-ups, malformed requests, the queue bound; the load test."""
import asyncio
import copy
import json
import time
from contextlib import contextmanager

import httpx
import openai
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import infopt_lab as lab
from infopt_lab.serving import ApiError, AsyncEngine, build_app, parse, running
from infopt_lab.serving.loadtest import Result, knee, loadtest, summarize
from infopt_lab.serving.prometheus import Histogram
from infopt_lab.serving.protocol import FIELDS

PROMPTS = ["def fib(n):", "import os\n\n\ndef read_file(path):", "class Stack:\n    def __init__(self):", "x = 1",
           "    for i in range(len(items)):", "try:\n    import threading", "SEP = '/'", "while True:"]
TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def target():
    return lab.load_model("target", dtype=torch.float32)      # fp32: batched == alone exactly


@contextmanager
def server(model, tok, max_waiting: int = 256, **engine_kw):
    """A server for `model` on 127.0.0.1 and a free port, stopped on exit: (base URL, its AsyncEngine)."""
    app = build_app(lab.Engine(model, tok, **engine_kw), "target", max_waiting)
    with running(app) as url:
        yield url, app.state.engine


@pytest.fixture(scope="module")
def served(target):
    with server(*target, max_batch_size=8) as s:
        yield s


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0, timeout=TIMEOUT_S)


def wait_until(condition, what: str, timeout_s: float = TIMEOUT_S) -> None:
    """Poll until `condition()` holds; fail naming `what` after timeout_s (a bound, never a measurement)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# -- what the openai client parses; equality with lab.generate ------------------------------------------
def test_greedy_over_http_equals_generate_one_request_at_a_time(served, target):
    model, tok = target
    url, _ = served
    c = client(url)
    for prompt, n in zip(PROMPTS, [24, 5, 40, 17]):
        for ignore_eos in (True, False):
            ref = lab.generate(model, tok, prompt, max_new_tokens=n, stop_at_eos=not ignore_eos)
            r = c.completions.create(model="target", prompt=prompt, max_tokens=n, temperature=0,
                                     extra_body={"ignore_eos": ignore_eos, "return_token_ids": True})
            assert r.choices[0].model_extra["token_ids"] == ref.token_ids
            assert r.choices[0].text == ref.text
            assert r.usage.completion_tokens == len(ref.token_ids)
            assert r.usage.prompt_tokens == len(tok.encode(prompt))
            assert r.choices[0].finish_reason == ("length" if len(ref.token_ids) == n and (
                ignore_eos or ref.token_ids[-1] != tok.eos_token_id) else "stop")


def test_stream_parses_one_chunk_per_token_then_usage(served, target):
    model, tok = target
    url, _ = served
    ref = lab.generate(model, tok, PROMPTS[0], max_new_tokens=30, stop_at_eos=False)
    chunks = list(client(url).completions.create(model="target", prompt=PROMPTS[0], max_tokens=30, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    tokens, usage = chunks[:-1], chunks[-1]
    assert len(tokens) == 30 and all(len(ch.choices) == 1 for ch in tokens)
    assert "".join(ch.choices[0].text for ch in tokens) == ref.text
    assert [ch.choices[0].finish_reason for ch in tokens] == [None] * 29 + ["length"]
    assert usage.choices == [] and usage.usage.completion_tokens == 30
    assert usage.usage.prompt_tokens == len(tok.encode(PROMPTS[0]))
    assert len({ch.id for ch in chunks}) == 1


def test_chat_through_the_template_whole_and_streamed(target):
    model, tok = target
    tok = copy.deepcopy(tok)
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    ids = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)
    ref = lab.Engine(model, tok).generate([ids], max_new_tokens=12, stop_at_eos=False)[0]   # engine == generate
    with server(model, tok) as (url, _):
        c = client(url)
        whole = c.chat.completions.create(model="target", messages=messages, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
        streamed = list(c.chat.completions.create(model="target", messages=messages, max_completion_tokens=12,
                                                  temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert whole.choices[0].message.content == ref.text and whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(ids)
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content for ch in streamed if ch.choices) == ref.text
    assert streamed[-1].usage.completion_tokens == 12


def test_models_health_and_metrics(served):
    url, _ = served
    assert [m.id for m in client(url).models.list().data] == ["target"]
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    before = metric(url, 'vllm:time_to_first_token_seconds_count{model_name="target"}')
    client(url).completions.create(model="target", prompt="x = 1", max_tokens=3)
    text = httpx.get(url + "/metrics").text
    assert metric(url, 'vllm:time_to_first_token_seconds_count{model_name="target"}') == before + 1
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_hits_total", "vllm:time_per_output_token_seconds_bucket"):
        assert f"\n{name}{{" in text


def metric(url: str, sample: str) -> float:
    """One sample's value from /metrics."""
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{sample} not in /metrics")


# -- load and faults -------------------------------------------------------------------------------------
def test_64_concurrent_streams_complete_with_correct_usage(served, target):
    model, tok = target
    url, _ = served
    longest = {p: lab.generate(model, tok, p, max_new_tokens=48, stop_at_eos=False).token_ids for p in PROMPTS}
    jobs = [(PROMPTS[i % 8], 8 + (5 * i) % 41) for i in range(64)]

    async def one(c, prompt, n):
        chunks = [ch async for ch in await c.completions.create(
            model="target", prompt=prompt, max_tokens=n, temperature=0, stream=True, extra_body={"ignore_eos": True})]
        return "".join(ch.choices[0].text for ch in chunks if ch.choices), sum(bool(ch.choices) for ch in chunks), \
            chunks[-1].usage

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0, timeout=TIMEOUT_S) as c:
            return await asyncio.gather(*(one(c, p, n) for p, n in jobs))

    for (prompt, n), (text, chunks, usage) in zip(jobs, asyncio.run(all_at_once())):
        assert chunks == usage.completion_tokens == n
        assert usage.prompt_tokens == len(tok.encode(prompt))
        assert text == tok.decode(longest[prompt][:n], skip_special_tokens=True)     # greedy: a prefix of the longest


def test_clients_that_hang_up_leave_no_blocks_in_use(served):
    url, aengine = served
    blocks = aengine.engine.blocks
    idle, aborted = blocks.num_used, aengine.metrics.aborted
    for i in range(20):
        with httpx.Client(timeout=TIMEOUT_S) as c, c.stream(
                "POST", url + "/v1/completions", json={"prompt": PROMPTS[i % 8], "max_tokens": 400,
                                                       "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")         # a token arrived; then the client goes away
    wait_until(lambda: aengine.metrics.aborted == aborted + 20, "20 aborts")
    wait_until(lambda: not aengine.streams and blocks.num_used == idle, "the blocks to be freed")
    assert aengine.engine.sequences == {}
    assert client(url).completions.create(model="target", prompt="x", max_tokens=2).usage.completion_tokens >= 1


def test_queue_bound_answers_429_with_retry_after(target):
    with server(*target, max_waiting=2, max_batch_size=1) as (url, aengine):
        async def flood():
            async with httpx.AsyncClient(timeout=TIMEOUT_S) as c:
                body = {"prompt": "def f():", "max_tokens": 200, "ignore_eos": True}
                return await asyncio.gather(*(c.post(url + "/v1/completions", json=body) for _ in range(10)))
        answers = asyncio.run(flood())
    codes = sorted(r.status_code for r in answers)
    assert set(codes) == {200, 429}, codes
    refused = [r for r in answers if r.status_code == 429]
    assert all(r.headers["retry-after"] == "1" and "already waiting" in r.json()["error"]["message"] for r in refused)


def test_an_engine_loop_not_running_answers_503(target):
    engine = AsyncEngine(lab.Engine(*target))      # never started

    async def submit():
        return engine.submit(parse({"prompt": "x"}, "completion", "target"))
    with pytest.raises(ApiError) as e:
        asyncio.run(submit())
    assert e.value.status == 503 and e.value.headers == {"Retry-After": "5"}


# -- malformed requests: each a 4xx with a JSON error, and the server keeps serving --------------------------
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                    max_leaves=6)
NOT_INT = st.text(max_size=5) | st.floats(allow_nan=False) | st.booleans() | st.lists(st.integers(), max_size=2)
BAD = {   # field -> values that are wrong for it (type or range)
    "max_tokens": NOT_INT.filter(lambda v: v is not None) | st.integers(max_value=0) | st.integers(2000, 10**30),
    "temperature": st.text(max_size=5) | st.booleans() | st.floats(max_value=-1e-6) | st.lists(st.floats(), max_size=1),
    "top_p": st.floats(max_value=0.0) | st.floats(min_value=1.0001) | st.text(max_size=3) | st.booleans(),
    "top_k": st.integers(max_value=-2) | st.floats(allow_nan=False) | st.text(max_size=3),
    "seed": st.integers(max_value=-1) | st.integers(min_value=2**63) | st.floats(allow_nan=False) | st.text(max_size=3),
    "prompt": st.sampled_from(["", None, 3, {}, [], [-1], [4096], [[1], [2]], ["a", "b"], True])
    | st.lists(st.integers(4096, 10**6), min_size=1, max_size=3),
    "stream": st.integers() | st.text(max_size=3) | st.lists(st.booleans(), max_size=1),
    "stop_token_ids": st.text(min_size=1, max_size=3) | st.lists(st.text(max_size=2), min_size=1, max_size=2)
    | st.lists(st.integers(max_value=-1), min_size=1, max_size=2),
    "stop": st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=2), min_size=1, max_size=2),
    "n": st.integers(2, 10) | st.text(max_size=2),
    "stream_options": st.text(max_size=3) | st.dictionaries(st.text(min_size=1, max_size=4).filter(
        lambda k: k != "include_usage"), JSON, min_size=1, max_size=2),
    "model": st.text(max_size=8).filter(lambda m: m != "target"),
}
@st.composite
def malformed(draw):
    """A request body (bytes) with one thing wrong: a bad value, an unknown field, or not a JSON object at all."""
    kind = draw(st.sampled_from(["bad value", "unknown field", "not an object", "not json"]))
    body = {"prompt": "def f():", "max_tokens": 4}
    if kind == "bad value":
        name = draw(st.sampled_from(sorted(BAD)))
        body[name] = draw(BAD[name])
    elif kind == "unknown field":
        body[draw(st.text(min_size=1, max_size=10).filter(lambda k: k not in FIELDS["completion"]))] = draw(JSON)
    elif kind == "not an object":
        return json.dumps(draw(JSON.filter(lambda v: not isinstance(v, dict)))).encode()
    else:
        return draw(st.binary(max_size=20).filter(lambda b: not _is_json(b)))
    return json.dumps(body).encode()


def _is_json(raw: bytes) -> bool:
    try:
        json.loads(raw)
        return True
    except ValueError:
        return False


def test_malformed_requests_get_a_4xx_json_error_and_the_server_keeps_serving(served):
    url, _ = served
    seen = []
    with httpx.Client(timeout=TIMEOUT_S) as c:
        @settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(malformed())
        def check(raw):
            r = c.post(url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
            assert 400 <= r.status_code < 500, (raw, r.status_code, r.text)
            error = r.json()["error"]
            assert isinstance(error["message"], str) and error["message"] and error["code"] == r.status_code
            seen.append(r.status_code)
        check()
        assert c.get(url + "/health").status_code == 200
    assert len(seen) == 200
    assert client(url).completions.create(model="target", prompt="x", max_tokens=2).choices


@pytest.mark.parametrize("body, status, param, message", [
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "max_tokens must be an integer >= 1 or None, got 0"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature", "temperature must be a finite number >= 0, got -1"),
    ({"prompt": "x", "max_tokens": 5000}, 400, "max_tokens", "exceeds the model's context of 1024 tokens"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p", "top_p must be a finite number in (0, 1] or None, got 0"),
    ({"prompt": "x", "tempreature": 0}, 400, "tempreature", "unknown field(s) ['tempreature']; allowed:"),
    ({"prompt": ""}, 400, "prompt", "prompt is empty"),
    ({"prompt": [1, 99999]}, 400, "prompt", "token ids must be in [0, 4096), got [99999]"),
    ({"prompt": "x", "stop": "\n"}, 400, "stop", "stop strings are not supported"),
    ({"prompt": "x", "stream_options": ""}, 400, "stream_options", "stream_options must be an object"),
    ({"prompt": "x", "top_k": 0.0}, 400, "top_k", "top_k must be an integer >= 1 or None, got 0.0"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model", "model 'gpt-4' is not served here; this server serves 'target'"),
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, "messages", "this model has no chat template"),
])
def test_errors_name_the_field_with_validate_messages(served, body, status, param, message):
    url, _ = served
    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(url + route, json=body, timeout=TIMEOUT_S)
    assert r.status_code == status
    error = r.json()["error"]
    assert message in error["message"] and error["param"] == param


def test_parse_maps_openai_fields_to_sampling_params():
    r = parse({"model": "target", "prompt": [1, 2], "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": -1,
               "seed": 3, "stop_token_ids": [5], "ignore_eos": True, "stream": True,
               "stream_options": {"include_usage": False}}, "completion", "target")
    assert r.prompt == [1, 2] and r.stream and not r.include_usage
    assert r.params == lab.SamplingParams(max_new_tokens=7, temperature=0.5, top_p=0.9, top_k=None, seed=3,
                                          stop_token_ids=(5,), stop_at_eos=False)
    chat = parse({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                  "max_completion_tokens": 3}, "chat", "target")
    assert chat.prompt == [{"role": "user", "content": "hi"}] and chat.params.max_new_tokens == 3


# -- the load test's arithmetic, and a run against our server -------------------------------------------------
def test_summarize_follows_vllm_definitions():
    results = [Result(True, ttft_s=0.1, e2e_s=0.5, itl_s=[0.2, 0.2], prompt_tokens=10, output_tokens=3),
               Result(True, ttft_s=0.3, e2e_s=0.3, prompt_tokens=5, output_tokens=1),
               Result(False, error="boom")]
    m = summarize(results, 2.0, slo_ttft_ms=200, slo_tpot_ms=250)
    assert (m["completed"], m["failed"], m["output_tokens"], m["input_tokens"]) == (2, 1, 4, 15)
    assert m["request_throughput"] == 1.0 and m["output_throughput"] == 2.0 and m["total_token_throughput"] == 9.5
    assert m["tpot_ms"]["p50"] == pytest.approx(200.0)             # (0.5 - 0.1) / 2, the one-token request left out
    assert m["ttft_ms"]["mean"] == pytest.approx(200.0) and m["itl_ms"]["p99"] == pytest.approx(200.0)
    assert m["goodput"] == 0.5                                      # the second misses the TTFT SLO
    assert summarize(results, 2.0)["goodput"] is None


def test_histogram_is_cumulative_with_inf():
    h = Histogram((0.1, 1.0))
    for x in (0.05, 0.1, 0.5, 3.0):
        h.observe(x)
    assert h.lines("t", 'm="x"') == ['t_bucket{m="x",le="0.1"} 2', 't_bucket{m="x",le="1.0"} 3',
                                     't_bucket{m="x",le="+Inf"} 4', 't_sum{m="x"} 3.65', 't_count{m="x"} 4']


def test_loadtest_against_our_server(served):
    url, _ = served
    m = loadtest(url, rate=50.0, num_requests=8, slo_ttft_ms=1e6, slo_tpot_ms=1e6)
    from infopt_lab.workloads import skewed_lengths
    assert (m["completed"], m["failed"], m["model"]) == (8, 0, "target")
    assert m["output_tokens"] == sum(skewed_lengths(8))             # ignore_eos: every asked token
    assert m["goodput"] == pytest.approx(m["request_throughput"])   # SLOs nobody misses
    assert m["ttft_ms"]["p50"] <= m["e2el_ms"]["p99"]
    agentic = loadtest(url, concurrency=2, workload="agentic", num_requests=2, new_tokens=4)
    assert agentic["completed"] == 6 and agentic["output_tokens"] == 24


def test_knee_is_the_last_rate_kept_up_with_before_the_first_miss():
    assert knee([1, 2, 4, 8], [1.0, 1.95, 3.0, 3.1]) == 2            # 3.0 < 0.9 x 4
    assert knee([8, 1, 4, 2], [3.1, 1.0, 3.0, 1.95]) == 2            # any order
    assert knee([1, 2, 4], [1.0, 1.0, 4.0]) == 1                     # a lucky rate after a miss does not count
    assert knee([1, 2], [0.9, 1.8]) == 2                             # exactly at keep_up counts
    with pytest.raises(ValueError, match="kept up with none"):
        knee([1, 2], [0.5, 0.5])


def test_serve_and_loadtest_commands(tmp_path, capsys):
    """`infopt-lab serve` in a subprocess (launch), `infopt-lab loadtest --json` against it."""
    from infopt_lab.cli import main
    from infopt_lab.serving.process import launch
    out = tmp_path / "run.json"
    with launch("target", max_batch_size=2, timeout_s=TIMEOUT_S) as url:
        assert main(["loadtest", "--url", url, "--concurrency", "2", "--num-requests", "3",
                     "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--json", str(out)]) == 0
        assert httpx.get(url + "/v1/models").json()["data"][0]["max_model_len"] == 1024
    m = json.loads(out.read_text())
    assert (m["completed"], m["concurrency"], m["goodput"]) == (3, 2, pytest.approx(m["request_throughput"]))
    assert "goodput (req/s)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["loadtest", "--url", url, "--rate", "1", "--concurrency", "2"])   # one or the other


def test_shutdown_with_a_request_in_flight_ends_it_and_frees_everything(target):
    """Stopping the server mid-stream: the client's stream ends (finished or cut), the engine loop stops, no blocks held."""
    import threading
    got = []

    def read(url):
        try:
            with httpx.Client(timeout=TIMEOUT_S) as c, c.stream("POST", url + "/v1/completions", json={
                    "prompt": "def f():", "max_tokens": 900, "ignore_eos": True, "stream": True}) as r:
                got.extend(r.iter_lines())
        except httpx.HTTPError as e:
            got.append(type(e).__name__)
    with server(*target) as (url, aengine):
        reader = threading.Thread(target=read, args=(url,))
        reader.start()
        wait_until(lambda: aengine.engine.blocks.num_used > 0, "the request to start")
    reader.join(TIMEOUT_S)
    assert not reader.is_alive() and got                         # the client was answered or cut, never left hanging
    assert not aengine.thread.is_alive()
    assert aengine.engine.blocks.num_used == 0 and aengine.engine.sequences == {}
