"""How fast can any draft schedule make a target/draft pair on this machine? Upper bounds from measurements.

A speed target for speculative decoding may lie beyond what any schedule of drafts can reach for a
target/draft pair on a given machine. This module measures, per prompt, what decides every schedule's speed:

- the target's greedy output, ``N`` new tokens;
- the draft's teacher-forced top-1 prediction, and its probability, at each position of that output (one
  pass over prompt and output): greedy verification accepts a chain of drafts as long as its tokens equal
  these predictions. Two views: xpuspec's draft (the last ``draft_context_length`` tokens of the
  prompt, its cut LM head) and openvino_genai's (the whole prompt, the whole head);
- prompt lookup's continuation after every prefix of the output (a hybrid's: 3-grams, first occurrence);
- seconds of a target pass of each width 1..``MAX_WIDTH``, of a draft step and of the draft's prefill, per view.

It then replays the decode loop's rounds on these traces (:func:`simulate`) for fixed draft schedules
(constant k, the hybrid's lookup first; drafts stopped below a confidence threshold), for openvino_genai's
(constant k=3, no lookup), for the best of those schedules chosen per prompt with hindsight, and for an
oracle that knows in advance how many drafts each round would have accepted (:func:`oracle`; no
replayed schedule can beat it). The costs are measured, not modelled. What the replay leaves out makes it
optimistic for xpuspec's schedules: Python, the padding of verify passes to the widest of the request
(``Runner.fixed_verify_width``), a draft catching up on several tokens at the price of one step, lookup tokens
appended to a chain that was already wrong. It also leaves out the free guesses xpuspec puts in 1-token steps
on CPUs with dynamic quantization, which make its plain decoding faster than the plain row here, and 2-gram
lookup. The teacher-forced predictions equal the draft's own steps' up to near-ties (one wide pass and single
steps compute differently under dynamic quantization).

    xpuspec bound --model qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \\
        --prompts code:2,prose:2,edit:2 --max-new-tokens 32
"""

import argparse
import functools
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Sequence, Tuple

#: Widest target pass timed (a draft of MAX_WIDTH - 1 tokens).
MAX_WIDTH = 12
#: The longest prompt-lookup continuation (xpuspec's ``prompt_lookup_num_tokens`` default).
LOOKUP_TOKENS = 10
#: A hybrid's n-gram size (its lookup matches only its longest, 3).
LOOKUP_NGRAM = 3
#: openvino_genai's draft length in the bench (``genai-spec``: its sample's ``num_assistant_tokens``).
GENAI_K = 3
#: Draft steps timed per view after one untimed one; the median counts.
TIMED_STEPS = 8


@dataclass
class View:
    """The draft as one tool runs it, along the target's output.

    Attributes:
        pred: the draft's top-1 token at each of the ``N`` positions, given the target's output before it.
        prob: its probability there (softmax of the draft's logits), floats in [0, 1].
        step_s: seconds of one draft step (a 1-token pass), median.
        prefill_s: seconds of the draft's prefill of the prompt as this tool feeds it.
    """

    pred: List[int]
    prob: List[float]
    step_s: float
    prefill_s: float


@dataclass
class Trace:
    """One prompt's measurements (see the module docstring).

    Attributes:
        prompt_set: the bench prompt set (``code``, ``prose``, ``edit``).
        prompt_tokens: prompt length in tokens.
        target: the target's ``N`` greedy new tokens.
        lookup: ``lookup[i]``: prompt lookup's continuation after the prompt and ``target[:i]``, i = 0..N.
        verify_s: ``verify_s[w - 1]``: seconds of a ``w``-token target pass, w = 1..MAX_WIDTH.
        views: ``{"xpuspec": View, "genai": View}``.
    """

    prompt_set: str
    prompt_tokens: int
    target: List[int]
    lookup: List[List[int]]
    verify_s: List[float]
    views: Dict[str, View]


@dataclass(frozen=True)
class Policy:
    """A draft schedule to replay: at most ``k`` drafts a round, stopped before a draft whose probability is
    under ``threshold`` (transformers' ``assistant_confidence_threshold``; 0: off; the first draft is always
    made), prompt lookup first where an n-gram matches and ending a draft chain where its drafts make one
    (``lookup``, the hybrid), on the draft as ``view`` runs it."""

    name: str
    k: int
    threshold: float = 0.0
    lookup: bool = True
    view: str = "xpuspec"


def _matched(found: Sequence[int], target: Sequence[int], at: int) -> int:
    """How many of ``found`` equal the target's tokens from ``at`` on."""
    n = 0
    while n < len(found) and at + n < len(target) and found[n] == target[at + n]:
        n += 1
    return n


