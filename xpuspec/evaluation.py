"""Accuracy of low-bit formats against the fp32 model: perplexity, greedy agreement, KL divergence.

For each format, on the same real text (:mod:`xpuspec.corpus`: HumanEval code and Python
documentation prose, or a file of your own) and the same prompts:

- **perplexity**: Hugging Face's sliding-window perplexity of fixed-length models (windows of
  ``context`` tokens advanced by ``stride``; each token is scored once, with up to
  ``context - 1`` tokens before it);
- **top-1 agreement**: the fraction of those teacher-forced positions whose argmax equals fp32's;
- **KL divergence**: the mean over those positions of KL(p_fp32 || p_format), in nats;
- **greedy match**: for each prompt, how many greedy tokens agree with fp32's greedy
  continuation before the first difference, and the fraction of prompts that agree entirely.

The fp32 model is the reference and is always the first row.
"""

import gc
import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from datetime import date
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

import torch

from .errors import LowBitConfigError
from .lowbit import CHANNEL_WISE, DEFAULT_INT4_GROUP_SIZE, LowBitConfig
from .perplexity import eval_texts, sliding_windows, window_logprobs

REFERENCE = "fp32"


def parse_format(spec: Union[str, LowBitConfig]) -> LowBitConfig:
    """Parse ``FORMAT[:gN][:awq][:se]`` (e.g. ``int4_sym:g64:awq:se``) into a :class:`LowBitConfig`.

    ``gN`` is the INT4 group size (``g-1``: channel-wise), ``awq`` and ``se`` turn on NNCF's AWQ
    and scale estimation. A :class:`LowBitConfig` is returned as it is.

    Raises:
        LowBitConfigError: an unknown format or option, or an option the format does not take.
    """
    if isinstance(spec, LowBitConfig):
        return spec
    name, *options = str(spec).lower().split(":")
    params = {}
    for option in options:
        if option in ("awq", "se"):
            params["awq" if option == "awq" else "scale_estimation"] = True
        elif option[:1] == "g" and option[1:].lstrip("-").isdigit():
            params["group_size"] = int(option[1:])
        else:
            raise LowBitConfigError(
                f"Unknown option {option!r} in format {spec!r}; use FORMAT[:gN][:awq][:se], e.g. int4_sym:g64:awq."
            )
    return LowBitConfig(format=name, **params)


def label(config: LowBitConfig) -> str:
    """A short name of the settings as asked, e.g. ``int4_sym g64 awq+se``."""
    parts = [config.format]
    if config.group_size is not None:
        parts.append("channel-wise" if config.group_size == CHANNEL_WISE else f"g{config.group_size}")
    extras = [n for n, on in (("awq", config.awq), ("se", config.scale_estimation)) if on]
    return " ".join(parts + (["+".join(extras)] if extras else []))


@dataclass
class FormatResult:
    """One row of the table.

    Attributes:
        label: the settings as asked (:func:`label`).
        asked: the settings as asked, as a dict (:meth:`LowBitConfig.as_dict`).
        low_bit: the settings applied (group size fitted to the model), as a dict.
        weight_mib: size of the compiled weights file, MiB.
        load_s: seconds to load, compression included unless the compressed model was cached.
        perplexity: per text name, and ``"all"`` over every scored token.
        top1_agreement: fraction of scored positions whose argmax equals fp32's, in [0, 1].
        kl_mean: mean KL(p_fp32 || p_format) over scored positions, nats.
        greedy_match: per prompt, greedy tokens equal to fp32's before the first difference.
        greedy_identical: fraction of prompts whose whole greedy continuation equals fp32's.
    """

    label: str
    asked: dict
    low_bit: dict
    weight_mib: float
    load_s: float
    perplexity: Dict[str, float] = field(default_factory=dict)
    top1_agreement: float = 0.0
    kl_mean: float = 0.0
    greedy_match: List[int] = field(default_factory=list)
    greedy_identical: float = 0.0

    @property
    def greedy_match_mean(self) -> Optional[float]:
        """Mean of :attr:`greedy_match`; ``None`` without prompts."""
        return sum(self.greedy_match) / len(self.greedy_match) if self.greedy_match else None


