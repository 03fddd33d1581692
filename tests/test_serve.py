"""``xpuspec serve`` as a client sees it: a real server process on 127.0.0.1, the real ``openai`` client, SmolLM2.

One server (hybrid speculation with a draft model, an API key, continuous batching of 4, 12 queue places) is shared by all tests; the last
test stops it with SIGTERM. Greedy outputs are compared, token for token (as text), with ``model.generate`` on the
same prompt in this process.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from conftest import MODEL, default_sigint  # noqa: E402

FORMAT = "int8_asym"
KEY = "test-key"
#: How long a server may take to load its models and answer /health.
START_TIMEOUT_S = 600
CODE = "def fibonacci(n):"
PROMPTS = [CODE, "The capital of France is", "import numpy as np\n\ndef normalize(x):",
           "Once upon a time, in a small village,"]
#: Request modes: extra body fields, as a client sends them.
MODES = {"plain": {"speculative": False}, "prompt_lookup": {"prompt_lookup_num_tokens": 4},
         "hybrid": {}, "draft_k2": {"num_assistant_tokens": 2}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A ``python -m xpuspec serve`` child process."""

    def __init__(self, *args, key=None, log_path=None):
        self.port, self.key = free_port(), key
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "xpuspec", "--log-level", "WARNING", "serve", MODEL, "--port", str(self.port),
               "--low-bit", FORMAT, *args] + (["--api-key", key] if key else [])
        if log_path is not None:  # the server's output, for a test to read
            self.log = open(log_path, "w")
        else:
            self.log = open(os.devnull, "w") if os.environ.get("XPUSPEC_QUIET_SERVER") else None
        self.proc = subprocess.Popen(cmd, preexec_fn=default_sigint, stdout=self.log, stderr=self.log)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert self.proc.poll() is None, f"the server exited with {self.proc.returncode} while starting"
            try:
                if self.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not answer /health in time"
            time.sleep(0.5)

    @property
    def headers(self):
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def get(self, path, **kw):
        return httpx.get(self.url + path, headers=self.headers, timeout=30, **kw)

    def post(self, path, body, **kw):
        return httpx.post(self.url + path, headers={**self.headers, **kw.pop("headers", {})}, timeout=300,
                          **({"content": body} if isinstance(body, (str, bytes)) else {"json": body}), **kw)

    def client(self):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.key or "none", max_retries=0, timeout=300)

    def health(self):
        return self.get("/health").json()

    def metrics(self) -> dict:
        """``/metrics`` samples as {'name{labels}': value}, without _created series."""
        out = {}
        for line in self.get("/metrics").text.splitlines():
            if line and not line.startswith("#") and "_created" not in line:
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def rss_mib(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) / 1024

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log:
            self.log.close()

    def wait_idle(self, timeout=60):
        deadline = time.monotonic() + timeout
        while (h := self.health())["running"] or h["waiting"]:
            assert time.monotonic() < deadline, f"the server is still busy: {h}"
            time.sleep(0.2)


#: Requests decoded together, and requests that may wait: 16 concurrent requests fit, a 17th gets a 429.
MAX_BATCH, MAX_QUEUE = 4, 12


@pytest.fixture(scope="module")
def server(smollm2_path):
    s = Server("--speculative", "hybrid", "--draft", MODEL, "--draft-low-bit", FORMAT, "--max-queue", str(MAX_QUEUE),
               "--max-batch", str(MAX_BATCH), "--draft-release-after", "0", key=KEY)  # the soak bounds RSS growth:
    # a draft released, then loaded again, would move it by its size (tests/test_draft_release.py tests releasing)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def greedy(ov_int8, tokenizer):
    """``greedy(ids, n)``: model.generate's new token ids (plain greedy, this process), cached."""
    import torch

    cache = {}

    def run(ids, n):
        key = (tuple(ids), n)
        if key not in cache:
            out = ov_int8.generate(torch.tensor([list(ids)]), max_new_tokens=n, do_sample=False)
            cache[key] = out[0, len(ids):].tolist()
        return cache[key]

    return run


def expected(tokenizer, greedy, ids, n):
    """(text, finish_reason, completion tokens) that a greedy request for ``ids`` must give."""
    new = greedy(ids, n)
    reason = "stop" if new[-1] == tokenizer.eos_token_id else "length"
    return tokenizer.decode(new, skip_special_tokens=True), reason, len(new)


def complete(client, prompt, n, stream, mode=(), chat=False, **kw):
    """(text, finish_reason, usage) of one greedy request through the openai client."""
    args = dict(model=MODEL, max_tokens=n, temperature=0, extra_body=dict(mode) or None, **kw)
    if chat:
        args["messages"] = [{"role": "user", "content": prompt}]
    else:
        args["prompt"] = prompt
    api = client.chat.completions if chat else client.completions
    if not stream:
        r = api.create(**args)
        choice = r.choices[0]
        return (choice.message.content if chat else choice.text), choice.finish_reason, r.usage
    text, reason, usage = [], None, None
    for chunk in api.create(stream=True, stream_options={"include_usage": True}, **args):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            piece = choice.delta.content if chat else choice.text
            text.append(piece or "")
            reason = choice.finish_reason or reason
    return "".join(text), reason, usage