def pass_costs(trace: Trace) -> List[float]:
    """Seconds of a target pass of each width 1..MAX_WIDTH (index w - 1), made non-decreasing: a narrower pass
    costs at most what a wider one does, since it can be padded to it (as the decode loop pads), so that one
    noisy timing does not make a wider round look cheaper than a narrower one."""
    costs = list(trace.verify_s)
    for w in range(len(costs) - 2, -1, -1):
        costs[w] = min(costs[w], costs[w + 1])
    return costs


def simulate(trace: Trace, policy: Policy) -> Tuple[int, float, int]:
    """Replay greedy speculative decoding of the trace's output under ``policy``, from the first new token on.

    Each round: a lookup round (when ``policy.lookup`` and a continuation exists) is one target pass (the draft
    catches up on its tokens in the first step of its next round, which is charged there); else the draft
    makes up to ``k`` drafts at one step each (a step per considered position: the one whose probability stops
    the chain is paid too), ending early where its accepted-so-far drafts let prompt lookup continue; then one
    target pass of drafts + 1 tokens (:func:`pass_costs`). The draft's prefill is paid before its first round.
    Accepted: the drafts up to the first that differs from the target's output, and the target's own token.

    Returns:
        ``(tokens, seconds, target passes)``: ``N - 1`` decode tokens, the seconds they take, the passes.
    """
    target, n = trace.target, len(trace.target)
    view, cost = trace.views[policy.view], pass_costs(trace)
    right_at = [p == t for p, t in zip(view.pred, target)]
    seconds, passes, i, started = 0.0, 0, 1, False
    while i < n:
        passes += 1
        room = n - i - 1  # drafts this round may hold
        found = trace.lookup[i][:room] if policy.lookup else []
        if found:
            seconds += cost[len(found)]
            i += _matched(found, target, i) + 1
            continue
        seconds += 0.0 if started or room == 0 else view.prefill_s
        started = started or room > 0
        drafts = accepted = 0
        right = True
        while drafts < min(policy.k, room):
            seconds += view.step_s
            if drafts and view.prob[i + drafts] < policy.threshold:
                break
            right = right and right_at[i + drafts]
            drafts += 1
            accepted += right
            found = trace.lookup[i + drafts][:min(policy.k, room) - drafts] if policy.lookup and right else []
            if found:
                accepted += _matched(found, target, i + drafts)
                drafts += len(found)
                break
        seconds += cost[drafts]
        i += accepted + 1
    return n - 1, seconds, passes


def oracle(trace: Trace) -> Tuple[int, float]:
    """The fastest the replayed schedules (xpuspec's draft model, 3-gram prompt lookup, plain steps without
    guesses) could decode the trace, each round knowing how many drafts the target will accept: a plain step,
    a lookup round cut to any part of its matched tokens, or a model chain of drafts that will all be accepted,
    possibly ended by any part of lookup's matched continuation; the draft's prefill paid before its first
    chain. Dynamic programming over the tokens produced so far and whether the draft has prefilled; with
    :func:`pass_costs`, no :class:`Policy` replayed by :func:`simulate` is faster.

    Returns:
        ``(tokens, seconds)``: ``N - 1`` decode tokens and the least seconds they take.
    """
    target, n, v, cost = trace.target, len(trace.target), trace.views["xpuspec"], pass_costs(trace)
    run = [0] * (n + 1)  # run[i]: consecutive positions from i where the draft's prediction is right
    for j in range(n - 1, -1, -1):
        run[j] = run[j + 1] + 1 if v.pred[j] == target[j] else 0
    best = [[0.0, 0.0] for _ in range(n + 1)]  # best[i][started]: least seconds from i tokens to the end
    for i in range(n - 1, 0, -1):
        room = min(n - i - 1, MAX_WIDTH - 1)
        for started in (0, 1):
            options = [cost[0] + best[i + 1][started]]
            matched = _matched(trace.lookup[i][:room], target, i)
            options += [cost[c] + best[i + c + 1][started] for c in range(1, matched + 1)]
            prefill = 0.0 if started else v.prefill_s
            for d in range(1, min(run[i], room) + 1):
                chain = prefill + d * v.step_s
                options.append(chain + cost[d] + best[i + d + 1][1])
                matched = _matched(trace.lookup[i + d][:room - d], target, i + d)
                options += [chain + cost[d + c] + best[i + d + c + 1][1] for c in range(1, matched + 1)]
            best[i][started] = min(options)
    return n - 1, best[1][0]


