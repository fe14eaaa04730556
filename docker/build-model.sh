#!/usr/bin/env bash
# The model-builder's entry point (docker/Dockerfile, target model-builder): make sure a
# verified artifact exists at $KVSERVE_MODEL_DIR, doing only the work that is missing.
#
#   1. `kvserve verify $KVSERVE_MODEL_DIR` passes      -> nothing to do, exit 0
#   2. $KVSERVE_HF_DIR/config.json exists               -> kvserve import-hf into $KVSERVE_RUN_DIR
#      else $KVSERVE_RUN_DIR/train_state.json exists    -> kvserve train --resume (finishes an
#                                                          interrupted run; a finished one stops
#                                                          at once)
#      else                                             -> kvserve train (the default model)
#   3. kvserve export (parity gate, manifest) into a temporary directory beside the target,
#      kvserve verify, then swap it in, so servers never see a half-written artifact.
#
# Env: KVSERVE_MODEL_DIR (/models/current), KVSERVE_RUN_DIR (/runs/default), KVSERVE_HF_DIR
# (/hf), KVSERVE_TRAIN_ARGS / KVSERVE_EXPORT_ARGS (extra flags, word-split),
# KVSERVE_FORCE_REBUILD=1 (export again even when the artifact verifies).
set -euo pipefail

model_dir=${KVSERVE_MODEL_DIR:-/models/current}
run_dir=${KVSERVE_RUN_DIR:-/runs/default}
hf_dir=${KVSERVE_HF_DIR:-/hf}
read -r -a train_args <<<"${KVSERVE_TRAIN_ARGS:-}"
read -r -a export_args <<<"${KVSERVE_EXPORT_ARGS:-}"

log() { echo "kvserve-build-model: $*" >&2; }

if [[ "${KVSERVE_FORCE_REBUILD:-0}" != 1 && -f "$model_dir/manifest.json" ]] &&
    kvserve verify "$model_dir"; then
    log "$model_dir verifies; nothing to do"
    exit 0
fi

if [[ -f "$hf_dir/config.json" ]]; then
    log "importing the Hugging Face model in $hf_dir"
    kvserve import-hf "$hf_dir" --out "$run_dir" --overwrite
elif [[ -f "$run_dir/train_state.json" ]]; then
    log "resuming the training run in $run_dir"
    kvserve train --resume --out "$run_dir" "${train_args[@]}"
else
    log "training the default model into $run_dir"
    kvserve train --out "$run_dir" "${train_args[@]}"
fi

staging="$(dirname "$model_dir")/.staging-$(basename "$model_dir")"
rm -rf "$staging"
kvserve export "$run_dir" --out "$staging" --overwrite "${export_args[@]}"
kvserve verify "$staging"
old="$(dirname "$model_dir")/.old-$(basename "$model_dir")"
rm -rf "$old"
if [[ -e "$model_dir" ]]; then mv "$model_dir" "$old"; fi
mv "$staging" "$model_dir"
rm -rf "$old"
log "artifact ready at $model_dir"