def spec_usage(usage):
    extra = usage.model_extra or {}
    return extra.get("speculative_decoding")


def check_spec_usage(spec):
    """The per-request speculative figures agree with each other (vLLM's definitions)."""
    assert set(spec) >= {"num_drafts", "num_draft_tokens", "num_accepted_draft_tokens", "draft_acceptance_rate",
                         "mean_acceptance_length", "acceptance_histogram", "num_accepted_tokens_per_pos"}
    assert 0 <= spec["num_accepted_draft_tokens"] <= spec["num_draft_tokens"]
    assert sum(spec["acceptance_histogram"]) == spec["num_drafts"]
    if spec["num_drafts"]:
        assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["num_accepted_draft_tokens"] / spec["num_drafts"])


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_output_equals_generate_streamed_and_not(server, tokenizer, greedy, mode):
    client = server.client()
    for prompt, n in ((CODE, 16), (PROMPTS[1], 8)):
        want_text, want_reason, want_tokens = expected(tokenizer, greedy, tokenizer(prompt).input_ids, n)
        for stream in (False, True):
            text, reason, usage = complete(client, prompt, n, stream, MODES[mode])
            assert (text, reason) == (want_text, want_reason), (mode, stream)
            assert usage.completion_tokens == want_tokens and usage.prompt_tokens == len(tokenizer(prompt).input_ids)
            spec = spec_usage(usage)
            if mode == "plain":
                assert spec is None
            else:
                check_spec_usage(spec)


def test_chat_applies_the_chat_template(server, tokenizer, greedy):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                    add_special_tokens=False).input_ids
    want_text, want_reason, _ = expected(tokenizer, greedy, ids, 32)
    for stream in (False, True):
        text, reason, usage = complete(server.client(), messages[0]["content"], 32, stream, chat=True)
        assert (text, reason, usage.prompt_tokens) == (want_text, want_reason, len(ids))
    assert want_reason == "stop"  # the model ends its answer with <|im_end|>, which gives no text


def test_min_tokens_holds_eos_back_as_generate_does(server, tokenizer, ov_int8):
    """vLLM's min_tokens: the chat answer above ends at EOS within 32 tokens; with min_tokens=32 it runs to 32, as
    generate(min_new_tokens=32) in this process."""
    import torch

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                    add_special_tokens=False).input_ids
    out = ov_int8.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
    want = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
    for stream in (False, True):
        text, reason, usage = complete(server.client(), messages[0]["content"], 32, stream, {"min_tokens": 32},
                                       chat=True)
        assert (text, reason, usage.completion_tokens) == (want, "length", 32)


