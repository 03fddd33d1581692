"""Structured output (``response_format``) on real SmolLM2: outputs parse and validate against their JSON schema, greedy
constrained output is the same with every drafter as without speculation, drafts the grammar forbids are cut before
verification, batch rows equal their solo outputs, and the real ``openai`` client gets the same through a server.
"""

import json
import threading

import pytest
import torch

from conftest import MODEL
from schemas import TOKEN_BUDGET, parse_and_validate, requests

jsonschema = pytest.importorskip("jsonschema")

#: One request per schema variant (each variant's first subject), for the identity checks.
FIVE = [requests()[i] for i in (0, 11, 22, 33, 44)]


def chat_ids(tokenizer, messages):
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                         return_dict=True)["input_ids"]


def new_tokens(model, ids, fmt, **kw):
    out = model.generate(ids, max_new_tokens=TOKEN_BUDGET, do_sample=False, response_format=fmt, **kw)
    return out[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def plain(ov_int8, tokenizer):
    """``plain(i)``: the plain constrained greedy output of request ``i`` of FIVE, cached."""
    cache = {}

    def run(i):
        if i not in cache:
            messages, fmt, _ = FIVE[i]
            cache[i] = new_tokens(ov_int8, chat_ids(tokenizer, messages), fmt, speculative=False)
        return cache[i]

    return run


# -- bad input ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt, words", [
    ("json", "must be a dict"),
    ({"type": "xml"}, "type must be one of"),
    ({"type": "json_schema"}, "json_schema must be an object"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}, "not a valid JSON schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": "{not json"}}, "not valid JSON"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "must be a JSON schema object"),
    ({"type": "grammar", "grammar": "start: undefined_rule"}, "cannot be compiled"),
    ({"type": "regex", "regex": "(unclosed"}, "cannot be compiled"),
    ({"type": "regex"}, "needs a non-empty string field 'regex'"),
])
def test_a_bad_response_format_raises_a_typed_error_naming_it(ov_int8, fmt, words):
    from xpuspec import ResponseFormatError

    with pytest.raises(ResponseFormatError, match=words):
        ov_int8.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, response_format=fmt)


def test_text_format_is_no_constraint(ov_int8, tokenizer):
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    free = ov_int8.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(ov_int8.generate(ids, max_new_tokens=12, do_sample=False, response_format={"type": "text"}),
                       free)


