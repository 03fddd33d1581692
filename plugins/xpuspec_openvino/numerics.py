"""Whether a compiled model's 1-token pass computes bit for bit like its wider passes.

Speculative decoding is exact only if the logits a verify pass gives for a position equal the logits a plain
step gives there. OpenVINO's CPU plugin picks kernels by input length: on CPUs with AVX512-VNNI or AMX it
quantizes the activations of INT8/INT4 layers on the fly (``DYNAMIC_QUANTIZATION_GROUP_SIZE``), and a 1-token
pass takes another kernel than a wider one, with logit differences up to about 1 at some positions; elsewhere
the two differ only in accumulation order (about 1e-4). Passes of 2 or more tokens agree among themselves.

So this module decides by measurement, at tolerance 0: it feeds real text (the calibration text, tokenized with
the IR folder's own tokenizer) and compares two 1-token passes with one 2-token pass at several positions. Where
any logit differs, the runner must make every pass a greedy request makes, plain or speculative, compute alike
(:attr:`xpuspec.runner.RunnerTraits`), in one of two ways:

* **split steps** (:attr:`StepNumerics.split_exact`): the difference lies in paged attention, whose CPU kernel
  treats a subsequence of 1 query token otherwise than a longer one. A pass that feeds each of its k tokens as a
  subsequence of its own (1 query token, the sequence's block table, past lengths p, p+1, ... p+k-1) computes
  each token as a 1-token step: the kernel writes every new key and value into the cache before it attends
  (OpenVINO's ``executor_pa.cpp``: ``concat_pastkv``, then the kernel). A lone 1-token pass is not one of them: with
  fewer subsequences than threads the kernel takes another loop, whose sums run in another order (measured here
  past one 32-token block of context), so the runner pads split passes (:mod:`.paged`). The probe checks that
  split passes of 1, 2 and 3 tokens give the first rows of one of :data:`WIDEST_COMPARED` tokens, bit for bit;
* else **2-wide steps**: 1-token passes run as 2-token ones, the second token rolled back.

The verdict is cached per IR, device, OpenVINO version and compile properties: it is a property of the compiled
model on this CPU.
"""

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import torch

from xpuspec.cache import cache_root, digest, folder_fingerprint, read_metadata, write_text_atomic
from xpuspec.devices import cpu_flags

log = logging.getLogger("xpuspec")

#: Context lengths at which 1-token and 2-token passes are compared (short, mid and longer contexts).
PROBE_POSITIONS = (6, 23, 47)
#: The widest pass compared with the 2-token pass, to report whether wide passes agree among themselves.
WIDEST_COMPARED = 8
#: Bumped when the probe changes, so that cached verdicts of an older probe are not reused.
PROBE_VERSION = 5


@dataclass(frozen=True)
class StepNumerics:
    """What the probe found.

    Attributes:
        single_step_width: 2 where a 1-token pass differs from a 2-token pass in any logit, else 1.
        one_vs_two: largest absolute logit difference between 1-token and 2-token passes.
        two_vs_wide: largest absolute logit difference between a 2-token pass and the first two rows of a
            :data:`WIDEST_COMPARED`-token pass over the same tokens (0 where wide passes agree bit for bit).
        split_exact: split passes (each token a 1-token subsequence) of 1, 2, 3 and :data:`WIDEST_COMPARED` tokens
            agree bit for bit where they overlap, and 1-token passes differ from wider ones (``False`` where not
            measured).
    """

    single_step_width: int
    one_vs_two: float
    two_vs_wide: float
    split_exact: bool = False


Pass = Callable[[Sequence[int]], torch.Tensor]


def probe(run: Pass, rollback: Callable[[int], None], reset: Callable[[], None], tokens: List[int],
          run_split: Optional[Pass] = None) -> StepNumerics:
    """Compare pass widths on ``tokens`` (at least ``max(PROBE_POSITIONS) + WIDEST_COMPARED`` of real text).

    Args:
        run: one inference over the given tokens, appended to the KV cache; returns ``[n, vocab]`` logits.
        rollback, reset: drop the last n tokens, empty the cache.
        tokens: token ids of real text.
        run_split: as ``run``, feeding each token as a 1-token subsequence (module docstring); ``None``: a runner
            that cannot.

    Returns:
        the :class:`StepNumerics`; the cache is left empty.
    """
    one_vs_two = two_vs_wide = 0.0
    split_exact = run_split is not None
    for at in PROBE_POSITIONS:
        if split_exact:
            reset()
            run(tokens[:at])
            widest = run_split(tokens[at:at + WIDEST_COMPARED])
            rollback(WIDEST_COMPARED)
            for k in (1, 2, 3):
                split_exact = split_exact and _largest_difference(run_split(tokens[at:at + k]), widest[:k]) == 0
                rollback(k)
        reset()
        run(tokens[:at])
        two = run(tokens[at:at + 2])
        rollback(2)
        ones = torch.cat([run(tokens[at:at + 1]), run(tokens[at + 1:at + 2])])
        rollback(2)
        wide = run(tokens[at:at + WIDEST_COMPARED])[:2]
        rollback(WIDEST_COMPARED)
        one_vs_two = max(one_vs_two, _largest_difference(two, ones))
        two_vs_wide = max(two_vs_wide, _largest_difference(two, wide))
    reset()
    return StepNumerics(2 if one_vs_two > 0 else 1, one_vs_two, two_vs_wide, split_exact and one_vs_two > 0)


