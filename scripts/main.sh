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
PY=${PYTHON:-python3}
# "done" when the checkpoint's run reached its planned steps, else the steps it has
ckpt_state() {
  "$PY" - "$CKPT" <<'PY'
import json, pathlib, sys
s = json.loads((pathlib.Path(sys.argv[1]) / "train_state.json").read_text())
total = s.get("schedule", {}).get("total_steps")
print("done" if total is None or s["step"] >= total else f"{s['step']} of {total} steps")
PY
}
# whether the artifact was exported from the checkpoint's weights (the manifest records them)
art_matches_ckpt() {
  "$PY" - "$ART" "$CKPT" <<'PY'
import hashlib, json, pathlib, sys
art, ckpt = map(pathlib.Path, sys.argv[1:])
want = json.loads((art / "manifest.json").read_text())["source"]["weights_sha256"]
h = hashlib.sha256()
with open(ckpt / "model.safetensors", "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
sys.exit(h.hexdigest() != want)
PY
}
if [ -f "$CKPT/model.safetensors" ]; then
  state=$(ckpt_state)
  if [ "$state" = done ]; then
    echo "== reusing the trained checkpoint $CKPT (delete it to retrain)"
  else
    echo "== the checkpoint $CKPT stopped at $state: continuing its run (--resume)"
    kvserve train --out "$CKPT" --resume
  fi
else
  echo "== training the default model into $CKPT"
  kvserve train --out "$CKPT"
fi
if [ -d "$ART" ] && kvserve verify "$ART" >/dev/null 2>&1 && art_matches_ckpt 2>/dev/null; then
  echo "== reusing the verified artifact $ART (exported from $CKPT's weights)"
else
  echo "== exporting $CKPT to $ART (parity gate included)"
  kvserve export "$CKPT" --out "$ART" --overwrite
fi
kvserve serve "$ART" --check-ports  # (again: the training took minutes)
echo "== serving $ART on port ${KVSERVE_PORT:-50051} (Ctrl-C drains and stops)"
echo "   stream from it:  kvserve generate \"def fibonacci(n):\" --server localhost:${KVSERVE_PORT:-50051}"
exec kvserve serve "$ART"
