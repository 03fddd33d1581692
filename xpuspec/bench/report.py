"""A benchmark report: per-call records, the summary, and its markdown table, JSON schema check,
comparison of two reports, and plot.

Aggregation: per system and prompt set, each repeat gives one figure over all its prompts
(decode tokens/s = sum of (new tokens - 1) / sum of decode seconds; end-to-end tokens/s = sum of
new tokens / sum of call seconds; TTFT = median over calls). The report gives the median and the
min-max of these over repeats. The ratio to the baseline is taken per repeat (systems are
interleaved, so a repeat's systems saw the same machine) and its median reported.
"""

import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional

from ..speculative.audit import IDENTICAL, TIE, VIOLATION, classify
from .memory import LOW_MEMORY_SHARE, is_short
from .prompts import SETS
from .roofline import percent_of_roofline, roofline_tokens_per_s

SCHEMA_VERSION = 1
SCHEMA_FILE = Path(__file__).with_name("schema.json")
SPLITS = ("all",) + SETS
_SEVERITY = {IDENTICAL: 0, TIE: 1, VIOLATION: 2}


def sample_record(system: str, repeat: int, set_name: str, index: int, prompt_tokens: int, sample) -> dict:
    """One timed call (a :class:`xpuspec.bench.systems.Sample`) as a JSON record, without its tokens."""
    return {"system": system, "repeat": repeat, "set": set_name, "prompt": index, "prompt_tokens": prompt_tokens,
            "new_tokens": len(sample.tokens), "ttft_s": sample.ttft_s, "decode_s": sample.decode_s,
            "total_s": sample.total_s, "steps": sample.steps, "first_step_tokens": sample.first_step_tokens,
            "drafted": sample.drafted, "accepted": sample.accepted, "idle": sample.idle}


def with_audit(record: dict, tokens: List[int], reference, tolerance: float) -> dict:
    """``record`` with its exactness audit: ``tokens`` against the plain greedy ``reference`` of the same
    weights (``(tokens, top-2 margins)``)."""
    status, first, margin = classify(reference[0], reference[1], tokens, tolerance)
    return {**record, "audit": {"status": status, "first_difference": first, "margin": margin}}


def _stat(values: List[Optional[float]]) -> Optional[dict]:
    values = [v for v in values if v is not None]
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None


def _decode_rate(rows: List[dict]) -> Optional[float]:
    """Tokens after each call's first step over the seconds after it (``None`` when every call
    delivered all its tokens in its first step)."""
    seconds = sum(r["decode_s"] for r in rows)
    return sum(r["new_tokens"] - r["first_step_tokens"] for r in rows) / seconds if seconds > 0 else None


def _by_repeat(rows: List[dict]) -> Dict[int, List[dict]]:
    out = defaultdict(list)
    for r in rows:
        out[r["repeat"]].append(r)
    return dict(sorted(out.items()))


def _figures(rows: List[dict], base_rows: List[dict], bandwidth: float, weight_bytes: int) -> dict:
    repeats, base = _by_repeat(rows), _by_repeat(base_rows)
    decode = _stat([_decode_rate(rs) for rs in repeats.values()])
    pairs = [(_decode_rate(rs), _decode_rate(base[k])) for k, rs in repeats.items() if k in base]
    ratios = [a / b for a, b in pairs if a is not None and b]
    drafted = [r["drafted"] for r in rows if r["drafted"] is not None]
    accepted = sum(r["accepted"] for r in rows if r["accepted"] is not None)
    later_steps = sum(r["steps"] - 1 for r in rows)
    worst = {}
    for r in rows:
        key = (r["set"], r["prompt"])
        if _SEVERITY[r["audit"]["status"]] >= _SEVERITY[worst.get(key, IDENTICAL)]:
            worst[key] = r["audit"]["status"]
    return {
        "calls": len(rows),
        "decode_tokens_per_s": decode,
        "ttft_ms": _stat([1000 * statistics.median(r["ttft_s"] for r in rs) for rs in repeats.values()]),
        "e2e_tokens_per_s": _stat([sum(r["new_tokens"] for r in rs) / sum(r["total_s"] for r in rs)
                                   for rs in repeats.values()]),
        "ratio_to_baseline": statistics.median(ratios) if ratios else None,
        "acceptance_rate": accepted / sum(drafted) if drafted and sum(drafted) > 0 else None,
        "mean_accepted_length": (sum(r["new_tokens"] - r["first_step_tokens"] for r in rows) / later_steps
                                 if later_steps > 0 else None),
        "roofline_percent": percent_of_roofline(decode["median"], bandwidth, weight_bytes)
        if decode and weight_bytes else None,
        "audit": {status: sum(1 for s in worst.values() if s == status) for status in _SEVERITY},
        "idle_fraction": _idle(rows),
    }


