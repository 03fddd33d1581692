"""Train an EAGLE-3 head for a target on the CPU, and save it in the Speculators format (``xpuspec train-draft``).

The training follows the ``speculators`` package's EAGLE-3 recipe (``models/eagle3/core.py``): the target (on
xpuspec's own OpenVINO runner in ``target_low_bit``, the weights a head usually drafts for, with the taps as outputs
of its pass: :meth:`xpuspec.runner.Runner.set_taps`) reads the user's text once per sequence and gives the taps and
its own next-token distribution (self-distillation: the head learns the target's distribution, restricted to the
draft vocabulary, with a soft cross-entropy); the head runs ``ttt_steps`` test-time-training steps, step ``k`` fed
the true next tokens and its own outputs of step ``k - 1``, each query attending the step-0 entries up to itself and
its own entries of the earlier steps. Sequence index ``t`` holds token ``x[t+1]`` beside the target's taps at ``t``
(``shift_batch``).

The draft vocabulary is the ``draft_vocab_size`` tokens the target predicts most often on the training text (ties by
id; speculators counts the data's tokens). Checkpoints (head, optimizer, step, random state, data order) are written
every ``checkpoint_every`` steps to a temporary file then renamed, and a run given the same ``out`` folder resumes
from the last one: an interrupted run (Ctrl-C) continues where it stopped and ends with the same weights as one run
through. A held-out tenth of the sequences reports the acceptance per draft position (the head's greedy token equals
the target's, given that every earlier position was accepted, teacher-forced).

With ``continue_tokens`` each piece of text (``seq_len - continue_tokens`` tokens) is a prompt that the target
continues itself (greedy, 16 prompts a batch, on the same engine), which is what the
head will see at decode time. The target's pass over each sequence is computed once and kept (taps in float16 and
its 32 most likely draft tokens per position, about 1 MB per 256-token sequence of SmolLM2), so later epochs cost
only the head's steps. A step trains ``batch_size`` sequences padded to the longest, under bfloat16 autocast on
CPUs with bfloat16 products (float32 master weights and optimizer, as speculators trains in bfloat16 on GPUs), at
speculators' default learning-rate schedule: a linear warmup over the first 1% of the steps, then a linear decay to
0 at ``steps`` (a resumed run given more ``steps`` decays over the new total). The transformers model is read once,
at the start of a new run, for the weights a head starts from (the embeddings, the readout).

Chat rows (``messages``, or ShareGPT ``conversations``) are rendered with the target's chat template and, with
``continue_tokens``, answered by the target itself. An instruct model given an instruction as raw text often stops
at once (SmolLM2-135M-Instruct ended 370 of 1507 such pieces with its end-of-turn token, leaving nothing to learn
from), so a run says how many continuations stopped within :data:`STOPPED_EARLY` tokens.
"""

import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Union

import torch

from ..chat import chat_token_ids
from ..errors import ModelSourceError
from .eagle3 import Eagle3Head, check_head, default_layer_ids, new_head, read_head

CHECKPOINT = "train-state.pt"
#: What a .jsonl line's text is read from, tried in order.
JSONL_FIELDS = ("text", "content", "prompt", "completion", "response")
#: A continuation this short or shorter counts as stopped at once (the run's warning).
STOPPED_EARLY = 4
#: The target's most likely draft tokens a training step learns from, per position (their probabilities kept).
TEACHER_TOP = 32


@dataclass
class TrainReport:
    """What a training run reached.

    Attributes:
        steps: optimizer steps done (those of earlier, resumed runs included).
        loss: the mean loss of the last 20 steps.
        acceptance: per draft position, the held-out acceptance rate (``[ttt_steps]``).
        resumed_from: the step a resumed run started at (0: a new run).
    """

    steps: int
    loss: float
    acceptance: List[float] = field(default_factory=list)
    resumed_from: int = 0


@dataclass(frozen=True)
class Chat:
    """A chat dataset row: its messages (``{"role", "content"}`` dicts, roles ``system`` / ``user`` /
    ``assistant``), rendered with the target's own chat template (:func:`_prompts`), as the server renders a chat."""

    messages: tuple


