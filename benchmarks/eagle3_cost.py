"""What EAGLE-3 drafting costs: the target's pass with the three tapped layers as extra outputs against the same pass
without them, and one step of a head against a target pass: torch in each of the head's formats (float32, int8
weights), and the same layer on OpenVINO (float32, NNCF int8 weights; 1 and 2 threads), the issue's "on OpenVINO, or
on torch if that is faster". Torch runs the drafting path (:meth:`Eagle3Head.draft`) and, beside it, the training
forward the drafter ran before.

Two copies of the target are loaded (one with taps); their passes are timed interleaved (A, B, A, B ...) at each
width after the same context, so that the machine's load falls on both alike; the median of ``--repeats`` passes.

    PYTHONPATH=.:plugins python benchmarks/eagle3_cost.py --model smollm2-135m-instruct --low-bit int8_asym

Prints a markdown table; ratios are the figures to quote (the machine is shared).
"""

import argparse
import os
import platform
import random
import statistics
import tempfile
import time

import torch


def _median_pass(runner, context, width, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.forward(list(range(1000, 1000 + width)))
        times.append(time.perf_counter() - t0)
        runner.rollback(width)
    return statistics.median(times)


def _torch_steps(head, context, hidden, width, drafting=True):
    """A timer of ``head``'s chain step and 4-entry catch-up after ``context`` in torch: through the drafting path
    the drafter runs (:meth:`Eagle3Head.draft`), or, ``drafting=False``, through the training forward (transformers'
    attention and ``DynamicCache``; what the drafter ran before the drafting path)."""
    run, cache = (head.draft, head.new_draft_cache()) if drafting else (head, head.new_cache())
    with torch.inference_mode():
        run(context, head.project(hidden), cache)

    @torch.inference_mode()
    def step():
        t0 = time.perf_counter()
        run([5], torch.randn(1, width), cache)
        t1 = time.perf_counter()
        run([5] * 4, head.project(torch.randn(4, hidden.shape[1])), cache)
        t2 = time.perf_counter()
        cache.rollback(5)
        return t1 - t0, t2 - t1

    return step


class _HeadStep(torch.nn.Module):
    """The head's one decoder layer written out for OpenVINO's converter, the KV cache as inputs and outputs
    (``[1, kv_heads, entries, head_dim]``), the embedding and rotary tables given from outside; only to time the
    head on OpenVINO here (xpuspec drafts with the torch head, whichever format is faster: this benchmark)."""

    def __init__(self, head):
        super().__init__()
        self.head, self.layer = head, head.layers[0]
        config = head.config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads

    def forward(self, embeds, hidden, cos, sin, past_k, past_v):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        layer, attn, n = self.layer, self.layer.self_attn, embeds.shape[1]
        residual = hidden = layer.hidden_norm(hidden)  # norm_before_residual, as new_head writes heads
        x = torch.cat([layer.input_layernorm(embeds), hidden], -1)
        q = attn.q_proj(x).view(1, n, self.heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(1, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(1, n, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        repeat = self.heads // self.kv_heads
        keys = torch.cat([past_k, k], 2).repeat_interleave(repeat, 1)
        values = torch.cat([past_v, v], 2).repeat_interleave(repeat, 1)
        attended = torch.nn.functional.scaled_dot_product_attention(q, keys, values)  # one new entry: no mask
        x = residual + attn.o_proj(attended.transpose(1, 2).reshape(1, n, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.head.lm_head(self.head.norm(x[:, -1:])), x, k, v


def _openvino_steps(head, entries, fmt, threads):
    """A timer of ``head``'s chain step on OpenVINO (converted by ``ov.convert_model``; ``fmt`` int8_asym: NNCF's
    weight compression), its KV cache of ``entries`` entries passed in each call, as a drafter would."""
    import nncf
    import openvino as ov

    width = head.spec.hidden_size
    step = _HeadStep(head).eval()
    kv = (1, step.kv_heads, entries, step.head_dim)
    example = (torch.randn(1, 1, width), torch.randn(1, 1, width), torch.randn(1, 1, step.head_dim),
               torch.randn(1, 1, step.head_dim), torch.randn(*kv), torch.randn(*kv))
    with torch.no_grad():
        model = ov.convert_model(step, example_input=example)
    if fmt == "int8_asym":
        model = nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM)
    request = ov.Core().compile_model(model, "CPU", {"INFERENCE_NUM_THREADS": threads,
                                                     "PERFORMANCE_HINT": "LATENCY"}).create_infer_request()
    inputs = [e.numpy() for e in example]

    def timed():
        t0 = time.perf_counter()
        request.infer(inputs)
        return time.perf_counter() - t0, None

    return timed


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--low-bit", default="int8_asym")
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--widths", default="1,2,4,8")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--draft-vocab", type=int, default=8192, help="the draft vocabulary of the heads xpuspec trains")
    p.add_argument("--torch-threads", type=int, default=1)
    args = p.parse_args()

    from transformers import AutoConfig

    from xpuspec import AutoModelForCausalLM, pull
    from xpuspec.speculative.eagle3 import HEAD_FORMATS, Eagle3Head, check_head, default_layer_ids, new_head, read_head

    path = pull(args.model)
    config = AutoConfig.from_pretrained(path)
    taps = default_layer_ids(config.num_hidden_layers)
    plain = AutoModelForCausalLM.from_pretrained(args.model, device="cpu", load_in_low_bit=args.low_bit).runner
    tapped = AutoModelForCausalLM.from_pretrained(args.model, device="cpu", load_in_low_bit=args.low_bit).runner
    tapped.set_taps(taps)
    context = list(range(100, 100 + args.context))
    for runner in (plain, tapped):
        runner.reset()
        runner.forward(context, logits_to_keep=1)
    print(f"{args.model} {args.low_bit}, CPU {platform.processor() or platform.machine()}, context {args.context}, "
          f"taps {list(taps)}, median of {args.repeats}; load average before: {open('/proc/loadavg').read().split()[:3]}")
    print("\n| width | pass ms | pass with taps ms | ratio |\n|---:|---:|---:|---:|")
    base = {}
    for width in [int(w) for w in args.widths.split(",")]:
        a, b = [], []
        for _ in range(3):  # interleaved blocks
            a.append(_median_pass(plain, context, width, args.repeats // 3 or 1))
            b.append(_median_pass(tapped, context, width, args.repeats // 3 or 1))
        a, b = statistics.median(a), statistics.median(b)
        base[width] = a
        print(f"| {width} | {a * 1e3:.2f} | {b * 1e3:.2f} | {b / a:.3f} |")

    with tempfile.TemporaryDirectory() as tmp:
        head_dir = new_head(config, os.path.join(tmp, "head"), draft_ids=range(min(args.draft_vocab, config.vocab_size)))
        spec = read_head(head_dir)
        layer_ids = check_head(spec, config.hidden_size, config.vocab_size, config.num_hidden_layers)
        heads = {fmt: Eagle3Head.load(spec, layer_ids).quantized(fmt) for fmt in HEAD_FORMATS}
    torch.set_num_threads(args.torch_threads)  # the decode loop runs torch on one thread beside OpenVINO
    threads = torch.get_num_threads()
    print(f"\nHead (1 decoder layer, draft vocabulary {spec.draft_vocab_size}), cache of {args.context} entries; "
          f"torch on {threads} threads; the formats' passes interleaved in a new order each round, "
          f"median of {args.repeats}:\n\n"
          "| head | chain step (1 entry) ms | / target 1-token pass | catch-up of 4 accepted entries ms |\n"
          "|---|---:|---:|---:|")
    hidden = torch.randn(args.context, len(layer_ids) * config.hidden_size)
    steps = {}
    for fmt, head in heads.items():
        steps[f"torch {fmt}"] = _torch_steps(head, context, hidden, config.hidden_size)
        steps[f"torch {fmt}, training forward"] = _torch_steps(head, context, hidden, config.hidden_size, False)
    for threads_ov in (1, 2):
        for fmt in ("fp32", "int8_asym"):
            steps[f"OpenVINO {fmt}, {threads_ov} threads"] = _openvino_steps(heads["fp32"], args.context, fmt,
                                                                            threads_ov)
    times = {name: [] for name in steps}
    order, shuffle = list(steps), random.Random(0).shuffle
    for _ in range(args.repeats):  # a new order each round: no format always follows OpenVINO's 2-thread pass
        shuffle(order)
        for name in order:
            times[name].append(steps[name]())
    for name in steps:
        chain = statistics.median(t[0] for t in times[name])
        catch = [t[1] for t in times[name] if t[1] is not None]
        print(f"| {name} | {chain * 1e3:.2f} | {chain / base[min(base)]:.2f} | "
              f"{f'{statistics.median(catch) * 1e3:.2f}' if catch else 'not built'} |")
    print(f"\nload average after: {open('/proc/loadavg').read().split()[:3]}")


if __name__ == "__main__":
    main()