def _idle(rows: List[dict]) -> Optional[dict]:
    """Median share of wall time the target and the draft did not compute (``None`` where not reported)."""
    idle = [r["idle"] for r in rows if r.get("idle")]
    return {who: statistics.median(i[who] for i in idle) for who in ("target", "draft")} if idle else None


def summarize(result: dict) -> dict:
    """``{system: {split: figures}}`` for the splits ``all``, ``code``, ``prose``, ``edit``, ``session`` that have calls.

    Figures: ``decode_tokens_per_s``, ``ttft_ms``, ``e2e_tokens_per_s`` (each median/min/max over
    repeats), ``ratio_to_baseline`` (median of per-repeat ratios of decode tokens/s),
    ``acceptance_rate`` (accepted / drafted tokens; ``None`` where the API does not expose them),
    ``mean_accepted_length`` (tokens per decode step after the first step), ``roofline_percent``
    (median decode tokens/s over bandwidth / weight bytes), ``audit`` (prompts whose output was
    identical / a tie / a VIOLATION against plain greedy, worst over repeats), ``idle_fraction``
    (median share of each call's wall time the target / the draft did not compute; xpuspec only), ``rss_mib``.
    """
    settings, samples = result["settings"], result["samples"]
    bandwidth = result["roofline"]["bandwidth_bytes_per_s"]
    out = {}
    for system in measured(result):
        info = result["systems"][system]
        out[system] = {}
        for split in SPLITS:
            def pick(name):
                return [r for r in samples if r["system"] == name and split in ("all", r["set"])]

            rows = pick(system)
            if rows:
                out[system][split] = _figures(rows, pick(settings["baseline"]), bandwidth, info["weight_bytes"])
        out[system]["rss_mib"] = (info["peak_rss_bytes"] - info["idle_rss_bytes"]) / 2**20
    return out


def measured(result: dict) -> List[str]:
    """The systems of the run that did not fail (a failed system's record has an ``error``), in the run's order."""
    return [n for n in result["settings"]["systems"] if "error" not in result["systems"].get(n, {"error": None})]


def failed(result: dict) -> Dict[str, str]:
    """``{system: its error}`` for the systems that failed to load or run."""
    return {n: info["error"] for n, info in result["systems"].items() if "error" in info}


def _load_cell(load: Optional[dict]) -> str:
    if not load or not load.get("start") or not load.get("end"):
        return ""
    return f" · load average {load['start'][0]:.2f} at the start, {load['end'][0]:.2f} at the end"


def validate(result: dict) -> None:
    """Check ``result`` against ``schema.json`` (with ``jsonschema`` where installed, else its required keys).

    Raises:
        ValueError: the report does not match the schema.
    """
    schema = json.loads(SCHEMA_FILE.read_text())
    try:
        import jsonschema
    except ImportError:
        missing = [k for k in schema["required"] if k not in result]
        if missing:
            raise ValueError(f"Not a bench report: missing {', '.join(missing)}.")
        return
    try:
        jsonschema.validate(result, schema)
    except jsonschema.ValidationError as exc:
        where = "/".join(map(str, exc.absolute_path)) or "(top level)"
        raise ValueError(f"Not a valid bench report at {where}: {exc.message}") from None


def load(path) -> dict:
    """Read and validate a JSON report written by ``xpuspec bench --json``.

    Raises:
        ValueError: the file is not valid JSON or not a report.
    """
    try:
        result = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from None
    validate(result)
    return result