#: ShareGPT's speaker names, as roles.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def _chat(row: dict, where: str) -> Optional[Chat]:
    """A .jsonl row's chat (``messages``: OpenAI / transformers; ``conversations``: ShareGPT's ``from`` / ``value``),
    or ``None`` for a row without one."""
    if isinstance(row.get("messages"), list):
        turns = [(m.get("role"), m.get("content")) for m in row["messages"] if isinstance(m, dict)]
    elif isinstance(row.get("conversations"), list):
        turns = [(SHAREGPT_ROLES.get(m.get("from")), m.get("value")) for m in row["conversations"]
                 if isinstance(m, dict)]
    else:
        return None
    if not turns or any(role not in ("system", "user", "assistant") or not isinstance(text, str)
                        for role, text in turns):
        raise ModelSourceError(f"{where}: a chat's turns need a role (system, user, assistant; ShareGPT: human, "
                               f"gpt) and a text content, got {turns[:3]}.")
    return Chat(tuple({"role": role, "content": text} for role, text in turns))


def read_texts(paths: Sequence) -> List[Union[str, Chat]]:
    """The texts of ``.txt`` files (one text each), ``.jsonl`` files (one per line: a chat's ``messages`` or
    ShareGPT ``conversations``, kept as a :class:`Chat`; else its ``text`` / ``content`` / ``prompt`` +
    ``completion`` fields) and folders of them.

    Raises:
        ModelSourceError: a path that does not exist, a line that is not JSON, a chat turn without a role or text,
            or no text at all.
    """
    files = []
    for path in map(Path, paths):
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".jsonl"))
        elif path.is_file():
            files.append(path)
        else:
            raise ModelSourceError(f"No training text at {path}: give .txt or .jsonl files, or folders of them.")
    texts = []
    for file in files:
        if file.suffix == ".jsonl":
            for n, line in enumerate(file.read_text().splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as exc:
                    raise ModelSourceError(f"{file}:{n} is not JSON ({exc}).") from exc
                if not isinstance(row, dict):
                    continue
                chat = _chat(row, f"{file}:{n}")
                texts.append(chat if chat is not None else
                             "\n".join(str(row[k]) for k in JSONL_FIELDS if isinstance(row.get(k), str)))
        else:
            texts.append(file.read_text(errors="replace"))
    texts = [t for t in texts if isinstance(t, Chat) or t.strip()]
    if not texts:
        raise ModelSourceError(f"No text in {', '.join(map(str, paths))}.")
    return texts


def _prompts(tokenizer, texts: Sequence[Union[str, Chat]], length: int, regenerate: bool) -> List[List[int]]:
    """The token sequences a run trains on or continues: each text cut into pieces of ``length`` tokens
    (:func:`_chunks`); each :class:`Chat` rendered with the tokenizer's chat template
    (:func:`xpuspec.chat.chat_token_ids`, as the server renders a chat). ``regenerate``: the chat's
    last assistant turns are dropped and the generation prompt added, so that the target answers itself
    (self-distillation, as the speculators package regenerates a dataset's responses with the verifier), kept to
    its last ``length`` tokens; else the whole chat is cut into pieces as a text.

    Raises:
        ModelSourceError: chats, and a tokenizer without a chat template.
    """
    chats = [t for t in texts if isinstance(t, Chat)]
    if chats and not getattr(tokenizer, "chat_template", None):
        raise ModelSourceError(f"{len(chats)} training row(s) are chats, and the target's tokenizer has no chat "
                               "template to render them with; give them as text rows ({\"text\": ...}).")
    out = []
    for text in texts:
        if not isinstance(text, Chat):
            out += _chunks(tokenizer, [text], length)
            continue
        turns = list(text.messages)
        while regenerate and turns and turns[-1]["role"] == "assistant":
            turns.pop()
        if regenerate and not turns:
            continue
        ids = chat_token_ids(tokenizer, turns, add_generation_prompt=regenerate)
        if regenerate:
            out.append(ids[-length:])
        else:
            out += _pieces(ids, length)
    return out


def _chunks(tokenizer, texts: Iterable[str], length: int) -> List[List[int]]:
    """The texts' tokens cut into sequences of ``length`` tokens (:func:`_pieces`)."""
    out = []
    for text in texts:
        out += _pieces(tokenizer(text, add_special_tokens=False)["input_ids"], length)
    return out


def _pieces(ids: List[int], length: int) -> List[List[int]]:
    """``ids`` cut into pieces of ``length`` tokens, the last kept if it has at least 8."""
    return [ids[i:i + length] for i in range(0, len(ids), length) if len(ids[i:i + length]) >= 8]


def _ttt_mask(n: int, step: int) -> torch.Tensor:
    """The additive mask of test-time-training step ``step`` over entries ``[steps 0..step] x n``: query ``t``
    sees step-0 entries ``<= t`` and its own entry of each later step."""
    allowed = torch.zeros(n, (step + 1) * n, dtype=torch.bool)
    allowed[:, :n] = torch.ones(n, n, dtype=torch.bool).tril()
    eye = torch.eye(n, dtype=torch.bool)
    for k in range(1, step + 1):
        allowed[:, k * n:(k + 1) * n] = eye
    mask = torch.zeros(allowed.shape)
    return mask.masked_fill(~allowed, float("-inf"))


def _head_steps(head: Eagle3Head, tokens: torch.Tensor, taps: torch.Tensor, steps: int) -> List[torch.Tensor]:
    """Draft logits of each test-time-training step over ``B`` sequences padded to ``m`` tokens: ``tokens``
    ``[B, m]``, ``taps`` ``[B, m, 3H]``; index ``t`` of step ``k`` (``[B, m - 1, draft_vocab]``) predicts the token at
    ``t + k + 2``. A row's padding changes none of its other entries: an entry sees only step-0 entries up to
    itself and its own entries of later steps."""
    n = tokens.shape[1] - 1
    cache = head.new_cache()
    hidden = head.project(taps[:, :n])
    out = []
    for k in range(steps):
        ids = torch.cat([tokens[:, 1 + k:], tokens.new_zeros(tokens.shape[0], k)], dim=1)[:, :n]  # teacher-forced
        positions = torch.arange(1 + k, n + 1 + k)
        logits, hidden = head(ids, hidden, cache, positions=positions, mask=_ttt_mask(n, k))
        out.append(logits)
    return out


@dataclass
class _Batch:
    """``B`` training sequences padded to the longest: ``tokens`` ``[B, m]``, ``taps`` ``[B, m, 3H]`` (float32),
    the teacher's ``top_p`` / ``top_i`` ``[B, m, TEACHER_TOP]`` and each row's ``lengths``."""

    tokens: torch.Tensor
    taps: torch.Tensor
    top_p: torch.Tensor
    top_i: torch.Tensor
    lengths: List[int]


def _batch(sequences: List[List[int]], passes: list) -> _Batch:
    """Pad ``sequences`` and their teacher passes (:func:`_teacher`) with zeros to the longest."""
    m = max(map(len, sequences))

    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t, [0, 0] * (t.dim() - 1) + [0, m - t.shape[0]])

    tokens = torch.stack([pad(torch.tensor(seq)) for seq in sequences])
    taps, top_p, top_i = (torch.stack([pad(p[i]) for p in passes]) for i in range(3))
    return _Batch(tokens, taps.float(), top_p.float(), top_i, [len(seq) for seq in sequences])


