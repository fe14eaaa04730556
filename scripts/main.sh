#!/usr/bin/env bash
# The main job, from a clean clone: install, train the default model (or reuse it), export it
# with the parity gate (or reuse a verified artifact), then serve it over gRPC.
#   KVSERVE_CKPT       checkpoint dir   (default runs/default)
#   KVSERVE_ARTIFACTS  artifact dir     (default artifacts/default)
#   KVSERVE_PORT       gRPC port        (default 50051; all `kvserve serve` flags have KVSERVE_* vars)
# Stream from it in another terminal:  kvserve generate "def fibonacci(n):" --server localhost:50051
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
CKPT=${KVSERVE_CKPT:-runs/default}
ART=${KVSERVE_ARTIFACTS:-artifacts/default}
# the ports first (gRPC, and KVSERVE_HTTP_PORT / KVSERVE_METRICS_PORT when set): a busy one is
# one line now, not after the training
kvserve serve "$ART" --check-ports
if [ -f "$CKPT/model.safetensors" ]; then
  echo "== reusing the trained checkpoint $CKPT (delete it to retrain)"
else
  echo "== training the default model into $CKPT"
  kvserve train --out "$CKPT"
fi
if [ -d "$ART" ] && kvserve verify "$ART" >/dev/null 2>&1; then
  echo "== reusing the verified artifact $ART"
else
  echo "== exporting $CKPT to $ART (parity gate included)"
  kvserve export "$CKPT" --out "$ART" --overwrite
fi
kvserve serve "$ART" --check-ports  # (again: the training took minutes)
echo "== serving $ART on port ${KVSERVE_PORT:-50051} (Ctrl-C drains and stops)"
echo "   stream from it:  kvserve generate \"def fibonacci(n):\" --server localhost:${KVSERVE_PORT:-50051}"
exec kvserve serve "$ART"
