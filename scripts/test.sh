#!/usr/bin/env bash
# The whole test suite (what CI runs). Installs what it needs first.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec python3 -m pytest -q "$@"
