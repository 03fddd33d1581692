"""The target's pass a head learns from, on OpenVINO (what ``train-draft`` uses) against transformers' float32 model
(what it used before), on one random 320-token sequence: seconds, the taps' relative difference, and the share of
positions whose greedy token agrees.

    PYTHONPATH=.:plugins python benchmarks/eagle3_teacher_pass.py MODEL [TORCH_THREADS]
"""
import time, torch, sys
from xpuspec.speculative.eagle3_train import TargetPasses
from xpuspec.speculative.eagle3 import default_layer_ids
import transformers
from xpuspec.sources import resolve_source
name = sys.argv[1]
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
src = resolve_source(name)
cfg = transformers.AutoConfig.from_pretrained(src.path)
ids = default_layer_ids(cfg.num_hidden_layers)
tp = TargetPasses(name, "int8_asym", ids)
hf = transformers.AutoModelForCausalLM.from_pretrained(src.path, dtype=torch.float32).eval()
seq = torch.randint(100, 20000, (320,))
for _ in range(2):
    t0=time.perf_counter(); taps, logits = tp(seq); t1=time.perf_counter()
    with torch.no_grad(): out = hf(seq[None], output_hidden_states=True)
    t2=time.perf_counter()
    ref = torch.cat([out.hidden_states[i][0] for i in ids], -1)
    print(f"ov int8 {t1-t0:.3f} s, hf fp32 {t2-t1:.3f} s; taps {tuple(taps.shape)} vs {tuple(ref.shape)}; "
          f"argmax agree {(logits.argmax(-1)==out.logits[0].argmax(-1)).float().mean():.3f}; "
          f"taps rel err {((taps-ref).norm()/ref.norm()):.4f}", flush=True)