def policies() -> List[Policy]:
    """The schedules replayed: xpuspec's hybrid at constant k = 1..MAX_WIDTH-4 and confidence-stopped at
    thresholds 0.5, 0.7, 0.9 (k up to 8), and openvino_genai's (first)."""
    out = [Policy("openvino_genai: k=3, no lookup", GENAI_K, lookup=False, view="genai")]
    out += [Policy(f"hybrid, k={k}", k) for k in range(1, MAX_WIDTH - 3)]
    out += [Policy(f"hybrid, k<=8, threshold {t}", 8, threshold=t) for t in (0.5, 0.7, 0.9)]
    return out


def summarize(traces: Sequence[Trace]) -> List[dict]:
    """Decode tokens/s per prompt set and overall (sum of tokens over sum of seconds, as the bench) of each
    policy, of plain decoding, of the best hybrid policy per prompt in hindsight and of the oracle, with the
    ratio to openvino_genai's schedule.

    Returns:
        one dict per row: ``schedule`` (str), ``tokens_per_s`` (``{set name: float, "all": float}``), ``vs_genai``.
    """
    rows = {p.name: [simulate(t, p)[:2] for t in traces] for p in policies()}
    xpuspec = [name for name in rows if name.startswith("hybrid")]
    rows["plain decoding (1-token steps, no guesses)"] = [(len(t.target) - 1, (len(t.target) - 1) * pass_costs(t)[0])
                                                          for t in traces]
    rows["best hybrid schedule per prompt (hindsight)"] = [
        min((rows[name][i] for name in xpuspec), key=lambda r: r[1]) for i in range(len(traces))]
    rows["oracle (knows each round's accepted drafts)"] = [oracle(t) for t in traces]
    out = []
    for name, results in rows.items():
        sums: Dict[str, List[float]] = {}
        for trace, (tokens, seconds) in zip(traces, results):
            for key in (trace.prompt_set, "all"):
                acc = sums.setdefault(key, [0, 0.0])
                acc[0] += tokens
                acc[1] += seconds
        out.append({"schedule": name, "tokens_per_s": {k: v[0] / v[1] for k, v in sums.items()}})
    base = out[0]["tokens_per_s"]["all"]
    for row in out:
        row["vs_genai"] = row["tokens_per_s"]["all"] / base
    return out


def markdown(rows: Sequence[dict]) -> str:
    """The rows of :func:`summarize` as a markdown table."""
    sets = [k for k in rows[0]["tokens_per_s"] if k != "all"]
    lines = ["| schedule | " + " | ".join(sets) + " | all | vs openvino_genai's schedule |",
             "|---|" + "---|" * (len(sets) + 2)]
    for row in rows:
        tps = row["tokens_per_s"]
        lines.append(f"| {row['schedule']} | " + " | ".join(f"{tps[s]:.1f}" for s in sets)
                     + f" | {tps['all']:.1f} | {row['vs_genai']:.2f}x |")
    return "\n".join(lines)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _view(runner, prompt: List[int], output: List[int], context_length: int) -> View:
    """Predictions and costs of a draft ``runner`` that sees the last ``context_length`` prompt tokens (0: all)."""
    import torch

    seen = prompt[-context_length:] if context_length else prompt
    runner.reset()
    rows = runner.forward(seen + output[:-1], logits_to_keep=len(output))  # row j scores output[j]
    prob, pred = torch.softmax(rows, dim=-1).max(dim=-1)
    runner.reset()
    prefill_s = _timed(lambda: runner.forward(seen, logits_to_keep=1))
    steps = [_timed(lambda: runner.forward([token], exact=False)) for token in output[:1 + TIMED_STEPS]]
    runner.reset()
    return View(pred.tolist(), prob.tolist(), statistics.median(steps[1:]), prefill_s)


def measure(model, genai_draft, prompt_set: str, prompt: List[int], new_tokens: int) -> Trace:
    """The :class:`Trace` of one prompt.

    Args:
        model: an xpuspec model loaded with ``speculative="hybrid"`` and its draft (its target and draft
            runners are timed).
        genai_draft: the draft model's runner with the whole LM head (openvino_genai's draft).
        prompt_set: the prompt's set name.
        prompt: prompt token ids.
        new_tokens: ``N``.
    """
    import torch

    from ..speculative.profile import measure_profile

    out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, speculative=False)
    output = out[0, len(prompt):].tolist()
    continuations = lookup_continuations(prompt, output)
    target = model.runner
    target.reset()
    target.forward(prompt, logits_to_keep=1)
    profile = measure_profile(target, prompt[-1], MAX_WIDTH)
    target.reset()
    views = {"xpuspec": _view(model.draft_model.runner, prompt, output, model.speculative_config.draft_context),
             "genai": _view(genai_draft, prompt, output, 0)}
    return Trace(prompt_set, len(prompt), output, continuations, [profile.pass_s(w) for w in range(1, MAX_WIDTH + 1)], views)


