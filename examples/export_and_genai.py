"""Export a model with xpuspec, then generate from the exported folder with openvino_genai.

    python examples/export_and_genai.py [MODEL] [--output FOLDER] [--weight-format F] [--max-new-tokens N]

openvino_genai needs nothing from xpuspec to run the folder. The script also generates with xpuspec on
the same folder and exits with status 1 if the two greedy texts differ. Both run with one set of CPU
properties (xpuspec's: f32 KV cache and compute, and no dynamic quantization, whose 1-token kernel
computes another function than wider passes), and openvino_genai without its chat template.
"""

import argparse
import tempfile
from pathlib import Path

import openvino_genai

import xpuspec

PROMPT = "def fibonacci(n):"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    parser.add_argument("--output", default=None, help="folder to write, replaced if it exists (default: a temporary one)")
    parser.add_argument("--weight-format", default="int8_asym", choices=xpuspec.FORMATS)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        folder = xpuspec.export(args.model, args.output or Path(tmp) / "model", weight_format=args.weight_format,
                                force=args.output is not None)
        print("exported to", folder)

        model = xpuspec.AutoModelForCausalLM.from_pretrained(folder, device="cpu",
                                                             ov_config={"DYNAMIC_QUANTIZATION_GROUP_SIZE": 0})
        pipe = openvino_genai.LLMPipeline(str(folder), "CPU", **model.runner.configs[0])
        theirs = pipe.generate(PROMPT, max_new_tokens=args.max_new_tokens, do_sample=False, apply_chat_template=False)

        tokenizer = xpuspec.AutoTokenizer.from_pretrained(folder)
        inputs = tokenizer(PROMPT, return_tensors="pt")
        out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
        ours = tokenizer.decode(out[0, inputs.input_ids.shape[1]:], skip_special_tokens=True)

    print("openvino_genai:", repr(theirs))
    print("xpuspec:       ", repr(ours))
    print("identical:", theirs == ours)
    return 0 if theirs == ours else 1


if __name__ == "__main__":
    raise SystemExit(main())
