#!/usr/bin/env bash
# Install kvserve with everything for training, export, serving and tests.
# torch is pinned (pyproject's `train` extra: torch==2.13.0, the CPU build on this project's
# machines); the server alone needs no torch: `pip install .`
# Skipped when this Python already has this checkout installed from the same pyproject.toml,
# setup.py and protos/ (a stamp of those files and of the interpreter, kept in build/);
# KVSERVE_REINSTALL=1 installs anyway.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STAMP=build/install.stamp
want=$({ "$PY" -c 'import sys; print(sys.prefix, sys.version)'
         cat pyproject.toml setup.py
         find protos -type f | LC_ALL=C sort | xargs cat; } | sha256sum | cut -d' ' -f1)
installed() {  # this checkout is what the interpreter imports, with its generated stubs
  "$PY" - "$PWD" <<'PY' 2>/dev/null
import pathlib, sys
import kvserve, kvserve.v1.inference_pb2  # noqa: F401
sys.exit(pathlib.Path(kvserve.__file__).resolve().parents[1] != pathlib.Path(sys.argv[1]).resolve())
PY
}
native() {  # the native CPU attention library for this source and CPU (the build makes it;
  # a checkout changed since, or a build without the headers: now). Without it serving uses
  # onnxruntime's kernel; the tests then check that path.
  "$PY" -m kvserve.cli native status >/dev/null 2>&1 || "$PY" -m kvserve.cli native build ||
    echo "== the native attention library could not be built: onnxruntime's kernel is used"
}
PREFIX=$("$PY" -c 'import sys; print(sys.prefix)')
if [ "${KVSERVE_REINSTALL:-0}" != 1 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] \
    && installed && command -v kvserve >/dev/null; then
  echo "== kvserve is installed and current in $PREFIX (pyproject.toml, setup.py and protos/"
  echo "   unchanged since the last install): skipping it (KVSERVE_REINSTALL=1 forces it)"
  native
  exit 0
fi
TORCH=$(sed -n 's/.*"\(torch==[^"]*\)".*/\1/p' pyproject.toml | head -1)
echo "== installing kvserve into $PREFIX: pip install -e \".[train,test]\""
echo "   ($TORCH CPU, onnxruntime, onnx, grpcio, aiohttp, ...: a minute or two the first time)"
"$PY" -m pip install -q -e ".[train,test]"
mkdir -p build
echo "$want" > "$STAMP"
native
echo "== installed kvserve $("$PY" -c 'import kvserve; print(kvserve.__version__)')"
