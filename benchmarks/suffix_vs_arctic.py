"""Suffix decoding's CPU cost: xpuspec's suffix structures against Arctic Inference's suffix tree.

Both replay the same requests: the ``session`` prompt set (12 sessions x 3 turns) in SmolLM2 tokens, each
answer a scripted rewrite of the function (or a sentence of the document) the prompt quotes, so that
later turns repeat earlier answers as a real session does. A request is decoded teacher-forced: each round
drafts up to k tokens, keeps those that equal the scripted answer, then adds one more (the target's own).
Per round we time the drafting call and the update with the kept tokens; per request the prompt's
indexing. Memory: resident-set growth while building each global structure over the same outputs, in a
fresh process per implementation, over the session answers repeated (text a tree compresses well) and over
standard-library sources (text that repeats little).

Arctic Inference is measured when ``arctic_inference.suffix_decoding`` imports (it has no wheel for
CPython 3.11: build its sdist, see the report in benchmarks/results/suffix-vs-arctic.md).

    python benchmarks/suffix_vs_arctic.py [--k 10] [--depth 32] [--repeats 3] [--memory-tokens 200000]
"""

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Tuple

from xpuspec.bench import prompts
from xpuspec.speculative.suffix import SpeculationLimits
from xpuspec.speculative.suffix_cache import SuffixCache
from xpuspec.speculative.suffix_drafter import DraftRequest, SuffixDrafter

LIMITS = SpeculationLimits()  # vLLM's defaults: factor 1.0, offset 0, min_token_prob 0.1


def scripted_answer(session: prompts.Session, turn: int, previous: str) -> str:
    """What a model asked this turn would write: the change made to the previous answer's code, or a sentence
    of the document."""
    if session.kind == "qa":
        sentences = re.split(r"(?<=[.:])\s", " ".join(session.source.split()))
        return " " + sentences[turn % len(sentences)] + "\n"
    code = previous.split("```")[0] if previous else session.source
    name = session.name.split(".")[-1]
    param = re.search(r"def \w+\((\w+)", session.source).group(1)
    if session.kind == "edit":
        changes = (lambda c: c.replace(f"def {name}(", f"def {name.lstrip('_')}_v2(", 1),
                   lambda c: re.sub(rf"\b{param}\b", f"{param}_in", c),
                   lambda c: re.sub(r"(def [^\n]*:\n)", r"\1    # Reviewed.\n", c, count=1))
    else:
        local = re.search(r"^\s+(\w+) = ", session.source, re.M)
        variable = local.group(1) if local else param
        changes = (lambda c: re.sub(r"(def [^\n]*:\n)", r'\1    """Convert the inputs."""\n', c, count=1),
                   lambda c: re.sub(rf"\b{variable}\b", f"{variable}_value", c),
                   lambda c: re.sub(r"def (\w+)\(([^)]*)\):", lambda m: f"def {m.group(1)}({m.group(2)}) -> object:", c,
                                    count=1))
    return changes[turn](code) + "```\n"


def requests(tokenizer) -> List[Tuple[List[int], List[int]]]:
    """(prompt ids, answer ids) of every turn of every session, in order."""
    out = []
    for session in prompts.sessions():
        answers = []
        for turn in range(prompts.SESSION_TURNS):
            answer = scripted_answer(session, turn, answers[-1] if answers else "")
            out.append((tokenizer(session.prompt(turn, answers)).input_ids, tokenizer(answer).input_ids))
            answers.append(answer)
    return out


class Ours:
    name = "xpuspec"

    def __init__(self, depth: int):
        self.drafter = SuffixDrafter(SuffixCache("bench", max_tokens=1 << 20, max_depth=depth), max_depth=depth)

    def begin(self, context: List[int]) -> None:
        self.drafter.begin(DraftRequest(context, len(context), None, False))

    def propose(self, context: List[int], k: int) -> List[int]:
        return self.drafter.propose(k).tokens

    def update(self, context: List[int], kept: int, new: List[int]) -> None:
        self.drafter.accept(kept)

    def end(self) -> None:
        self.drafter.end()