def _fmt(value: Optional[float], spec: str = ".1f", suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def _median(stat: Optional[dict]) -> Optional[float]:
    return stat["median"] if stat else None


def _audit_cell(counts: dict) -> str:
    return f"{counts[IDENTICAL]} / {counts[TIE]} / {counts[VIOLATION]}"


def markdown(result: dict) -> str:
    """The report as markdown: a header with the run's settings, the main table over all prompts,
    decode tokens/s per prompt set, and the non-identical outputs."""
    s, summary = result["settings"], result["summary"]
    base, bandwidth = s["baseline"], result["roofline"]["bandwidth_bytes_per_s"]
    sets = {name: v["count"] for name, v in result["prompts"]["sets"].items()}
    lines = [
        f"## xpuspec bench: {s['model']} ({s['low_bit']})" + (f", draft {s['draft']} ({s['draft_low_bit']})" if s["draft"] else ""),
        "",
        f"{result['created']} · {result['machine']['cpu']}, {result['machine']['cores']} cores · "
        f"prompts {', '.join(f'{k} {v}' for k, v in sets.items())} · {s['max_new_tokens']} new tokens · "
        f"{s['repeats']} repeats, interleaved per {s['interleave']} · greedy · OpenVINO KV cache "
        f"{s['kv_cache_precision'] or 'tool default'}"
        + (f" · competing load: {s['competing_load']} busy process(es)" if s.get("competing_load") else "")
        + _load_cell(result.get("load_average")),
    ]
    if result.get("command"):
        lines += ["", f"`{result['command']}`"]
    lines += ["", f"| system | decode tok/s | min-max | vs {base} | TTFT ms | e2e tok/s | acceptance | "
                  "mean accepted length | RSS MiB | % roofline | audit (identical / tie / violation) |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for system in measured(result):
        f = summary[system]["all"]
        d = f["decode_tokens_per_s"] or {"median": None, "min": None, "max": None}
        lines.append(
            f"| {system} | {_fmt(d['median'])} | {_fmt(d['min'])}-{_fmt(d['max'])} | "
            f"{_fmt(f['ratio_to_baseline'], '.2f', 'x')} | "
            f"{f['ttft_ms']['median']:.0f} | {f['e2e_tokens_per_s']['median']:.1f} | "
            f"{_fmt(None if f['acceptance_rate'] is None else 100 * f['acceptance_rate'], '.0f', '%')} | "
            f"{_fmt(f['mean_accepted_length'], '.2f')} | {summary[system]['rss_mib']:.0f} | "
            f"{_fmt(f['roofline_percent'], '.0f', '%')} | {_audit_cell(f['audit'])} |")
    split_names = [n for n in SETS if n in sets]
    if len(split_names) > 1:
        lines += ["", "Decode tokens/s by prompt set (ratio to the baseline):", "",
                  "| system | " + " | ".join(split_names) + " |", "|---|" + "---|" * len(split_names)]
        for system in measured(result):
            cells = [f"{_fmt(_median(summary[system][n]['decode_tokens_per_s']))} "
                     f"({_fmt(summary[system][n]['ratio_to_baseline'], '.2f', 'x')})" for n in split_names]
            lines.append(f"| {system} | " + " | ".join(cells) + " |")
    idle = [(system, summary[system]["all"].get("idle_fraction")) for system in measured(result)]
    idle = [(system, f) for system, f in idle if f]
    if idle:
        lines += ["", "Idle fraction (share of wall time a model did not compute):", "",
                  "| system | target idle | draft idle |", "|---|---|---|"]
        lines += [f"| {system} | {100 * f['target']:.0f}% | {100 * f['draft']:.0f}% |" for system, f in idle]
    target = next((i["weight_bytes"] for i in result["systems"].values() if i["family"] == "ir"), None)
    lines += ["", f"Read bandwidth {bandwidth / 1e9:.1f} GB/s ({result['roofline']['method']})"
              + (f"; plain-decoding roofline of the target IR {roofline_tokens_per_s(bandwidth, target):.0f} tok/s "
                 f"({target / 2**20:.0f} MiB of weights per token)" if target else "") + ". "
              "RSS: the worker's peak minus its RSS before loading. Audit: each output against the plain greedy "
              "output of the same weights (transformers fp32 for hf*, xpuspec plain on the IR for the rest); "
              f"tie = diverged where the plain top-2 margin is under {s['tie_tolerance']:g}."]
    for system, error in failed(result).items():
        lines += ["", f"**Failed:** {system}: {error} (its traceback is in the JSON report)"]
    total = result["machine"].get("memory_mib")
    short = [r for r in result["samples"] if is_short(r.get("memory_available_mib"), total)]
    if short:
        where = sorted({f"{r['system']} ({r['set']} prompt {r['prompt']})" for r in short})
        lines += ["", f"**Short of memory:** {len(short)} of {len(result['samples'])} timed calls began with under "
                      f"{100 * LOW_MEMORY_SHARE:.0f}% of the machine's {total} MiB available; their timings may "
                      f"measure paging, not the system: {', '.join(where)}."]
    odd = [r for r in result["samples"] if r["audit"]["status"] != IDENTICAL]
    if odd:
        lines += ["", "Outputs that differ from plain greedy:", ""]
        seen = set()
        for r in odd:
            key = (r["system"], r["set"], r["prompt"], r["audit"]["status"])
            if key not in seen:
                seen.add(key)
                a = r["audit"]
                short = (f"; it returned {r['new_tokens']} of {s['max_new_tokens']} tokens"
                         if r["new_tokens"] != s["max_new_tokens"] else "")
                lines.append(f"- {r['system']}, {r['set']} prompt {r['prompt']}: {a['status']} at new token "
                             f"{a['first_difference']} (plain top-2 margin {_fmt(a['margin'], '.4f')}{short})")
    return "\n".join(lines)


def compare(a: dict, b: dict) -> str:
    """Markdown comparison of two reports: decode tokens/s of each system in A and B, B/A, and each
    one's ratio to its own baseline; differences in settings that make the comparison unfair are listed first."""
    warnings = []
    for key in ("model", "draft", "low_bit", "draft_low_bit", "max_new_tokens", "kv_cache_precision", "baseline"):
        if a["settings"][key] != b["settings"][key]:
            warnings.append(f"- settings differ: {key} {a['settings'][key]!r} vs {b['settings'][key]!r}")
    if a["prompts"]["sets"] != b["prompts"]["sets"]:
        warnings.append("- the prompts differ (sets, counts or text)")
    if a["machine"]["cpu"] != b["machine"]["cpu"]:
        warnings.append(f"- machines differ: {a['machine']['cpu']} vs {b['machine']['cpu']}")
    lines = [f"## Compare A ({a['created']}) and B ({b['created']})", ""] + warnings + ([""] if warnings else [])
    lines += ["| system | A decode tok/s | B decode tok/s | B/A | A vs baseline | B vs baseline |", "|---|---|---|---|---|---|"]
    for system in [x for x in measured(a) if x in measured(b)]:
        fa, fb = a["summary"][system]["all"], b["summary"][system]["all"]
        da, db = _median(fa["decode_tokens_per_s"]), _median(fb["decode_tokens_per_s"])
        lines.append(f"| {system} | {_fmt(da)} | {_fmt(db)} | {_fmt(db / da if da and db else None, '.2f', 'x')} | "
                     f"{_fmt(fa['ratio_to_baseline'], '.2f', 'x')} | "
                     f"{_fmt(fb['ratio_to_baseline'], '.2f', 'x')} |")
    only = sorted(set(a["settings"]["systems"]) ^ set(b["settings"]["systems"]))
    if only:
        lines += ["", f"In one report only: {', '.join(only)}"]
    return "\n".join(lines)


def plot(result: dict, path) -> Path:
    """Write a PNG: decode tokens/s per system (median, min-max error bars), and for speculative
    systems mean accepted length against speed-up over the baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s, summary = result["settings"], result["summary"]
    names = [n for n in measured(result) if summary[n]["all"]["decode_tokens_per_s"]]
    figures = [summary[n]["all"] for n in names]
    med = [f["decode_tokens_per_s"]["median"] for f in figures]
    err = [[m - f["decode_tokens_per_s"]["min"] for m, f in zip(med, figures)],
           [f["decode_tokens_per_s"]["max"] - m for m, f in zip(med, figures)]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 0.45 * len(names) + 2.5))
    left.barh(names, med, xerr=err, color=["tab:orange" if n.startswith("xpuspec") else "tab:blue" for n in names])
    left.invert_yaxis()
    left.set_xlabel("decode tokens/s (median, min-max over repeats)")
    left.set_title(f"{s['model']} {s['low_bit']}, {s['max_new_tokens']} new tokens")
    spec = [(n, f) for n, f in zip(names, figures) if result["systems"][n]["speculative"]
            and f["mean_accepted_length"] is not None and f["ratio_to_baseline"] is not None]
    for n, f in spec:
        right.scatter(f["mean_accepted_length"], f["ratio_to_baseline"])
        right.annotate(n, (f["mean_accepted_length"], f["ratio_to_baseline"]), fontsize=8,
                       xytext=(4, 4), textcoords="offset points")
    right.axhline(1.0, color="grey", linewidth=0.8)
    right.set_xlabel("mean accepted length (tokens per decode step)")
    right.set_ylabel(f"decode speed-up over {s['baseline']}")
    right.set_title("acceptance against speed-up (speculative systems)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
