"""A plain transformers script. Only the import line differs.

    python examples/drop_in.py [MODEL]

MODEL defaults to the built-in SmolLM2-135M-Instruct; any local Hugging Face or
OpenVINO IR folder works too.
"""

import sys

from xpuspec import AutoModelForCausalLM, AutoTokenizer  # was: from transformers import ...

model_id = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m-instruct"
tokenizer = AutoTokenizer.from_pretrained(model_id)
model = AutoModelForCausalLM.from_pretrained(model_id)

inputs = tokenizer("def fibonacci(n):", return_tensors="pt")
output = model.generate(**inputs, max_new_tokens=32, do_sample=False)
print(tokenizer.decode(output[0], skip_special_tokens=True))