def test_a_chat_session_reuses_its_cached_prefix_and_answers_as_generate_does(server, tokenizer, greedy):
    """Each turn resends the whole conversation: turns 2 and 3 start on the cached KV blocks of the turns before, at
    least every full 32-token block of the turn before's prompt (usage's prompt_tokens_details.cached_tokens,
    /metrics' prefix_cache_hits; with split steps the blocks a step wrote are not offered, as the same tokens
    prefilled would compute otherwise), and every answer is the one generate gives in this process, without a
    prefix cache."""
    assert server.health()["prefix_caching"] is True
    label = '{model_name="%s"}' % MODEL
    before = server.metrics()
    messages, cached, lengths = [{"role": "system", "content": "You are a helpful assistant. " * 8}], [], []
    for question in ("What is the capital of France?", "And of Italy?", "Which of the two is larger?"):
        messages.append({"role": "user", "content": question})
        ids = tokenizer(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                        add_special_tokens=False).input_ids
        r = server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
        want_text, want_reason, _ = expected(tokenizer, greedy, ids, 24)
        assert (r.choices[0].message.content, r.choices[0].finish_reason) == (want_text, want_reason)
        assert r.usage.prompt_tokens == len(ids)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        lengths.append(len(ids))
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    assert cached[1] >= 64 and all(c >= 32 * (n // 32) for c, n in zip(cached[1:], lengths))
    after = server.metrics()
    hits = after["xpuspec:prefix_cache_hits_total" + label] - before.get("xpuspec:prefix_cache_hits_total" + label, 0)
    queries = (after["xpuspec:prefix_cache_queries_total" + label]
               - before.get("xpuspec:prefix_cache_queries_total" + label, 0))
    assert hits >= sum(cached) and queries >= hits > 0


@pytest.mark.parametrize("mode", ["plain", "prompt_lookup"])
def test_stop_string_cuts_exactly_where_it_begins(server, tokenizer, greedy, mode):
    want, _, _ = expected(tokenizer, greedy, tokenizer(CODE).input_ids, 24)  # "...fibonacci(n..." on either conversion
    # the longest piece of the prompt the output repeats, less its first 3 characters: it starts inside a token, and
    # prompt lookup drafts it as a block copied from the prompt
    copied = max((CODE[i:j] for i in range(len(CODE)) for j in range(i + 6, len(CODE) + 1) if CODE[i:j] in want[1:]),
                 key=len, default="")
    stop = copied[3:]
    assert len(stop) >= 3, want
    for stream in (False, True):
        text, reason, usage = complete(server.client(), CODE, 24, stream, MODES[mode], stop=["never", stop])
        assert (text, reason) == (want[:want.index(stop)], "stop")
        assert usage.completion_tokens < 24


def test_seeded_sampling_repeats_when_decoding_plainly(server):
    """With speculation a seed repeats only where the adaptive draft schedule repeats (it changes with what earlier
    requests measured): best effort, as the OpenAI API's seed."""
    client = server.client()
    runs = [client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=12, temperature=0.9, top_p=0.95,
                                      seed=seed, extra_body=MODES["plain"]).choices[0].text for seed in (7, 7, 8, 8)]
    assert runs[0] == runs[1] and runs[2] == runs[3] and runs[0] != runs[2]


def test_models_endpoint(server):
    assert [m.id for m in server.client().models.list()] == [MODEL]
    assert server.client().models.retrieve(MODEL).id == MODEL


def test_sixteen_concurrent_streams_equal_their_single_request_outputs(server, tokenizer, ov_int8):
    import torch

    jobs = [(PROMPTS[i % 4], 8 + i, list(MODES)[i % 4]) for i in range(16)]
    t0 = time.perf_counter()
    wants = []
    for prompt, n, _ in jobs:  # one by one, in this process
        ids = tokenizer(prompt).input_ids
        new = ov_int8.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()
        wants.append((tokenizer.decode(new, skip_special_tokens=True),
                      "stop" if new[-1] == tokenizer.eos_token_id else "length", len(new)))
    alone = time.perf_counter() - t0
    client = server.client()
    server.wait_idle()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda job: complete(client, job[0], job[1], True, MODES[job[2]]), jobs))
    wall = time.perf_counter() - t0
    for (prompt, n, mode), want, (text, reason, usage) in zip(jobs, wants, got):
        assert (text, reason, usage.completion_tokens) == want, (prompt, n, mode)
    tokens = sum(u.completion_tokens for _, _, u in got)
    print(f"\n16 concurrent streams: {tokens} tokens in {wall:.1f} s = {tokens / wall:.1f} tokens/s in aggregate "
          f"(continuous batching, max batch {MAX_BATCH}); the same requests one by one in this process, plain: {tokens / alone:.1f} tokens/s")