def _precision(bf16: Optional[bool], log) -> bool:
    """Whether the head's steps run under bfloat16 autocast: ``bf16`` if given, else where the CPU has bfloat16
    products (AVX512-BF16 or AMX: 1.6-1.8x the float32 steps of a SmolLM2 head on an AVX512-BF16 EPYC,
    ``benchmarks/results/eagle3.md``; emulated elsewhere, slower). Says which.

    Raises:
        ValueError: ``bf16=True`` on a CPU without bfloat16 products.
    """
    native = any(getattr(torch.cpu, name, lambda: False)() for name in
                 ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    if bf16 and not native:
        raise ValueError("bf16=True (--bf16): this CPU has no bfloat16 products (AVX512-BF16 or AMX), where torch "
                         "emulates them slower than float32; train in float32 (--no-bf16).")
    use = native if bf16 is None else bf16
    log(f"training the head in {'bfloat16 autocast' if use else 'float32'} "
        f"({'this CPU has' if native else 'this CPU has no'} bfloat16 products)")
    return use


def train_head(model: str, data: Sequence, out, steps: int = 2000, seq_len: int = 256, lr: float = 3e-4,
               ttt_steps: int = 3, draft_vocab_size: int = 32000, checkpoint_every: int = 100, seed: int = 0,
               progress: bool = True, log=print, continue_tokens: int = 0,
               target_low_bit: str = "int8_asym", batch_size: int = 1, bf16: Optional[bool] = None) -> TrainReport:
    """Train a head for ``model`` (a transformers folder or name :func:`xpuspec.pull` knows) on the texts of
    ``data`` and save it to ``out`` in the Speculators format (resuming from ``out``'s checkpoint if any).

    ``continue_tokens`` > 0: each sequence is a ``seq_len - continue_tokens``-token piece of the text followed by the
    target's own greedy continuation of up to that many tokens (self-distillation on the target's outputs: a head
    trained on the target's own text is accepted far more often, see ``tests/test_eagle3.py``); the continuations
    are kept in ``out`` and reused by a resumed run. ``target_low_bit``: the target's weights for its continuations
    and its passes (:class:`TargetPasses`). Each of the ``steps`` optimizer steps trains ``batch_size`` sequences
    (padded to the longest); ``bf16``: the head's steps under bfloat16 autocast (``None``: where the CPU has
    bfloat16 products, :func:`_precision`).

    Raises:
        ModelSourceError: no text, or a target architecture a head cannot be built from.
        ValueError: ``out``'s checkpoint was trained with another ``batch_size``, or ``bf16=True`` on a CPU without
            bfloat16 products.
    """
    import transformers
    from tqdm.auto import tqdm

    from ..sources import resolve_source

    out = Path(str(out))
    out.mkdir(parents=True, exist_ok=True)
    state_file = out / CHECKPOINT
    state = torch.load(state_file, weights_only=False) if state_file.is_file() else None
    trained_with = state.get("batch_size", 1) if state is not None else batch_size  # 1 before the option
    if trained_with != batch_size:
        raise ValueError(f"{state_file} was trained with batch_size {trained_with}: resume with that "
                         f"(--batch-size {trained_with}), or train into a new --out folder.")
    bf16 = _precision(bf16, log)
    source = resolve_source(model)
    config = transformers.AutoConfig.from_pretrained(source.path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(source.path)
    taps_ids = default_layer_ids(config.num_hidden_layers)
    texts = read_texts(data)
    from .. import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(model, load_in_low_bit=target_low_bit)
    if continue_tokens > 0:
        prompts = _prompts(tokenizer, texts, max(8, seq_len - continue_tokens), regenerate=True)
        sequences = _own_continuations(loaded, prompts, continue_tokens, out / "own-outputs.json", progress)
        stopped = sum(len(s) - len(p) <= STOPPED_EARLY for p, s in zip(prompts, sequences))
        if stopped > len(prompts) // 10:
            log(f"warning: the target stopped within {STOPPED_EARLY} tokens on {stopped} of {len(prompts)} prompts, "
                "which teach the head little; an instruct model answers instructions given as chat rows "
                "({\"messages\": [{\"role\": \"user\", \"content\": ...}]}), rendered with its chat template.")
    else:
        sequences = _prompts(tokenizer, texts, seq_len, regenerate=False)
    target = TargetPasses(loaded, taps_ids)  # the taps only now: the continuations' passes do not need them
    if len(sequences) < 2:
        raise ModelSourceError(f"The training text gives {len(sequences)} sequence(s) of {seq_len} tokens; give more.")
    if state is None:
        rng = random.Random(seed)
        order = list(range(len(sequences)))
        rng.shuffle(order)
        held = max(1, len(order) // 10)
        draft_ids = _frequent_predictions(target, [sequences[i] for i in order[held:]][:64], draft_vocab_size)
        weights = transformers.AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32)
        head_dir = new_head(config, out / "init", draft_ids=draft_ids, layer_ids=taps_ids,
                            speculative_tokens=ttt_steps, verifier=str(model), seed=seed,
                            embeddings=weights.get_input_embeddings().weight.detach(), force=True,
                            lm_head=weights.get_output_embeddings().weight, norm=_final_norm(weights))
        del weights
        state = {"step": 0, "order": order, "held": held, "draft_ids": draft_ids, "head": None, "optim": None,
                 "torch_rng": None, "losses": [], "batch_size": batch_size}
    else:
        head_dir = out / "init"
        log(f"resuming from step {state['step']} ({state_file})")
    spec = read_head(head_dir)
    head = Eagle3Head.load(spec, check_head(spec, config.hidden_size, config.vocab_size, config.num_hidden_layers))
    head.embed.weight.requires_grad_(False)
    params = [p for p in head.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=lr)
    if state["head"] is not None:
        head.load_state_dict(state["head"])
        optim.load_state_dict(state["optim"])
        torch.set_rng_state(state["torch_rng"])
    else:
        torch.manual_seed(seed)
    for group in optim.param_groups:  # a checkpoint written before the schedule has no initial_lr
        group.setdefault("initial_lr", lr)
    schedule = transformers.get_linear_schedule_with_warmup(optim, max(1, steps // 100), steps,
                                                            last_epoch=state["step"] - 1)
    resumed_from = state["step"]
    draft_ids = torch.tensor(state["draft_ids"])
    train = state["order"][state["held"]:]
    head.train()
    bar = tqdm(total=steps, initial=state["step"], desc="train-draft eagle3", unit="step", disable=not progress)
    passes = {}  # sequence index -> the target's pass over it (_teacher), computed once
    while state["step"] < steps:
        first = state["step"] * batch_size
        indices = [train[(first + j) % len(train)] for j in range(batch_size)]
        for index in indices:
            if index not in passes:
                passes[index] = _teacher(target, torch.tensor(sequences[index]), draft_ids)
        batch = _batch([sequences[i] for i in indices], [passes[i] for i in indices])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = _loss(_head_steps(head, batch.tokens, batch.taps, ttt_steps), batch)
        optim.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optim.step()
        schedule.step()
        state["step"] += 1
        state["losses"] = (state["losses"] + [float(loss.detach())])[-20:]
        bar.update(1)
        bar.set_postfix(loss=f"{sum(state['losses']) / len(state['losses']):.3f}")
        if state["step"] % checkpoint_every == 0 or state["step"] == steps:
            state.update(head=head.state_dict(), optim=optim.state_dict(), torch_rng=torch.get_rng_state())
            tmp = state_file.with_suffix(".tmp")
            torch.save(state, tmp)
            os.replace(tmp, state_file)
    bar.close()
    head.eval()
    acceptance = evaluate(head, target, [torch.tensor(sequences[i]) for i in state["order"][:state["held"]]],
                          ttt_steps)
    _save(head, head_dir, out)
    loss = sum(state["losses"]) / max(1, len(state["losses"]))
    log(f"held-out acceptance per position: {', '.join(f'{a:.3f}' for a in acceptance)}")
    return TrainReport(state["step"], loss, acceptance, resumed_from)


class TargetPasses:
    """The target's pass over a sequence, as a head learns from it: ``passes(seq)`` gives the taps ``[m, 3H]`` and
    the logits ``[m, V]`` (float32) of the ``m`` tokens of ``seq`` (LongTensor ``[m]``), from one pass of ``model``
    (an :class:`xpuspec.XpuspecModelForCausalLM` on OpenVINO, in the weights a head usually drafts for: it learns the
    taps and the distribution of the target that verifies its drafts), whose graph then outputs the residual stream
    entering the layers ``taps_ids`` (:meth:`xpuspec.runner.Runner.set_taps`, as when the head drafts).

    It replaced transformers' float32 model: a 320-token pass of SmolLM2 0.40 s against 1.16 s (torch on one
    thread), of Qwen2.5-Coder-1.5B 2.43 s against 5.95 s (two threads), the int8 taps within 1.3% and 0.7% of the
    float32 ones (``benchmarks/eagle3_teacher_pass.py``, ``benchmarks/results/eagle3.md``)."""

    def __init__(self, model, taps_ids: Sequence[int]):
        self.model = model
        self.model.runner.set_taps(list(taps_ids))
        self.vocab_size = self.model.runner.vocab_size

    @torch.no_grad()
    def __call__(self, seq: torch.Tensor):
        runner = self.model.runner
        runner.reset()
        logits = runner.forward(seq.tolist())
        _, taps = runner.last_taps
        runner.reset()
        return taps, logits


def _own_continuations(target, prompts: List[List[int]], tokens: int, cache: Path, progress: bool,
                       batch: int = 16) -> List[List[int]]:
    """Each prompt followed by ``target``'s (an xpuspec model's) greedy continuation of up to ``tokens`` tokens (cut
    after its end of sequence), generated by xpuspec's own engine (3x faster than transformers' float32 generate,
    measured on SmolLM2), ``batch`` prompts at a time. Kept in ``cache``, written by rename after each batch, so an
    interrupted run keeps what it generated."""
    from tqdm.auto import tqdm

    from ..generation import eos_ids

    done = json.loads(cache.read_text()) if cache.is_file() else []
    if len(done) >= len(prompts):
        return done
    stops = set(eos_ids(target.generation_config))
    pad = target.generation_config.pad_token_id
    pad = next(iter(stops), 0) if pad is None else pad
    bar = tqdm(total=len(prompts), initial=len(done), desc="target's own outputs", unit="seq", disable=not progress)
    for first in range(len(done), len(prompts), batch):
        group = prompts[first:first + batch]
        width = max(map(len, group))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        out = target.generate(ids, attention_mask=mask, max_new_tokens=tokens, do_sample=False, pad_token_id=pad)
        for prompt, row in zip(group, out[:, width:].tolist()):
            cut = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
            done.append(prompt + row[:cut])
        tmp = cache.with_suffix(".tmp")
        tmp.write_text(json.dumps(done))
        os.replace(tmp, cache)
        bar.update(len(group))
    bar.close()
    return done


def _final_norm(target) -> Optional[torch.Tensor]:
    """The weight of the target's last norm (before its ``lm_head``), or ``None`` where it has none by that name."""
    norm = getattr(getattr(target, "model", None), "norm", None)
    return None if norm is None or getattr(norm, "weight", None) is None else norm.weight


@torch.no_grad()
def _frequent_predictions(target, sequences, size: int) -> List[int]:
    """The ``size`` token ids the target (:class:`TargetPasses`) predicts most often (greedy) on ``sequences``, then
    the lowest ids."""
    vocab = target.vocab_size
    if size >= vocab:
        return list(range(vocab))
    counts = torch.zeros(vocab)
    for seq in sequences:
        counts += torch.bincount(target(torch.tensor(seq))[1].argmax(-1), minlength=vocab)[:vocab].float()
    order = sorted(range(vocab), key=lambda i: (-float(counts[i]), i))
    return sorted(order[:size])


@torch.no_grad()
def _teacher(target, seq: torch.Tensor, draft_ids: torch.Tensor, keep: int = TEACHER_TOP):
    """What a training step needs from the target's pass over ``seq`` (:class:`TargetPasses`), kept small enough to
    hold for every sequence: the taps ``[m, 3H]`` (float16) and the ``keep`` most likely draft tokens' probabilities
    and draft ids ``[m, keep]`` (float16, int64)."""
    taps, logits = target(seq)
    probs = torch.softmax(logits[:, draft_ids], dim=-1)
    top = probs.topk(min(keep, probs.shape[-1]), dim=-1)
    return taps.half(), top.values.half(), top.indices


def _loss(step_logits: List[torch.Tensor], batch: _Batch) -> torch.Tensor:
    """Soft cross-entropy of each step against the target's distribution it predicts (index ``t`` of step ``k``:
    the target's distribution at position ``t + k + 1``, its ``TEACHER_TOP`` most likely draft tokens), the mean over
    every row's positions that have one (not the padding), summed over steps."""
    total = 0.0
    n = step_logits[0].shape[1]
    lengths = torch.tensor(batch.lengths)[:, None]
    for k, logits in enumerate(step_logits):
        keep = n - k
        valid = torch.arange(keep)[None, :] < lengths - 1 - k  # [B, keep]
        logp = torch.log_softmax(logits[:, :keep].float(), dim=-1).gather(-1, batch.top_i[:, 1 + k:1 + k + keep])
        total = total + -(batch.top_p[:, 1 + k:1 + k + keep] * logp).sum(-1)[valid].mean()
    return total


@torch.no_grad()
def evaluate(head: Eagle3Head, target, sequences, steps: int) -> List[float]:
    """Held-out acceptance per draft position: the fraction of positions where the head's greedy token (mapped to
    target ids) equals the target's (:class:`TargetPasses`) greedy token at this step and at every earlier one
    (teacher-forced)."""
    hits, seen = [0.0] * steps, [0.0] * steps
    for seq in sequences:
        taps, logits = target(seq)
        want = logits.argmax(-1)
        alive = None
        for k, logits in enumerate(_head_steps(head, seq[None], taps[None], steps)):
            keep = logits.shape[1] - k
            best = logits[0, :keep].argmax(-1)
            got = best + head.d2t[best]
            ok = got == want[1 + k:1 + k + keep]
            alive = ok if alive is None else alive[:keep] & ok
            hits[k] += float(alive.sum())
            seen[k] += keep
    return [h / s if s else 0.0 for h, s in zip(hits, seen)]


def _save(head: Eagle3Head, init: Path, out: Path) -> None:
    """Write the trained weights beside ``init``'s config.json into ``out`` (model.safetensors via a temp name)."""
    import shutil

    from safetensors.torch import load_file, save_file

    weights = load_file(str(init / "model.safetensors"))
    state = head.state_dict()
    for name in list(weights):
        mine = "embed.weight" if name == "embed_tokens.weight" else name
        if mine in state and name not in ("d2t", "t2d"):
            weights[name] = state[mine].detach().contiguous()
    tmp = out / "model.safetensors.tmp"
    save_file(weights, str(tmp), metadata={"format": "pt"})
    shutil.copyfile(init / "config.json", out / "config.json")
    os.replace(tmp, out / "model.safetensors")