class Arctic:
    name = "arctic"

    def __init__(self, depth: int):
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.cache = SuffixDecodingCache(max_tree_depth=depth, max_cached_requests=-1)
        self.depth, self.request = depth, 0

    def begin(self, context: List[int]) -> None:
        self.request += 1
        self.cache.start_request(self.request, context)

    def propose(self, context: List[int], k: int) -> List[int]:
        return self.cache.speculate(self.request, context[-self.depth:], max_spec_tokens=k,
                                    max_spec_factor=LIMITS.max_spec_factor, max_spec_offset=LIMITS.max_spec_offset,
                                    min_token_prob=LIMITS.min_token_prob).token_ids

    def update(self, context: List[int], kept: int, new: List[int]) -> None:
        self.cache.add_active_response(self.request, new)

    def end(self) -> None:
        self.cache.stop_request(self.request)


def new_times() -> dict:
    return {"begin": [], "propose": [], "update": [], "end": [], "request": [], "rounds": 0, "kept": 0, "drafted": 0}


def replay(impl, prompt: List[int], answer: List[int], k: int, times: dict) -> None:
    """Teacher-forced decoding of one request; per-call times in microseconds, and draft counts, into ``times``."""
    context = list(prompt)
    t = time.perf_counter_ns()
    impl.begin(context)
    times["begin"].append((time.perf_counter_ns() - t) / 1e3)
    first = len(times["propose"])
    done = 0
    while done < len(answer):
        t = time.perf_counter_ns()
        draft = list(impl.propose(context, k))
        times["propose"].append((time.perf_counter_ns() - t) / 1e3)
        kept = 0
        while kept < len(draft) and done + kept < len(answer) and draft[kept] == answer[done + kept]:
            kept += 1
        new = answer[done:done + kept + 1]
        context.extend(new)
        done += len(new)
        t = time.perf_counter_ns()
        impl.update(context, kept, new)
        times["update"].append((time.perf_counter_ns() - t) / 1e3)
        times["rounds"] += 1
        times["kept"] += kept
        times["drafted"] += len(draft)
    t = time.perf_counter_ns()
    impl.end()
    times["end"].append((time.perf_counter_ns() - t) / 1e3)
    times["request"].append(times["begin"][-1] + sum(times["propose"][first:]) + sum(times["update"][first:])
                            + times["end"][-1])


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def memory_child(which: str, depth: int, outputs: List[List[int]]) -> dict:
    """Resident growth while one global structure takes ``outputs`` (run in a fresh process)."""
    before = rss_bytes()
    if which == "xpuspec":
        cache = SuffixCache("bench", max_tokens=1 << 24, max_depth=depth)
        for o in outputs:
            cache.add(o)
        held = {"states": cache.states}
    else:
        from arctic_inference.suffix_decoding._C import SuffixTree

        tree = SuffixTree(depth)
        for i, o in enumerate(outputs):
            tree.extend(i, o)
        held = {"estimate_memory": tree.estimate_memory()}
    tokens = sum(map(len, outputs))
    return {"tokens": tokens, "rss_growth_bytes": rss_bytes() - before, **held}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=10, help="most tokens per draft")
    parser.add_argument("--depth", type=int, default=32, help="max tree depth (both)")
    parser.add_argument("--repeats", type=int, default=3, help="replays of the whole set per implementation")
    parser.add_argument("--memory-tokens", type=int, default=200_000, help="tokens of the global structure in the "
                        "memory measurement")
    parser.add_argument("--memory-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_child:
        which, path = args.memory_child
        with open(path) as f:
            outputs = json.load(f)
        print(json.dumps(memory_child(which, args.depth, outputs)))
        return

    from xpuspec import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained("smollm2-135m-instruct")
    work = requests(tokenizer)

    impls: List[Callable] = [Ours]
    try:
        import arctic_inference.suffix_decoding  # noqa: F401

        impls.append(Arctic)
    except ImportError as exc:
        print(f"Arctic Inference not measured: {exc}")
    print(f"{len(work)} requests, {sum(len(p) for p, _ in work)} prompt and {sum(len(a) for _, a in work)} answer "
          f"tokens; k={args.k}, depth={args.depth}, {args.repeats} replays, interleaved")
    runs = {impl.name: [] for impl in impls}
    for _ in range(args.repeats):
        live = [impl(args.depth) for impl in impls]
        for impl in live:
            runs[impl.name].append(new_times())
        for prompt, answer in work:  # side by side: each request on each implementation in turn
            for impl in live:
                replay(impl, prompt, answer, args.k, runs[impl.name][-1])
    print("microseconds: propose and update per round, begin and end per request, round = propose + update, "
          "request = begin + rounds + end (medians)")
    print(f"{'':10} {'propose (p90)':>15} {'update':>7} {'round':>7} {'begin':>7} {'end':>7} {'request':>8} "
          f"{'rounds':>7} {'kept/drafted':>12}")
    medians = {}
    for name, reps in runs.items():
        propose = [t for r in reps for t in r["propose"]]
        update = [t for r in reps for t in r["update"]]
        begin = [t for r in reps for t in r["begin"]]
        per_round = statistics.median([p + u for r in reps for p, u in zip(r["propose"], r["update"])])
        per_request = statistics.median([t for r in reps for t in r["request"]])
        medians[name] = (per_round, per_request, sum(sum(r["request"]) for r in reps))
        q = statistics.quantiles(propose, n=10)
        end = [t for r in reps for t in r["end"]]
        print(f"{name:10} {statistics.median(propose):6.1f} ({q[-1]:6.1f}) {statistics.median(update):7.1f} "
              f"{per_round:7.1f} {statistics.median(begin):7.1f} {statistics.median(end):7.1f} "
              f"{per_request:8.1f} {reps[0]['rounds']:7d} {reps[0]['kept'] / max(1, reps[0]['drafted']):12.2f}")
    if len(medians) == 2:
        ours, theirs = medians["xpuspec"], medians["arctic"]
        print(f"xpuspec / arctic: median round {ours[0] / theirs[0]:.2f}, median request {ours[1] / theirs[1]:.2f}, "
              f"all requests {ours[2] / theirs[2]:.2f}")
    streams = {"session answers, repeated": [a for _, a in work], "stdlib sources": source_chunks(tokenizer)}
    for label, items in streams.items():
        outputs, total = [], 0
        while total < args.memory_tokens:
            for answer in items:
                outputs.append(answer)
                total += len(answer)
        with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
            json.dump(outputs, f)
            f.flush()
            for impl in impls:
                mem = _memory(impl.name, args.depth, f.name)
                extra = ", ".join(f"{k} {v}" for k, v in mem.items() if k not in ("tokens", "rss_growth_bytes"))
                print(f"memory {impl.name:8} over {label}: {mem['tokens']} tokens, resident growth "
                      f"{mem['rss_growth_bytes'] / 2**20:.1f} MiB ({mem['rss_growth_bytes'] / mem['tokens']:.0f} "
                      f"B/token; {extra})")


def source_chunks(tokenizer, size: int = 300) -> List[List[int]]:
    """Outputs of ``size`` tokens cut from standard-library sources: text that repeats little."""
    import importlib
    import inspect

    ids = []
    for name in ("argparse", "calendar", "collections", "difflib", "email.message", "fractions", "inspect",
                 "json.decoder", "logging", "pathlib", "pprint", "shlex", "statistics", "string", "textwrap"):
        ids += tokenizer(inspect.getsource(importlib.import_module(name))).input_ids
    return [ids[i:i + size] for i in range(0, len(ids), size)]


def _memory(which: str, depth: int, path: str) -> dict:
    child = subprocess.run([sys.executable, __file__, "--depth", str(depth), "--memory-child", which, path],
                           capture_output=True, text=True, check=True)
    return json.loads(child.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