def test_client_disconnect_cancels_its_request(server, tokenizer, greedy):
    server.wait_idle()
    before = server.metrics()
    aborted = 'xpuspec:request_success_total{finished_reason="abort",model_name="%s"}' % MODEL
    generated = 'xpuspec:generation_tokens_total{model_name="%s"}' % MODEL
    stream = server.client().completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=2000, temperature=0,
                                                stream=True, extra_body=MODES["plain"])
    pieces = [c.choices[0].text for _, c in zip(range(3), stream)]
    assert len(pieces) == 3
    stream.close()
    deadline = time.monotonic() + 60
    while server.metrics().get(aborted, 0) == before.get(aborted, 0):
        assert time.monotonic() < deadline, "the request went on after its client left"
        time.sleep(0.2)
    after = server.metrics()
    assert after[generated] - before.get(generated, 0) < 200  # ended soon after the disconnect, far from 2000
    h = server.health()
    assert (h["running"], h["waiting"]) == (0, 0)
    assert after['xpuspec:kv_blocks_in_use{model_name="%s"}' % MODEL] == 0
    want = expected(tokenizer, greedy, tokenizer(CODE).input_ids, 12)
    text, reason, usage = complete(server.client(), CODE, 12, False, MODES["plain"])
    assert (text, reason, usage.completion_tokens) == want
    # a client that does not stream and gives up waiting after a second: the server decodes until then (how many
    # tokens depends on the CPU: about 100 a second here), and stops within seconds of its leaving, far from 2000
    before = server.metrics()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=1,
                   json={"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 2000, "temperature": 0})
    left = time.monotonic()
    while server.metrics().get(aborted, 0) == before.get(aborted, 0):
        assert time.monotonic() < left + 10, "the request went on after its client left"
        time.sleep(0.2)
    after = server.metrics()
    assert after[generated] - before.get(generated, 0) < 1000
    time.sleep(1)
    assert server.metrics()[generated] == after[generated]  # nothing decoded after the abort


BAD_REQUESTS = [  # (what, path, body, status, param or None, code or None)
    ("malformed JSON", "/v1/completions", '{"model": "x", "prompt": ', 400, None, None),
    ("not an object", "/v1/completions", "[1, 2]", 400, None, None),
    ("a field of the wrong type", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "10"}, 400,
     "max_tokens", None),
    ("an unknown field", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokenz": 10}, 400, "max_tokenz", None),
    ("max_tokens past the context", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10**6}, 400,
     "max_tokens", "context_length_exceeded"),
    ("a prompt longer than the context", "/v1/completions", {"model": MODEL, "prompt": "hello " * 9000}, 400,
     "prompt", "context_length_exceeded"),
    ("a chat longer than the context", "/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": "hello " * 9000}]}, 400, "messages", "context_length_exceeded"),
    ("a prompt past the character bound", "/v1/completions", {"model": MODEL, "prompt": "x" * 700_000}, 400,
     "prompt", "context_length_exceeded"),
    ("token ids past the context", "/v1/completions", {"model": MODEL, "prompt": [1] * 9000}, 400, "prompt",
     "context_length_exceeded"),
    ("an empty list of token ids", "/v1/completions", {"model": MODEL, "prompt": []}, 400, "prompt", None),
    ("min_tokens past max_tokens", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4, "min_tokens": 5},
     400, "min_tokens", None),
    ("best_of 0", "/v1/completions", {"model": MODEL, "prompt": "x", "best_of": 0}, 400, "best_of", None),
    ("temperature out of range", "/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 3}, 400,
     "temperature", None),
    ("n > 1", "/v1/completions", {"model": MODEL, "prompt": "x", "n": 2}, 400, "n", None),
    ("a seed past 64 bits", "/v1/completions", {"model": MODEL, "prompt": "x", "seed": 10**23}, 400, "seed", None),
    ("several prompts", "/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt", None),
    ("a token id off the vocabulary", "/v1/completions", {"model": MODEL, "prompt": [1, 10**7]}, 400, "prompt", None),
    ("an empty stop string", "/v1/completions", {"model": MODEL, "prompt": "x", "stop": [""]}, 400, "stop", None),
    ("a draft length of 0", "/v1/completions", {"model": MODEL, "prompt": "x", "num_assistant_tokens": 0}, 400,
     "num_assistant_tokens", None),
    ("speculation off with a lookup length", "/v1/completions",
     {"model": MODEL, "prompt": "x", "speculative": False, "prompt_lookup_num_tokens": 3}, 400, None, None),
    ("no messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages", None),
    ("an unknown role", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]},
     400, "messages.0.role", None),
    ("logprobs", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                          "logprobs": True}, 400, "logprobs", None),
    ("logprobs, completions", "/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 2}, 400, "logprobs",
     None),
    ("top_logprobs", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                              "top_logprobs": 2}, 400, "top_logprobs", None),
    ("an unknown model", "/v1/completions", {"model": "gpt-4o", "prompt": "x"}, 404, "model", "model_not_found"),
    ("an unknown model, chat", "/v1/chat/completions", {"model": "gpt-4o", "messages": [
        {"role": "user", "content": "hi"}]}, 404, "model", "model_not_found"),
    ("an unknown path", "/v1/embeddings", {"model": MODEL, "input": "x"}, 404, None, None),
]