@dataclass
class EvalReport:
    """Results of :func:`evaluate`: the settings, the corpus, the machine, and one row per format."""

    model: str
    settings: dict
    corpus: dict
    machine: dict
    results: List[FormatResult]

    def to_dict(self) -> dict:
        out = asdict(self)
        for row, result in zip(out["results"], self.results):
            row["greedy_match_mean"] = result.greedy_match_mean
        return out

    def write_json(self, path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=2))
        return path

    def to_markdown(self) -> str:
        """The table: one row per format, perplexity per text and its change against fp32."""
        texts = [k for k in self.results[0].perplexity if k != "all"]
        ref = self.results[0].perplexity["all"]
        new = self.settings["new_tokens"]
        head = (["format", "group", "weights MiB"] + [f"ppl {t}" for t in texts]
                + ["ppl Δ", "top-1 agree", "KL nats", f"greedy match /{new}", "identical"])
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in self.results:
            group, asked = r.low_bit.get("group_size"), r.asked.get("group_size")
            if asked is None and r.asked["format"].startswith("int4"):
                asked = DEFAULT_INT4_GROUP_SIZE
            group = ("-" if r.low_bit["format"].startswith("fp") else "channel" if group in (None, CHANNEL_WISE)
                     else str(group))
            if asked is not None and str(asked) != group:
                group += f" (asked {asked})"
            cells = ([r.label, group, f"{r.weight_mib:.1f}"] + [f"{r.perplexity[t]:.3f}" for t in texts]
                     + [f"{100 * (r.perplexity['all'] / ref - 1):+.2f}%", f"{100 * r.top1_agreement:.2f}%",
                        f"{r.kl_mean:.4f}"]
                     + ([f"{r.greedy_match_mean:.1f}", f"{100 * r.greedy_identical:.0f}%"] if r.greedy_match else ["-", "-"]))
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def plot(self, path) -> Path:
        """Write a PNG bar chart: perplexity change, top-1 agreement and KL per format.

        Raises:
            ImportError: matplotlib is not installed (``pip install xpuspec[plot]``).
        """
        try:
            import matplotlib
        except ImportError as exc:
            raise ImportError("--plot needs matplotlib: pip install 'xpuspec[plot]'") from exc
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = [r.label for r in self.results]
        ref = self.results[0].perplexity["all"]
        panels = [("perplexity change vs fp32 (%)", [100 * (r.perplexity["all"] / ref - 1) for r in self.results]),
                  ("top-1 agreement with fp32 (%)", [100 * r.top1_agreement for r in self.results]),
                  ("mean KL vs fp32 (nats)", [r.kl_mean for r in self.results])]
        fig, axes = plt.subplots(1, 3, figsize=(15, 1.5 + 0.35 * len(names)))
        for ax, (title, values) in zip(axes, panels):
            ax.barh(names, values, color="tab:blue")
            ax.set_title(title, fontsize=10)
            ax.invert_yaxis()
        fig.suptitle(f"{self.model}: low-bit formats against fp32")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return Path(path)


