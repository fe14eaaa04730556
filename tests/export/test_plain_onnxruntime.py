"""Third-party use: plain onnxruntime, driven only by the published conventions (manifest +
NOTES §1, ``present`` = this call's new rows), reproduces torch's logits on a left-padded
batch, on the portable graphs (``kvserve export --portable``). No kvserve runtime code is used
on the ONNX side."""
from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
from export_matrix import LOGIT_TOL

from kvserve.model.generate import generate, left_pad


def test_plain_onnxruntime_prefill_then_decode(main_model, store):
    main_artifact = store.artifact("llama", portable=True)
    m = json.loads((main_artifact / "manifest.json").read_text())
    assert m["runtime"]["kv"]["layout"] == "new_rows"
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = {g: ort.InferenceSession(str(main_artifact / m["graphs"][g]["file"]), so,
                                    providers=["CPUExecutionProvider"])
            for g in ("prefill", "decode")}
    pre_out = m["graphs"]["prefill"]["outputs"]
    dec_in, dec_out = m["graphs"]["decode"]["inputs"], m["graphs"]["decode"]["outputs"]
    past_names = [n for n in dec_in if n.startswith("past_key_values.")]
    present_names = [n for n in dec_out if n.startswith("present.")]
    assert [n.replace("past_key_values.", "present.") for n in past_names] == present_names

    g = np.random.default_rng(21)
    prompts = [g.integers(0, main_model.cfg.vocab_size, n).tolist() for n in (9, 2, 14)]
    steps = 24
    ref = generate(main_model, prompts, steps + 1, keep_logits=True)
    ids, mask = (t.numpy() for t in left_pad(prompts))
    B = len(prompts)

    # prefill: left-padded, positions = cumsum(mask) - 1 with pads at 0
    pos = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
    out = dict(zip(pre_out, sess["prefill"].run(None, {"input_ids": ids, "attention_mask": mask,
                                                         "position_ids": pos})))
    for b in range(B):
        assert np.abs(out["logits"][b, -1] - ref.logits[b][0]).max() <= LOGIT_TOL
    past = {p: out[q] for p, q in zip(past_names, present_names)}  # pad rows stay, masked

    positions = np.array([len(p) for p in prompts], dtype=np.int64)
    for step in range(steps):
        tokens = np.array([[ref.tokens[b][step]] for b in range(B)], dtype=np.int64)
        mask = np.concatenate([mask, np.ones((B, 1), np.int64)], axis=1)
        feeds = {"input_ids": tokens, "attention_mask": mask,
                 "position_ids": positions[:, None].copy(), **past}
        out = dict(zip(dec_out, sess["decode"].run(None, feeds)))
        for b in range(B):
            assert np.abs(out["logits"][b, 0] - ref.logits[b][step + 1]).max() <= LOGIT_TOL
        for p, q in zip(past_names, present_names):
            assert out[q].shape[2] == 1  # the new token's rows only
            past[p] = np.concatenate([past[p], out[q]], axis=2)
        positions += 1