# -- the grammar matcher --------------------------------------------------------------------------------------------
def test_the_matcher_masks_cuts_and_rolls_back(ov_int8, tokenizer):
    grammar = ov_int8.grammar_for({"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}}})
    matcher = grammar([tokenizer.eos_token_id])
    doc = tokenizer('{"n": 42}', add_special_tokens=False).input_ids
    bad = tokenizer("hello", add_special_tokens=False).input_ids
    assert matcher.valid_prefix(doc) == len(doc)
    assert matcher.valid_prefix(doc[:2] + bad) == 2  # cut at the first forbidden token, state unchanged
    assert matcher.valid_prefix(bad) == 0
    rows = torch.zeros(3, ov_int8.runner.vocab_size)
    masked = matcher.mask_rows(doc[:2], rows)  # row i masked after doc[:i]
    assert masked[0, doc[0]] == 0 and masked[1, doc[1]] == 0 and masked[2, doc[2]] == 0
    assert masked[0, bad[0]] == float("-inf") and masked[0, tokenizer.eos_token_id] == float("-inf")
    assert bool((rows == 0).all())  # the rows themselves are left as they are
    matcher.keep(1, doc[1])  # the second draft rejected, the target's token (doc[1]) kept instead
    assert matcher.valid_prefix(doc[2:]) == len(doc) - 2
    assert not matcher.accepting
    for t in doc[2:]:
        matcher.keep(0, t)
    assert matcher.accepting
    allowed = matcher.allowed()
    assert allowed[tokenizer.eos_token_id] and int(allowed.sum()) == 1  # complete: EOS only
    with pytest.raises(RuntimeError, match="cut drafts"):  # a draft that was not cut is refused, not masked
        grammar([tokenizer.eos_token_id]).mask_rows(bad, torch.zeros(len(bad) + 1, ov_int8.runner.vocab_size))


# -- 50 schemas -----------------------------------------------------------------------------------------------------
def test_fifty_schema_requests_with_prompt_lookup_parse_and_validate(ov_int8, tokenizer):
    failures, drafted = [], 0
    for i, (messages, fmt, schema) in enumerate(requests()):
        new = new_tokens(ov_int8, chat_ids(tokenizer, messages), fmt, prompt_lookup_num_tokens=8)
        drafted += ov_int8.last_generate_stats.drafted_tokens
        assert new[-1] == tokenizer.eos_token_id, f"request {i} did not complete within {TOKEN_BUDGET} tokens"
        try:
            parse_and_validate(tokenizer.decode(new, skip_special_tokens=True), schema)
        except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
            failures.append((i, str(exc)[:200]))
    assert not failures
    assert drafted > 0  # prompt lookup really drafted


# -- speculation ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hybrid(smollm2_path):
    from xpuspec import AutoModelForCausalLM, SpeculativeConfig

    spec = SpeculativeConfig(mode="hybrid", num_assistant_tokens=4, cost_model=False)
    return AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", load_in_low_bit="int8_asym", speculative=spec)


@pytest.fixture(scope="module")
def hybrid_plain(hybrid, tokenizer):
    """``hybrid_plain(i)``: request ``i`` of FIVE decoded plainly by the hybrid-loaded model itself, made once and
    compared with each of the 3 drafters (it was made again for each)."""
    cache = {}

    def run(i):
        if i not in cache:
            messages, fmt, _ = FIVE[i]
            cache[i] = new_tokens(hybrid, chat_ids(tokenizer, messages), fmt, speculative=False)
        return cache[i]

    return run


@pytest.mark.parametrize("drafter", ["prompt_lookup", "draft_model", "hybrid"])
def test_greedy_constrained_output_is_plain_constrained_output_with_each_drafter(hybrid, tokenizer, plain, drafter,
                                                                                 hybrid_plain):
    kw = {"prompt_lookup": dict(prompt_lookup_num_tokens=8, speculative=True),
          "draft_model": dict(assistant_model=hybrid.draft_model), "hybrid": {}}[drafter]
    drafted = 0
    for i, (messages, fmt, schema) in enumerate(FIVE):
        ids = chat_ids(tokenizer, messages)
        got = new_tokens(hybrid, ids, fmt, **kw)
        stats = hybrid.last_generate_stats
        assert got == plain(i), f"request {i} with {drafter}"
        assert got == hybrid_plain(i)  # the same model plainly
        parse_and_validate(tokenizer.decode(got, skip_special_tokens=True), schema)
        assert stats.acceptance_counts is not None  # a speculative request
        drafted += stats.drafted_tokens
    assert drafted > 0


def test_suffix_decoding_constrained_output_is_plain_constrained_output(smollm2_path, tokenizer, plain):
    from xpuspec import AutoModelForCausalLM, SpeculativeConfig

    model = AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", load_in_low_bit="int8_asym",
                                                 speculative=SpeculativeConfig(mode="suffix", cost_model=False))
    model.suffix_cache().clear()
    drafted = 0
    for _ in range(2):  # the second pass drafts from the first one's outputs
        for i, (messages, fmt, _) in enumerate(FIVE):
            assert new_tokens(model, chat_ids(tokenizer, messages), fmt) == plain(i), f"request {i}"
            drafted += model.last_generate_stats.drafted_tokens
    assert drafted > 0


def test_forbidden_drafts_are_cut_before_verification(ov_int8, tokenizer, plain, monkeypatch):
    """A drafter that proposes the right next tokens then one the grammar forbids: the output stays the plain
    output, and no verify pass sees the forbidden token (the matcher refuses to mask a forbidden draft)."""
    from xpuspec.grammar import GrammarMatcher
    from xpuspec.speculative import drafters

    bad = tokenizer("\n", add_special_tokens=False).input_ids[0]  # a raw newline: nowhere in this JSON layout
    messages, fmt, _ = FIVE[1]
    ids = chat_ids(tokenizer, messages)
    expected = plain(1)
    proposed = []

    def propose(self, widths):
        done = len(self.request.context) - ids.shape[1]
        tokens = expected[done:done + 2] + [bad]
        proposed.append(len(tokens))
        return drafters.Draft(tokens, None, len(tokens))

    verified = []
    mask_rows = GrammarMatcher.mask_rows

    def recording(self, drafts, rows):
        verified.append(list(drafts))
        return mask_rows(self, drafts, rows)

    monkeypatch.setattr(drafters.PromptLookupDrafter, "propose", propose)
    monkeypatch.setattr(GrammarMatcher, "mask_rows", recording)
    got = new_tokens(ov_int8, ids, fmt, prompt_lookup_num_tokens=3)
    stats = ov_int8.last_generate_stats
    assert got == expected
    assert proposed and stats.drafted_tokens > 0
    assert any(len(d) == 2 for d in verified)  # the right tokens were verified, the forbidden one cut off
    assert not any(bad in d for d in verified)
    assert stats.accepted_tokens == stats.drafted_tokens  # every draft that reached the target was right


def test_batch_rows_and_concurrent_calls_equal_their_solo_outputs(ov_int8, tokenizer, plain):
    """Rows of the batched engine carry their own grammar state."""
    messages, fmt, _ = FIVE[2]
    ids = chat_ids(tokenizer, messages)
    batch = ov_int8.generate(ids.repeat(2, 1), max_new_tokens=TOKEN_BUDGET, do_sample=False, response_format=fmt,
                             prompt_lookup_num_tokens=4)
    for row in batch:
        new = row[ids.shape[1]:].tolist()
        assert new[:len(plain(2))] == plain(2)
    results = {}

    def call(i):
        m, f, _ = FIVE[i]
        results[i] = new_tokens(ov_int8, chat_ids(tokenizer, m), f, prompt_lookup_num_tokens=4)

    threads = [threading.Thread(target=call, args=(i,)) for i in (0, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {0: plain(0), 3: plain(3)}


# -- through the server ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(smollm2_path):
    pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from test_serve import Server

    s = Server("--speculative", "prompt_lookup", "--max-batch", "2")
    yield s
    s.stop()


def test_openai_client_chat_and_completions_with_response_format(server, tokenizer, plain):
    client = server.client()
    for i in (0, 3):
        messages, fmt, schema = FIVE[i]
        want = tokenizer.decode(plain(i), skip_special_tokens=True)
        for extra in ({"speculative": False}, {}):  # plain, and the server's prompt lookup
            r = client.chat.completions.create(model=MODEL, messages=messages, response_format=fmt, temperature=0,
                                               max_tokens=TOKEN_BUDGET, extra_body=extra)
            assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"
            parse_and_validate(r.choices[0].message.content, schema)
    prompt = 'A JSON object describing a cat: '
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=96,
                                  extra_body={"response_format": {"type": "json_object"}})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].text), dict)
    else:  # cut by max_tokens: still a prefix of a JSON object
        assert r.choices[0].text.startswith("{")
    messages, fmt, schema = FIVE[4]
    stream = client.chat.completions.create(model=MODEL, messages=messages, response_format=fmt, temperature=0,
                                            max_tokens=TOKEN_BUDGET, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == tokenizer.decode(plain(4), skip_special_tokens=True)


@pytest.mark.parametrize("fmt, words", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}, "not a valid JSON schema"),
    ({"type": "xml"}, "type must be one of"),
    ({"type": "regex", "regex": "(unclosed"}, "cannot be compiled"),
])
def test_a_bad_schema_gets_a_400_naming_the_problem(server, fmt, words):
    import openai

    client = server.client()
    with pytest.raises(openai.BadRequestError, match=words):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       response_format=fmt, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match=words):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4, extra_body={"response_format": fmt})
    assert server.get("/health").status_code == 200