def lookup_continuations(prompt: List[int], output: List[int], ngram: int = LOOKUP_NGRAM,
                         k: int = LOOKUP_TOKENS) -> List[List[int]]:
    """Prompt lookup's continuation (up to ``k`` tokens, ``ngram``-gram matches) after ``prompt + output[:i]``, for
    i = 0..len(output)."""
    from ..speculative.drafters import DraftRequest, PromptLookupDrafter

    lookup, context = PromptLookupDrafter(ngram, ngram), list(prompt)
    lookup.begin(DraftRequest(context, None, False))
    found = []
    for i in range(len(output) + 1):
        found.append(lookup.lookup(context, k))
        context.extend(output[i:i + 1])
    return found


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``xpuspec bound``."""
    from ..lowbit import FORMATS

    p.add_argument("--model", required=True, help="target: built-in name or folder")
    p.add_argument("--draft", required=True, help="draft model: built-in name or folder (the target's tokenizer)")
    p.add_argument("--low-bit", default="int8_asym", type=str.lower, choices=FORMATS,
                   help="target weight format (default int8_asym, as xpuspec bench)")
    p.add_argument("--draft-low-bit", default="int4_sym", type=str.lower, choices=FORMATS,
                   help="draft weight format (default int4_sym, as xpuspec bench)")
    p.add_argument("--prompts", default="code:2,prose:2,edit:2", help="bench prompt sets, as xpuspec bench's --prompts")
    p.add_argument("--max-new-tokens", type=int, default=32, help="new tokens per prompt, at least 2 (default 32)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the table and the measured traces as JSON")


def run(args: argparse.Namespace) -> int:
    """Run ``xpuspec bound`` from parsed arguments: measure every prompt, print the table, write JSON if asked.

    Raises:
        ValueError: ``--max-new-tokens`` under 2, a bad ``--prompts``, or a ``--json`` path in no folder (before any
            model loads); the loaders' errors for a model that does not load or a draft that does not fit it.
    """
    from .. import AutoModelForCausalLM, AutoTokenizer, SpeculativeConfig
    from ..errors import ModelSourceError
    from .harness import check_output_file
    from .prompts import parse_prompt_spec, select
    from .systems import DEFAULT_KV_CACHE_PRECISION, xpuspec_ov_config

    if args.max_new_tokens < 2:
        raise ValueError(f"--max-new-tokens must be at least 2 (the first token is not decoded), got "
                         f"{args.max_new_tokens}.")
    chosen = select(parse_prompt_spec(args.prompts))
    json_path = check_output_file("--json", args.json)
    ov_config = xpuspec_ov_config(DEFAULT_KV_CACHE_PRECISION)  # as xpuspec bench runs xpuspec
    try:  # the draft first: it is the smaller, and a wrong name is found before the target loads
        genai_draft = AutoModelForCausalLM.from_pretrained(args.draft, load_in_low_bit=args.draft_low_bit,
                                                           ov_config=ov_config).runner
    except ModelSourceError as exc:
        raise ModelSourceError(f"--draft: {exc}") from None
    model = AutoModelForCausalLM.from_pretrained(
        args.model, load_in_low_bit=args.low_bit, ov_config=ov_config,
        speculative=SpeculativeConfig(mode="hybrid", draft=args.draft, draft_low_bit=args.draft_low_bit))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    items = [(name, text) for name, texts in chosen.items() for text in texts]
    traces = []
    for number, (prompt_set, text) in enumerate(items, 1):
        traces.append(measure(model, genai_draft, prompt_set, tokenizer(text).input_ids, args.max_new_tokens))
        print(f"measured prompt {number}/{len(items)} ({prompt_set}, {traces[-1].prompt_tokens} tokens)",
              file=sys.stderr)
    rows = summarize(traces)
    print(f"Decode tokens/s replayed from measured costs and acceptance ({len(traces)} prompts x {args.max_new_tokens} "
          "new tokens; not a timed run, see `xpuspec/bench/bound.py`):\n")
    print(markdown(rows))
    if json_path is not None:
        settings = {k: v for k, v in vars(args).items() if k != "run"}
        json_path.write_text(json.dumps({"settings": settings, "table": rows, "traces": [asdict(t) for t in traces]},
                                        indent=1))
    return 0