@pytest.mark.parametrize("what, path, body, status, param, code", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_input_gets_its_status_and_an_openai_error_body(server, what, path, body, status, param, code):
    r = server.post(path, body, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["param"], error["code"]) == (param, code)
    assert "Traceback" not in r.text
    assert server.health()["status"] == "ok"


def test_missing_or_wrong_key_gets_401(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(server.url + "/metrics", headers=headers).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="gpt-4o", prompt="x")
    with pytest.raises(openai.BadRequestError, match="Unrecognized request argument"):
        server.client().completions.create(model=MODEL, prompt="x", extra_body={"bogus": 1})


def _sum_usage(results):
    total = Counter()
    for usage in results:
        total["prompt"] += usage.prompt_tokens
        total["generation"] += usage.completion_tokens
        spec = spec_usage(usage)
        if spec:
            total["drafts"] += spec["num_drafts"]
            total["draft_tokens"] += spec["num_draft_tokens"]
            total["accepted"] += spec["num_accepted_draft_tokens"]
            for pos, n in enumerate(spec["num_accepted_tokens_per_pos"]):
                total[f"pos{pos}"] += n
    return total


def _metric_totals(m):
    names = {"prompt": "prompt_tokens_total", "generation": "generation_tokens_total",
             "drafts": "spec_decode_num_drafts_total", "draft_tokens": "spec_decode_num_draft_tokens_total",
             "accepted": "spec_decode_num_accepted_tokens_total"}
    total = Counter({key: m.get(f'xpuspec:{name}{{model_name="{MODEL}"}}', 0) for key, name in names.items()})
    for key, value in m.items():
        pos = re.match(r'xpuspec:spec_decode_num_accepted_tokens_per_pos_total\{.*position="(\d+)"', key)
        if pos:
            total[f"pos{pos.group(1)}"] = value
    return total


SOAK_REQUESTS = 200
SOAK_THREADS = 8
SOAK_TIME_LIMIT_S = 900
#: RSS the server may gain over the soak, after its first requests (measured: see the note of the change).
SOAK_RSS_GROWTH_MIB = 64
#: Requests of the soak's mix sent before RSS is first read.
SOAK_WARMUP_REQUESTS = 40


@pytest.mark.soak
def test_soak(server, tokenizer):
    """~200 requests from 8 threads: completions and chat, streamed and not, every mode; none lost, RSS bounded,
    /metrics counters equal to the sums of the per-request usage."""
    client = server.client()
    deadline = time.monotonic() + SOAK_TIME_LIMIT_S
    results, failures, lock = [], [], threading.Lock()

    def one(i):
        assert time.monotonic() < deadline, "the soak ran past its time limit"
        mode = list(MODES.values())[i % 4]
        try:
            text, reason, usage = complete(client, PROMPTS[i % 3], 1 + i % 4, stream=bool(i % 2), mode=mode,
                                           chat=i % 10 == 0)
            assert reason in ("stop", "length") and usage is not None
            with lock:
                results.append(usage)
        except Exception as exc:  # noqa: BLE001 - counted below, with its request
            with lock:
                failures.append((i, repr(exc)))

    def burst(n):
        with ThreadPoolExecutor(SOAK_THREADS) as pool:
            list(pool.map(one, range(n)))
        server.wait_idle()

    # What the first requests build is not growth: drafts' compiled copies, and the runtime's kernels (and weights
    # repacked for them) for each batch shape the concurrent mix makes. With a warm-up of serial requests only, CI
    # once saw 113 MiB of growth over the soak (1720 -> 1833 MiB) where an AVX2 EPYC sees 13; the warm-up is
    # therefore a burst of the soak's own mix.
    server.wait_idle()
    burst(SOAK_WARMUP_REQUESTS)
    assert not failures, failures[:5]
    results.clear()
    rss0, before = server.rss_mib(), _metric_totals(server.metrics())
    t0 = time.perf_counter()
    burst(SOAK_REQUESTS)
    wall = time.perf_counter() - t0
    rss1 = server.rss_mib()
    assert not failures, failures[:5]
    assert len(results) == SOAK_REQUESTS
    after = _metric_totals(server.metrics())
    sums = _sum_usage(results)
    assert {k: after[k] - before[k] for k in after} == {k: sums.get(k, 0) for k in after}
    assert sums["draft_tokens"] > 0  # speculation ran
    print(f"\nsoak: {SOAK_REQUESTS} requests from {SOAK_THREADS} threads in {wall:.1f} s, {sums['generation']} tokens "
          f"({sums['generation'] / wall:.1f} tokens/s); server RSS {rss0:.0f} -> {rss1:.0f} MiB")
    assert rss1 - rss0 < SOAK_RSS_GROWTH_MIB


def _stream_in_thread(server, prompt, n, out):
    """Start a greedy stream in a thread; its (text, finish_reason, usage) goes to ``out[prompt]``."""
    t = threading.Thread(target=lambda: out.__setitem__(prompt, complete(server.client(), prompt, n, True)))
    t.start()
    return t


def _wait_for(server, running, waiting, timeout=120):
    deadline = time.monotonic() + timeout
    while (h := server.health())["running"] != running or h["waiting"] != waiting:
        assert time.monotonic() < deadline, h
        time.sleep(0.05)


def test_full_queue_gets_429_with_retry_after_and_queued_clients_can_leave(server, tokenizer, greedy):
    server.wait_idle()
    client = server.client()
    streams = [client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=2000, temperature=0,
                                         stream=True) for _ in range(MAX_BATCH + MAX_QUEUE)]
    _wait_for(server, MAX_BATCH, MAX_QUEUE)
    r = server.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
    error = r.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    for stream in reversed(streams):  # the queued ones first, then the running ones
        stream.close()
    server.wait_idle()
    want = expected(tokenizer, greedy, tokenizer(CODE).input_ids, 8)
    text, reason, usage = complete(client, CODE, 8, False)
    assert (text, reason, usage.completion_tokens) == want


