"""Target passes of suffix decoding against prompt lookup, replayed on a real model's greedy outputs.

Runs the ``session`` set as the bench harness will (each turn's prompt holds the earlier turns' answers,
decoded from the model's plain greedy output) and a few ``edit`` and ``code`` prompts, with SmolLM2-135M
int8 plain greedy decoding; then replays every output teacher-forced through each drafter: a round drafts up
to k tokens after the context, keeps those equal to the output, and adds the target's next token. The
number of rounds is the number of target passes speculative decoding would make with that drafter at a
constant k (the engine's length policy, which cuts drafts to what the verify costs favour, is left out).
One SuffixCache serves all requests in order, as a loaded model's would.

    python benchmarks/suffix_session_replay.py [--sessions 12] [--others 4] [--max-new-tokens 96] [--k 10]
        [--references FILE]   (reuse or save the greedy outputs)
"""

import argparse
import json
import os
from typing import Callable, Dict, List, Tuple

from xpuspec.bench import prompts
from xpuspec.speculative.drafters import PromptLookupDrafter
from xpuspec.speculative.suffix_cache import SuffixCache
from xpuspec.speculative.suffix_drafter import DraftRequest, SuffixDrafter

MODEL = "smollm2-135m-instruct"


def greedy_outputs(n_sessions: int, n_others: int, max_new: int) -> List[Tuple[str, List[int], List[int]]]:
    """(set, prompt ids, greedy output ids) in the order a session runs: sessions turn by turn, then the others."""
    from xpuspec import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", load_in_low_bit="int8_asym")

    def run(text: str) -> Tuple[List[int], List[int]]:
        ids = tokenizer(text, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=max_new, do_sample=False)[0].tolist()
        return ids[0].tolist(), out[ids.shape[1]:]

    items = []
    for session in prompts.select_sessions(n_sessions * prompts.SESSION_TURNS):
        answers = []
        for turn in range(prompts.SESSION_TURNS):
            prompt, output = run(session.prompt(turn, answers))
            answers.append(tokenizer.decode(output, skip_special_tokens=True))
            items.append(("session", prompt, output))
    for name in ("edit", "code"):
        for text in prompts.select({name: n_others})[name]:
            items.append((name, *run(text)))
    return items


def passes(propose: Callable[[List[int], int], List[int]], begin, end, prompt, output, k) -> int:
    """Target passes of a teacher-forced replay of ``output`` after ``prompt``."""
    context = list(prompt)
    begin(context)
    done = rounds = 0
    while done < len(output):
        draft = propose(context, k)
        kept = 0
        while kept < len(draft) and done + kept < len(output) and draft[kept] == output[done + kept]:
            kept += 1
        new = output[done:done + kept + 1]
        context.extend(new)
        done += len(new)
        rounds += 1
        end(kept, done == len(output))
    return rounds


def suffix_system(drafter: SuffixDrafter):
    def begin(context):
        drafter.begin(DraftRequest(context, len(context), None, False))

    def end(kept, finished):
        drafter.accept(kept)
        if finished:
            drafter.end()

    return (lambda context, k: drafter.propose(k).tokens), begin, end


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=12)
    parser.add_argument("--others", type=int, default=4, help="edit and code prompts each")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--references", help="JSON file of greedy outputs to reuse (written when absent)")
    args = parser.parse_args(argv)
    if args.references and os.path.exists(args.references):
        with open(args.references) as f:
            items = [tuple(x) for x in json.load(f)]
    else:
        items = greedy_outputs(args.sessions, args.others, args.max_new_tokens)
        if args.references:
            with open(args.references, "w") as f:
                json.dump(items, f)

    lookup = PromptLookupDrafter(max_matching_ngram_size=3, min_matching_ngram_size=2)
    systems: Dict[str, tuple] = {
        "prompt lookup": (lambda context, k: lookup.lookup(context, k), lambda c: None, lambda kept, f: None),
        "suffix, own text only": suffix_system(SuffixDrafter(None, share_across_requests=False)),
        "suffix, shared cache": suffix_system(SuffixDrafter(SuffixCache(MODEL))),
    }
    sets = sorted({s for s, _, _ in items}, key=["session", "edit", "code"].index)
    counts = {name: {s: 0 for s in sets} for name in systems}
    tokens = {s: 0 for s in sets}
    turns = {name: [0] * prompts.SESSION_TURNS for name in systems}
    session_index = 0
    for set_name, prompt, output in items:
        tokens[set_name] += len(output)
        for name, (propose, begin, end) in systems.items():
            n = passes(propose, begin, end, prompt, output, args.k)
            counts[name][set_name] += n
            if set_name == "session":
                turns[name][session_index % prompts.SESSION_TURNS] += n
        session_index += set_name == "session"
    print(f"target passes at k={args.k} (plain decoding: one per token); SmolLM2-135M int8 greedy outputs of "
          f"{sum(1 for s, _, _ in items if s == 'session')} session turns and {args.others} edit and code prompts")
    print(f"{'':24}" + "".join(f"{s + ' (' + str(tokens[s]) + ' tokens)':>24}" for s in sets)
          + "".join(f"{'session turn ' + str(t + 1):>16}" for t in range(prompts.SESSION_TURNS)))
    for name in systems:
        cells = "".join(f"{counts[name][s]:>10} ({counts['prompt lookup'][s] / counts[name][s]:.2f}x lookup)"
                        for s in sets)
        print(f"{name:24}{cells}" + "".join(f"{t:>16}" for t in turns[name]))


if __name__ == "__main__":
    main()
