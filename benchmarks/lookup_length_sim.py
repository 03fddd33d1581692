"""Which prompt-lookup rule would pay most, replayed on the target's own greedy outputs (teacher forcing), with the
target's measured pass costs: a tool to choose a rule before building it, on sets it was not tuned on.

    PYTHONPATH=.:plugins python benchmarks/lookup_length_sim.py [--model smollm2-135m-instruct] [--prompts 12] [--skip 0]

For each set (code, prose, edit, heldout) it decodes ``--prompts`` prompts plainly (chat template, ``--new`` tokens),
after the first ``--skip`` of the set, then replays every output: at each round a rule drafts from the context
(prompt and output so far), the drafts are accepted up to the first that differs from the output, and the round
costs the target's measured pass of its width (:func:`xpuspec.speculative.profile.measure_profile`; a round is at
least ``single_step_width`` wide, as the runner pads it, and a round without drafts carries the free guess of
:mod:`xpuspec.decode` where it is). It prints predicted tokens per second of passes and tokens per pass for each rule:

- ``guess``: plain steps, each with the runner's free 1-token guess (n-gram 3..1, earliest match);
- ``k=3``: up to 3 drafts from the earliest match of the longest n-gram (3..2), as openvino_genai and transformers
  draft;
- ``policy``: xpuspec's prompt lookup (its ``PromptLookupDrafter`` and ``RequestPolicy``, the round as
  :mod:`xpuspec.decode` runs it): one length for every round, from the acceptance counts and the profile.

The Python work per round and the prefill are not in the figures: compare rules with each other, not with a bench.
"""

import argparse
import json
from typing import List, Sequence, Tuple

from xpuspec.decode import GUESS_NGRAMS
from xpuspec.speculative.drafters import NO_DRAFT, DraftRequest, PromptLookupDrafter
from xpuspec.speculative.policy import RoundOutcome, SpeculationPolicy, Widths
from xpuspec.speculative.profile import CostProfile
from xpuspec.speculative.schedule import DraftSchedule

RULES = ("guess", "k=3", "policy")


def _begun(drafter: PromptLookupDrafter, context: List[int]) -> PromptLookupDrafter:
    drafter.begin(DraftRequest(context, lambda prefix, logits: logits, False))
    return drafter


def replay(rows: Sequence[Tuple[List[int], List[int]]], rule: str, profile: CostProfile,
           min_width: int) -> Tuple[float, float]:
    """Predicted (tokens per second of passes, tokens per pass) of ``rule`` over ``rows`` of (prompt, output)."""
    tokens = passes = 0
    seconds = 0.0
    parent = SpeculationPolicy(uses_model=False, step_width=min_width, name="prompt lookup")
    for prompt, output in rows:
        context, t = list(prompt), 0
        lookup = _begun(PromptLookupDrafter(3, 2), context)
        guesser = _begun(PromptLookupDrafter(*GUESS_NGRAMS), context) if min_width > 1 else None
        policy = parent.begin(DraftSchedule().for_lookup(), profile, with_model=False)
        while t < len(output):
            room = len(output) - t - 1
            if rule == "k=3":
                widths = Widths(0, min(3, room))
            elif rule == "policy":
                widths = policy.widths(t, room)
            else:
                widths = Widths(0, 0)
            draft = lookup.propose(widths) if widths.free > 0 else NO_DRAFT
            guessed = not draft.tokens and guesser is not None and room > 0
            if guessed:
                draft = guesser.propose(Widths(0, min_width - 1))
            kept = 0
            while kept < len(draft.tokens) and draft.tokens[kept] == output[t + kept]:
                kept += 1
            step = min(kept + 1, len(output) - t)
            width = max(min_width, len(draft.tokens) + 1)
            context += output[t:t + step]
            t += step
            tokens, passes, seconds = tokens + step, passes + 1, seconds + profile.pass_s(width)
            if draft.tokens and rule == "policy":
                policy.report(RoundOutcome(len(draft.tokens), kept, len(draft.tokens), 0.0, profile.pass_s(width),
                                           width), t)
        parent.finish(policy)
    return tokens / seconds, tokens / passes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=12, help="prompts per set")
    parser.add_argument("--skip", type=int, default=0, help="leave out the first prompts of each set (held out)")
    parser.add_argument("--new", type=int, default=96, help="new tokens per prompt")
    parser.add_argument("--sets", default="code,prose,edit,heldout")
    parser.add_argument("--json", help="write the outputs and figures here")
    args = parser.parse_args()

    from xpuspec import AutoModelForCausalLM, AutoTokenizer
    from xpuspec.bench.prompts import full_set
    from xpuspec.speculative.profile import measure_profile

    model = AutoModelForCausalLM.from_pretrained(args.model, device="cpu", load_in_low_bit="int8_asym")
    tok = AutoTokenizer.from_pretrained(args.model)
    outputs = {}
    for name in args.sets.split(","):
        rows = []
        for prompt in full_set(name)[args.skip:args.skip + args.prompts]:
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)["input_ids"]
            out = model.generate(ids, max_new_tokens=args.new, do_sample=False)
            rows.append((ids[0].tolist(), out[0, ids.shape[1]:].tolist()))
        outputs[name] = rows
    runner = model.runner
    runner.forward(outputs[next(iter(outputs))][0][0])
    profile = measure_profile(runner, 0, widest=DraftSchedule().lookup_tokens + 1)
    runner.reset()
    width = runner.traits.single_step_width
    figures = {name: {rule: replay(rows, rule, profile, width) for rule in RULES}
               for name, rows in outputs.items()}
    print(f"pass ms by width: {', '.join(f'{w}: {1000 * profile.pass_s(w):.1f}' for w in range(1, 12))}; "
          f"1-token steps run {width} wide")
    print("| set | " + " | ".join(RULES) + " |")
    print("|---|" + "---|" * len(RULES))
    for name, by_rule in figures.items():
        print(f"| {name} | " + " | ".join(f"{tps:.1f} tok/s, {tpp:.2f}/pass" for tps, tpp in by_rule.values()) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"outputs": outputs, "figures": figures, "pass_s": profile.seconds}, f)


if __name__ == "__main__":
    main()