def eval_prompts(n: int) -> List[str]:
    """``n`` greedy-agreement prompts: ``n // 2`` HumanEval prompts spread over the 164, then
    ``n - n // 2`` prose openings (:func:`xpuspec.corpus.prose_prompts`)."""
    from . import corpus

    code = corpus.humaneval_prompts()
    n_code = n // 2
    return [code[i * len(code) // n_code] for i in range(n_code)] + (corpus.prose_prompts(n - n_code) if n > n_code else [])


def _machine() -> dict:
    import nncf
    import openvino

    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
             if line.startswith("model name")] if cpuinfo.is_file() else []
    return {"date": date.today().isoformat(), "cpu": names[0] if names else platform.processor(),
            "cores": os.cpu_count(), "python": platform.python_version(), "openvino": openvino.__version__,
            "nncf": nncf.__version__, "torch": torch.__version__}


def evaluate(
    model: str,
    formats: Sequence[Union[str, LowBitConfig]],
    *,
    text: Optional[Union[str, Path]] = None,
    tokens: int = 2048,
    context: int = 512,
    stride: int = 256,
    prompts: int = 8,
    new_tokens: int = 32,
    device: Optional[str] = None,
    backend: Optional[str] = None,
    progress: bool = True,
) -> EvalReport:
    """Evaluate low-bit formats of ``model`` against its fp32 weights.

    Args:
        model: a built-in name, a Hugging Face folder or a hub id (as for ``from_pretrained``).
        formats: format specs (:func:`parse_format`: ``"int4_asym"``, ``"int4_sym:g64:awq:se"``)
            or :class:`LowBitConfig` objects. fp32 is evaluated first in any case, as the reference.
        text: a UTF-8 text file to use instead of the built-in code and prose corpus.
        tokens: perplexity budget in tokens, over all texts.
        context, stride: sliding-window length and step, in tokens.
        prompts: greedy-agreement prompts (0: skip greedy agreement).
        new_tokens: greedy tokens generated per prompt.
        device, backend: as for ``from_pretrained``.
        progress: show a tqdm progress bar (on stderr).

    Returns:
        An :class:`EvalReport`; ``results[0]`` is fp32.

    Raises:
        ValueError: a budget or window parameter out of range, or ``context`` over the model's context.
        LowBitConfigError: an invalid format spec.
        CorpusError: the HumanEval download failed (pass ``text`` to work offline with a file).
        ModelSourceError, DeviceNotFoundError: as for ``from_pretrained``.
        NumericsError: a format's logits contain NaN or infinity (at load or on the text); never a ``nan`` row.
    """
    from tqdm.auto import tqdm

    from . import corpus
    from .loading import AutoModelForCausalLM, AutoTokenizer
    from .numerics import check_logits
    from .sources import resolve_source

    configs = [parse_format(REFERENCE)] + [c for c in map(parse_format, formats) if c != parse_format(REFERENCE)]
    if prompts < 0 or new_tokens < 1:
        raise ValueError(f"Need prompts >= 0 and new_tokens >= 1; got prompts={prompts}, new_tokens={new_tokens}.")
    limit = getattr(resolve_source(model).config, "max_position_embeddings", None)
    if limit is not None and context > limit:
        raise ValueError(f"context={context} is over the model's context of {limit} tokens; lower --context.")
    tokenizer = AutoTokenizer.from_pretrained(model)
    texts = eval_texts(tokenizer, text, tokens)
    prompt_ids = [tokenizer(p, return_tensors="pt").input_ids for p in eval_prompts(prompts)]
    steps = sum(len(sliding_windows(len(ids), context, stride)) for ids in texts.values()) + len(prompt_ids)
    settings = dict(device=device, backend=backend, text=str(text) if text else "code+prose", tokens=tokens,
                    context=context, stride=stride, prompts=prompts, new_tokens=new_tokens,
                    text_tokens={k: len(v) for k, v in texts.items()})
    reference_logp, reference_greedy, results = {}, [], []
    with tqdm(total=steps * len(configs), desc="eval", unit="step", disable=not progress) as bar:
        for config in configs:
            bar.set_description(f"load {label(config)}")
            start = time.perf_counter()
            lm = AutoModelForCausalLM.from_pretrained(model, device=device, backend=backend, load_in_low_bit=config)
            row = FormatResult(label(config), config.as_dict(), lm.low_bit.as_dict(), lm.runner.weight_bytes / 2**20,
                               time.perf_counter() - start)
            bar.set_description(f"eval {row.label}")
            nll_all = agree = kl = count = 0.0
            for name, ids in texts.items():
                nll, n = 0.0, 0
                for i, (logp, targets) in enumerate(window_logprobs(lm, ids, context, stride)):
                    check_logits(logp, f"{model} in {row.label} on {lm.device_name} (text {name!r}, window {i})",
                                 low_bit=lm.low_bit)
                    ref = reference_logp.setdefault((name, i), logp)
                    nll -= logp.gather(1, targets[:, None]).sum().item()
                    agree += (logp.argmax(-1) == ref.argmax(-1)).sum().item()
                    kl += (ref.exp() * (ref - logp)).sum().item()
                    n += len(targets)
                    bar.update(1)
                row.perplexity[name] = math.exp(nll / n)
                nll_all, count = nll_all + nll, count + n
            row.perplexity["all"] = math.exp(nll_all / count)
            row.top1_agreement, row.kl_mean = agree / count, kl / count
            for i, ids in enumerate(prompt_ids):
                new = lm.generate(ids, max_new_tokens=new_tokens, do_sample=False)[0, ids.shape[1]:].tolist()
                if len(reference_greedy) <= i:
                    reference_greedy.append(new)
                ref_new = reference_greedy[i]
                row.greedy_match.append(next((j for j, (a, b) in enumerate(zip(new, ref_new)) if a != b),
                                             min(len(new), len(ref_new))))
                row.greedy_identical += new == ref_new
                bar.update(1)
            row.greedy_identical /= max(len(prompt_ids), 1)
            settings["device"] = lm.device_name
            results.append(row)
            del lm
            gc.collect()
    return EvalReport(str(model), settings, corpus.fingerprint() if text is None else {"text": str(text)},
                      _machine(), results)