def _largest_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference; equal infinities (a cut head's ``-inf``) count as equal."""
    same = (a == b) | (a.isnan() & b.isnan())
    return 0.0 if bool(same.all()) else float((a - b)[~same].abs().nan_to_num(float("inf")).max())


def probe_tokens(folder: Path, vocab_size: int) -> List[int]:
    """Real text as token ids: the calibration text through the folder's ``tokenizer.json`` (repeated to the
    length the probe needs), else ids spread over the vocabulary."""
    from .ir import CALIBRATION_TEXT

    need = max(PROBE_POSITIONS) + WIDEST_COMPARED
    path = Path(folder) / "tokenizer.json"
    ids: List[int] = []
    if path.is_file():
        from tokenizers import Tokenizer

        ids = [i for i in Tokenizer.from_file(str(path)).encode("\n".join(CALIBRATION_TEXT)).ids if i < vocab_size]
    if not ids:
        ids = [(7919 * i + 13) % vocab_size for i in range(need)]
    return (ids * (need // len(ids) + 1))[:need]


def device_identity(core, device: str, is_cpu: bool) -> dict:
    """What identifies the kernels a compiled model gets on OpenVINO ``device`` (an OpenVINO device name): the
    OpenVINO version, the device's full name and capabilities, and on a CPU its instruction-set flags (CPUs of
    one name differ in AVX-512, VNNI and AMX)."""
    import openvino as ov

    identity = {"openvino": ov.__version__}
    for key in ("FULL_DEVICE_NAME", "OPTIMIZATION_CAPABILITIES"):
        try:
            identity[key] = str(core.get_property(device, key))
        except RuntimeError:  # a plugin without the property
            continue
    if is_cpu:
        identity["cpu_flags"] = cpu_flags()
    return identity


def ir_label(folder: Path) -> str:
    """A readable name of a cached IR folder for messages: its model and format ("smollm2-135m-instruct (int8_sym)"),
    not the folder's hash name."""
    try:
        meta = read_metadata(Path(folder))
    except (OSError, ValueError):
        meta = {}
    fmt = (meta.get("low_bit") or {}).get("format")
    return f"{meta['source']} ({fmt or 'fp32'})" if meta.get("source") else Path(folder).name


def cached_probe(folder: Path, device_identity: dict, config: dict, measure: Callable[[], StepNumerics]) -> StepNumerics:
    """``measure()``'s verdict for this IR folder on this device and compile properties, cached on disk.

    Args:
        folder: the IR folder (its file names, sizes and times identify it).
        device_identity: what identifies the device's kernels (OpenVINO version, full device name, capabilities).
        config: the compile properties.
        measure: runs :func:`probe` (only where nothing is cached).
    """
    key = digest(PROBE_VERSION, folder_fingerprint(folder), device_identity, config)
    path = cache_root() / "numerics" / f"{key}.json"
    try:
        return StepNumerics(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        pass
    found = measure()
    write_text_atomic(path, json.dumps(asdict(found)), "recording this device's numerics probe of the model")
    if found.single_step_width > 1:
        log.info("%s: a 1-token pass computes differently from wider ones on this device (logits differ by up to "
                 "%.2g); %s so that speculative and plain output are the same", ir_label(folder), found.one_vs_two,
                 "every step and verify pass feeds its tokens as 1-token subsequences" if found.split_exact
                 else "1-token passes run 2 wide")
    if found.two_vs_wide > 0:
        log.warning("%s: passes of 2 and %d tokens differ by up to %.2g on this device; greedy speculative output "
                    "may part from plain output at near-ties", ir_label(folder), WIDEST_COMPARED, found.two_vs_wide)
    return found


def dynamic_quantization(core, device: str) -> bool:
    """Whether OpenVINO ``device`` (an OpenVINO device name) quantizes the activations of INT8-weight layers on the
    fly under its default properties (``DYNAMIC_QUANTIZATION_GROUP_SIZE``; on CPUs with AVX512-VNNI or AMX, not
    with AVX2 alone).

    Asked of OpenVINO, not of the CPU flags: a small INT8-compressed MatMul (NNCF's decompression pattern) is
    compiled with the defaults and with ``DYNAMIC_QUANTIZATION_GROUP_SIZE=0``, both in f32, and run on the same
    4 rows; they differ exactly where the plugin quantizes activations.
    """
    import numpy as np
    import openvino as ov
    from openvino import opset13 as ops

    rng = np.random.default_rng(0)
    k, n = 256, 128
    x = ops.parameter([1, -1, k], ov.Type.f32, name="x")
    weight = ops.convert(ops.constant(rng.integers(0, 256, (n, k), dtype=np.uint8), ov.Type.u8), "f32")
    zero = ops.convert(ops.constant(np.full((n, 1), 128, np.uint8), ov.Type.u8), "f32")
    scale = ops.constant((rng.random((n, 1)) * 0.01 + 0.001).astype(np.float32), ov.Type.f32)
    model = ov.Model([ops.matmul(x, ops.multiply(ops.subtract(weight, zero), scale), False, True)], [x])
    rows = rng.standard_normal((1, 4, k)).astype(np.float32)
    outputs = [core.compile_model(model, device, {"INFERENCE_PRECISION_HINT": "f32", **extra})({"x": rows})[0]
               for extra in ({}, {"DYNAMIC_QUANTIZATION_GROUP_SIZE": 0})]
    return not np.array_equal(*outputs)