def test_openapi_json_documents_what_the_server_answers(server):
    """Validation errors are 400s in OpenAI's format, so /openapi.json documents 400 (and 401, 404, 413, 429), never
    FastAPI's 422; best_of 0, valid by the old schema, is refused by the new one as by the server."""
    schema = server.get("/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "404", "413", "429"} <= set(responses) and "422" not in responses
        error_schema = responses["400"]["content"]["application/json"]["schema"]
        assert error_schema == {"$ref": "#/components/schemas/ErrorResponse"}
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    props = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"type": "integer", "minimum": 1, "maximum": 1} in props["best_of"]["anyOf"]
    assert props["model"]["enum"] == [MODEL]
    assert "assistant_confidence_threshold" in props  # this server has a draft model
    r = server.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_an_empty_prompt_is_a_400_naming_it(server):
    """"", [""] and [] are refused whatever the tokenizer would make of "" (a BOS alone or nothing: SmolLM2's GGUF
    says to add no BOS, and conversions before xpuspec checked GGUF tokenizers added one); /openapi.json says so."""
    for prompt in ("", [""], []):
        r = server.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", (prompt, r.text)
    branches = server.get("/openapi.json").json()["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]
    assert [b["minLength"] for b in branches["anyOf"] if b.get("type") == "string"] == [1]


def test_sigterm_drains_running_and_queued_requests_then_exits_0(server, tokenizer, greedy):
    """The last test: it stops the shared server."""
    out = {}
    jobs = [(CODE, 24), (PROMPTS[1], 8)]
    server.wait_idle()
    threads = [_stream_in_thread(server, *jobs[0], out)]
    _wait_for(server, 1, 0)
    threads.append(_stream_in_thread(server, *jobs[1], out))
    _wait_for(server, 2, 0)
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=180) == 0
    for t in threads:
        t.join()
    for prompt, n in jobs:
        text, reason, usage = out[prompt]
        assert (text, reason, usage.completion_tokens) == expected(tokenizer, greedy, tokenizer(prompt).input_ids, n)
    with pytest.raises(httpx.TransportError):
        server.get("/health")


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "xpuspec", "serve", MODEL, *args], capture_output=True, text=True,
                          timeout=120)


def test_arguments_that_cannot_work_are_refused_before_the_model_loads():
    done = _cli("--max-batch", "0")
    assert done.returncode == 2 and "--max-batch must be at least 1, got 0" in done.stderr
    assert "--kv-budget-mib must be at least 1" in _cli("--kv-budget-mib", "0").stderr
    assert "--draft goes with --speculative draft, hybrid or suffix_hybrid" in _cli("--speculative", "self", "--draft",
                                                                                   MODEL).stderr
    assert "--suffix-cache shared goes with --speculative suffix" in _cli("--suffix-cache", "shared").stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        done = _cli("--port", str(taken.getsockname()[1]))
    assert done.returncode == 2 and "cannot listen on 127.0.0.1" in done.stderr


def test_the_servers_suffix_cache_is_private_unless_shared_is_asked_for():
    """In a server, requests draft from each other's outputs only with --suffix-cache shared."""
    from xpuspec.cli import build_parser
    from xpuspec.serve.command import _speculative

    def spec(*args):
        return _speculative(build_parser().parse_args(["serve", MODEL, *args]))

    assert spec("--speculative", "suffix").share_across_requests is False
    assert spec("--speculative", "suffix_hybrid", "--draft", MODEL).share_across_requests is False
    assert spec("--speculative", "suffix_hybrid", "--draft", MODEL).draft == MODEL
    assert spec("--speculative", "suffix", "--suffix-cache", "shared").share_across_requests is True
    assert spec("--speculative", "prompt_lookup").mode == "prompt_lookup" and spec() is None


class FailingBackend:
    """A backend whose every run fails, as a model that raises would."""

    engine, max_running, note, speculation, context_length, vocab_size = "serial", 1, "", "none", 2048, 49152
    has_draft_model = prefix_caching = False

    def check(self, params):
        pass

    def prefix_cache_counts(self):
        return 0, 0

    def run(self, prompt_ids, params, on_tokens):
        on_tokens([42])
        raise RuntimeError("an internal failure with a secret path /opt/model")

    def kv_blocks_in_use(self):
        return 0


def test_a_failing_request_gets_500_with_a_request_id_and_no_traceback(tokenizer):
    from fastapi.testclient import TestClient

    from xpuspec.serve.app import create_app

    with TestClient(create_app(FailingBackend(), tokenizer, "m"), raise_server_exceptions=False) as client:
        body = {"model": "m", "prompt": "x", "max_tokens": 4}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 500
        error = r.json()["error"]
        assert (error["type"], error["code"]) == ("server_error", "internal_error")
        assert re.search(r"request id cmpl-\w+", error["message"]) and "/opt/model" not in r.text
        events = client.post("/v1/completions", json={**body, "stream": True}).text.split("\n\n")
        assert json.loads(events[-3].removeprefix("data: "))["error"]["code"] == "internal_error"
        assert events[-2] == "data: [DONE]"
        assert client.get("/health").json()["status"] == "ok"


