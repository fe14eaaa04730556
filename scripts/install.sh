#!/usr/bin/env bash
# Install kvserve with everything for training, export, serving and tests.
# torch is pinned (pyproject's `train` extra: torch==2.13.0, the CPU build on this project's
# machines); the server alone needs no torch: `pip install .`
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e ".[train,test]"