# -- a second server: plain decoding, one request at a time, a 2 s drain, a 4 MiB body limit, its log kept ----------

PLAIN_MAX_BODY_MIB = 4


@pytest.fixture(scope="module")
def plain_server(smollm2_path, tmp_path_factory):
    """Started after the shared server has stopped (its last test); its last test stops it with SIGTERM."""
    log_path = tmp_path_factory.mktemp("serve") / "plain-server.log"
    s = Server("--max-batch", "1", "--max-queue", "4", "--drain-timeout", "2", "--max-body-mib",
               str(PLAIN_MAX_BODY_MIB), "--no-prefix-cache", log_path=log_path)
    s.log_path = log_path
    yield s
    s.stop()


def test_no_prefix_cache_reuses_nothing(plain_server):
    assert plain_server.health()["prefix_caching"] is False
    for _ in range(2):
        r = plain_server.client().completions.create(model=MODEL, prompt=PROMPTS[3] * 10, max_tokens=2, temperature=0)
        assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_a_body_past_the_limit_gets_413_before_it_is_read(plain_server):
    limit = PLAIN_MAX_BODY_MIB * 2**20
    with pytest.raises(openai.APIStatusError) as info:  # the openai client sends a Content-Length
        plain_server.client().completions.create(model=MODEL, prompt="x" * limit, max_tokens=2)
    assert info.value.status_code == 413
    error = info.value.response.json()["error"]
    assert error["code"] == "request_too_large" and f"at most {limit} bytes" in error["message"]

    def chunks():  # no Content-Length: refused once what arrived passes the limit
        for _ in range(PLAIN_MAX_BODY_MIB + 2):
            yield b"x" * 2**20

    r = httpx.post(plain_server.url + "/v1/completions", content=chunks(), timeout=60,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert plain_server.health()["status"] == "ok"


def test_a_prompt_past_the_character_bound_gets_400_before_it_is_tokenized(plain_server, ov_int8, tokenizer):
    from xpuspec.serve.app import default_max_prompt_chars

    bound = default_max_prompt_chars(tokenizer, ov_int8.context_length)
    for path, body in (("/v1/completions", {"prompt": "x" * (bound + 1)}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * (bound // 2)},
                                                              {"role": "user", "content": "x" * (bound // 2 + 1)}]})):
        r = plain_server.post(path, {"model": MODEL, **body})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (error["param"], error["code"]) == ("prompt" if "prompt" in body else "messages",
                                                   "context_length_exceeded")
        assert f"{bound + 1} characters" in error["message"] and f"at most {bound} characters" in error["message"]


def test_the_server_answers_others_while_a_long_prompt_is_tokenized(plain_server, ov_int8, tokenizer):
    """Tokenizing runs off the event loop: while a long prompt (within the character bound, past the context) is
    tokenized, /health keeps answering (on the event loop it answered once the prompt's 400 was out)."""
    from xpuspec.serve.app import default_max_prompt_chars

    prompt = "hello world, 12345. " * (default_max_prompt_chars(tokenizer, ov_int8.context_length) // 20)
    done, out = threading.Event(), {}

    def big():
        out["r"] = plain_server.post("/v1/completions", {"model": MODEL, "prompt": prompt})
        done.set()

    thread = threading.Thread(target=big)
    thread.start()
    answered = 0
    while not done.is_set():
        plain_server.get("/health")
        answered += not done.is_set()
    thread.join()
    error = out["r"].json()["error"]
    assert out["r"].status_code == 400 and error["code"] == "context_length_exceeded" and "tokens" in error["message"]
    assert answered >= 5


def test_a_confidence_threshold_without_a_draft_model_is_refused_as_the_schema_says(plain_server):
    schema = plain_server.get("/openapi.json").json()
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = schema["components"]["schemas"][name]
        assert "assistant_confidence_threshold" not in props["properties"]
        assert props["additionalProperties"] is False
    with pytest.raises(openai.BadRequestError, match="applies to a draft model, and this server has none"):
        plain_server.client().completions.create(model=MODEL, prompt="x", max_tokens=2,
                                                 extra_body={"assistant_confidence_threshold": 0.5})


#: Examples per operation and generation mode in the schemathesis run (bounded: 49 s at 15 and 63 s at 20, under
#: load averages of 14-17 on 2 cores).
SCHEMATHESIS_EXAMPLES = 15


def _fits(case) -> None:
    """A request valid by the schema, made quick, and kept clear of the constraints between fields that JSON
    schema cannot state (the prompt and max_tokens within the context, min_tokens up to max_tokens, speculation
    settings that go together, stream_options only when streaming, a response_format's grammar that compiles), which
    the server answers with a documented 400."""
    body = case.body
    if not isinstance(body, dict):
        return
    body.pop("max_completion_tokens", None)
    body["max_tokens"] = 1
    minimum = body.get("min_tokens")
    if isinstance(minimum, (int, float)) and not isinstance(minimum, bool) and minimum > 1:  # at most max_tokens
        body["min_tokens"] = 1  # (an integral float such as 5.0 is an integer to the schema and the server)
    for name in ("speculative", "num_assistant_tokens", "prompt_lookup_num_tokens"):
        body.pop(name, None)
    if not body.get("stream"):
        body.pop("stream_options", None)
    if isinstance(body.get("seed"), int) and abs(body["seed"]) > 2**53:  # schemathesis checks a case against the
        body["seed"] = 2**53  # schema in doubles: -2**63 - 191 passes as -2**63, and the server rightly refuses it
    if isinstance(body.get("prompt"), list) and body["prompt"] and isinstance(body["prompt"][0], int):
        body["prompt"] = body["prompt"][:64]
    # whether a JSON schema, grammar or regex compiles is not a JSON-schema property: test_structured_output holds
    # response_format, valid and not
    body.pop("response_format", None)


def test_schemathesis_finds_the_server_as_its_openapi_json_says(plain_server):
    """Every operation, with examples valid by /openapi.json (accepted: 2xx, or 404 for a model it does not serve)
    and invalid ones (refused with a 4xx, never a 5xx), each answer checked against the documented statuses,
    content types and schemas."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, Phase, given, settings

    schema = schemathesis.openapi.from_url(plain_server.url + "/openapi.json")
    failures = []
    for result in schema.get_all_operations():
        operation = result.ok()
        modes = [schemathesis.GenerationMode.POSITIVE]
        if operation.body:  # the GET operations' inputs have no invalid values (a model name is any string)
            modes.append(schemathesis.GenerationMode.NEGATIVE)
        for mode in modes:
            @settings(max_examples=SCHEMATHESIS_EXAMPLES, deadline=None, database=None, phases=[Phase.generate],
                      suppress_health_check=list(HealthCheck), derandomize=True)  # the same examples in every run
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case):
                if mode is schemathesis.GenerationMode.POSITIVE:
                    _fits(case)
                response = case.call(base_url=plain_server.url, timeout=120)
                if mode is schemathesis.GenerationMode.NEGATIVE and response.status_code == 413:
                    # an invalid body past --max-body-mib (a prompt over its maxLength) gets the documented 413
                    # before it is read; schemathesis counts only 400, 422 and their kin as a refusal
                    assert response.json()["error"]["code"] == "request_too_large"
                    return
                case.validate_response(response)

            try:
                run()
            except (Exception, BaseExceptionGroup) as exc:  # noqa: BLE001 - gathered: every operation's failures
                failures.append(f"{operation.label} ({mode.value}): {exc}")
    assert not failures, "\n\n".join(failures)
    assert plain_server.health()["status"] == "ok"


def test_sigterm_after_the_drain_timeout_cancels_open_requests_and_tells_their_clients(plain_server):
    """The last test of the plain server: with --drain-timeout 2, the running request (8000 tokens to go) and the
    queued ones are cancelled at the deadline; each stream gets an error event and [DONE], a waiting client a 503,
    the process exits soon (generating on would take minutes), and its log holds no traceback."""
    plain_server.wait_idle()
    out = {}
    body = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 8000, "temperature": 0}

    def stream(key):
        with httpx.stream("POST", plain_server.url + "/v1/completions", json={**body, "stream": True},
                          timeout=300) as r:
            out[key] = (r.status_code, [line for line in r.iter_lines() if line])

    def whole(key):
        r = httpx.post(plain_server.url + "/v1/completions", json=body, timeout=300)
        out[key] = (r.status_code, r.json())

    threads = [threading.Thread(target=stream, args=("running",))]
    threads[0].start()
    _wait_for(plain_server, 1, 0)
    threads += [threading.Thread(target=stream, args=("queued",)), threading.Thread(target=whole, args=("whole",))]
    for t in threads[1:]:
        t.start()
    _wait_for(plain_server, 1, 2)
    plain_server.proc.send_signal(signal.SIGTERM)
    assert plain_server.proc.wait(timeout=60) == 0
    for t in threads:
        t.join(timeout=30)
    for key in ("running", "queued"):
        status, events = out[key]
        assert status == 200 and events[-1] == "data: [DONE]", (key, events[-3:])
        assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "server_shutting_down", key
    assert len(out["running"][1]) > 2  # it had streamed text before the deadline
    status, answer = out["whole"]
    assert status == 503 and answer["error"]["code"] == "server_shutting_down"
    plain_server.log.flush()
    log = plain_server.log_path.read_text()
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
