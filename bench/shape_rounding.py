"""Which calls compute a token's row alike (a script): why the speed features are off on int8
and int4 artifacts by default (``server/rounding.py``), and what would make them exact there.

    python bench/shape_rounding.py [--size bench-100m] [--rounds 20]
                                   [--update-committed | --out FILE.json] [--render-only]

On ``bench/build.py``'s models (fp32, int8 per row, int8 and int4 ``MatMulNBits`` blocks):
1. agreement (``FusedLM``, 40-token random prompts, 3 trials): the logits of the same tokens
   from a one-token step against a call of several tokens, from calls of 3 and of 5 tokens at
   batch 1 and 4, from batch 1 against batch 4, and from a whole prefill against a call of 3
   after the prompt; the largest difference over the largest logit;
2. where it starts (fp32): the graph with every node's output exposed, a call of 3 tokens
   against a one-token step after the same 40, the row of the first new token: the first node
   whose output differs, and by how much;
3. the price of a step of two tokens per row (the last one fed again, so that every row comes
   from the multi-token path) against a one-token step, batch 1 and 8, alternating, medians.

Results: ``shape-rounding.json`` and ``.md`` (``--update-committed``: ``bench/results/``;
docs/speed.md quotes them).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from kvserve.bench.common import parse_results_args, run_header, write_results

PROMPT = 40
ARTIFACTS = ("fp32", "int8-rows", "int8-b64", "int4-b32", "int4-b64")


def _rel(a: np.ndarray, b: np.ndarray, scale: float) -> float:
    return float(np.abs(a - b).max() / scale)


def agreement(lm, trials: int = 3) -> dict:
    """Largest differences over the largest logit between ways of computing the same rows."""
    g = np.random.default_rng(1)
    V = lm.cfg.vocab_size
    worst = dict.fromkeys(("one-token step vs call of 4", "calls of 3 vs 5 (batch 1)",
                           "calls of 3 vs 5 (batch 4)", "batch 1 vs 4 (calls of 3)",
                           "prefill vs call of 3"), 0.0)
    for _ in range(trials):
        kv = lm.new_cache(4, 256)
        prompts = [g.integers(2, V, PROMPT).tolist() for _ in range(4)]
        lm.prefill(kv, 0, prompts)
        before = kv.used[:4].copy()
        rows = [g.integers(2, V, 5).tolist() for _ in range(4)]

        def again(fn):
            out = fn()
            kv.used[:4] = before
            return out

        steps = again(lambda: np.stack([lm.decode(kv, 4, [r[j] for r in rows])[0].copy()
                                        for j in range(4)], 1))
        four = again(lambda: lm.verify(kv, 4, [r[:4] for r in rows])[:, :4].copy())
        a = again(lambda: lm.verify(kv, 4, [r[:3] for r in rows])[:, :3].copy())
        b = again(lambda: lm.verify(kv, 4, rows)[:, :3].copy())
        c = again(lambda: lm.verify(kv, 1, [rows[0][:3]])[:, :3].copy())
        d = again(lambda: lm.verify(kv, 1, [rows[0]])[:, :3].copy())
        kv2 = lm.new_cache(1, 256)
        pf = lm.prefill(kv2, 0, [prompts[0] + rows[0][:3]]).logits[0][PROMPT:PROMPT + 3]
        scale = float(np.abs(a).max())
        for k, v in (("one-token step vs call of 4", _rel(steps, four, scale)),
                     ("calls of 3 vs 5 (batch 1)", _rel(c, d, scale)),
                     ("calls of 3 vs 5 (batch 4)", _rel(a, b, scale)),
                     ("batch 1 vs 4 (calls of 3)", _rel(c[0], a[0], scale)),
                     ("prefill vs call of 3", _rel(pf, c[0], scale))):
            worst[k] = max(worst[k], v)
    return worst


def first_difference(model_path: Path, vocab: int) -> dict:
    """fp32: the first node whose output for the first new token differs between a one-token
    step and a call of 3 tokens after the same prompt (onnxruntime, every output exposed)."""
    import onnx
    import onnxruntime as ort

    from kvserve.artifact.spec import (INPUT_IDS, LOGITS_ROWS, QUERY_SEQLENS, SEQLENS_K,
                                       TOTAL_SEQUENCE_LENGTH, FusedSpec)

    spec = FusedSpec()
    m = onnx.load(str(model_path))
    have = {o.name for o in m.graph.output}  # (logits and the present rows)
    order = []
    for n in m.graph.node:
        for o in n.output:
            if o and o not in have:
                m.graph.output.append(onnx.helper.make_empty_tensor_value_info(o))
                order.append((n.op_type, n.name, o))
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    s = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    ins = {i.name: i for i in s.get_inputs()}
    caches = [(spec.past(i, kv), spec.present(i, kv)) for i in range(len(ins))
              for kv in ("key", "value") if spec.past(i, kv) in ins]
    _, kvh, _, hd = ins[caches[0][0]].shape
    names = [o.name for o in s.get_outputs()]
    g = np.random.default_rng(0)

    def run(ids, past_len, past):
        S = ids.shape[1]
        feed = {INPUT_IDS: ids, SEQLENS_K: np.array([past_len + S - 1], np.int32),
                QUERY_SEQLENS: np.array([S], np.int32),
                TOTAL_SEQUENCE_LENGTH: np.array(past_len + S, np.int32),
                LOGITS_ROWS: np.arange(S, dtype=np.int64)[None]}
        feed.update({p: rows.copy() for (p, _), rows in zip(caches, past)})
        out = dict(zip(names, s.run(None, feed)))
        return out, [out[q] for _, q in caches]

    zero = [np.zeros((1, kvh, 64, hd), np.float32) for _ in caches]
    _, past = run(g.integers(2, vocab, (1, PROMPT)), 0, zero)
    t = g.integers(2, vocab, (1, 3))
    one, _ = run(t[:, :1], PROMPT, past)
    three, _ = run(t, PROMPT, past)
    for op, node, o in order:
        a, b = one[o], three[o]
        if a.dtype == np.float32 and a.ndim >= 2:
            diff = float(np.abs(a[:, 0] - b[:, 0]).max())
            if diff > 0:
                return {"op": op, "node": node, "difference": diff}
    return {"op": None, "node": None, "difference": 0.0}


def two_token_cost(lm, rounds: int) -> dict:
    """A step of two tokens per row against a one-token step: median seconds ratio."""
    g = np.random.default_rng(0)
    V = lm.cfg.vocab_size
    out = {}
    for B in (1, 8):
        kv = lm.new_cache(B, 256)
        lm.prefill(kv, 0, [g.integers(2, V, 64).tolist() for _ in range(B)])
        before = kv.used[:B].copy()
        res = {1: [], 2: []}
        for r in range(rounds):
            for S in ((1, 2) if r % 2 else (2, 1)):
                ts = []
                for _ in range(6):
                    kv.used[:B] = before
                    t0 = time.perf_counter()
                    if S == 1:
                        lm.decode(kv, B, g.integers(2, V, B).tolist())
                    else:
                        lm.verify(kv, B, [g.integers(2, V, 2).tolist() for _ in range(B)])
                    ts.append(time.perf_counter() - t0)
                res[S].append(float(np.median(ts[1:])))
        kv.used[:B] = before
        out[str(B)] = {"one_token_ms": 1e3 * float(np.median(res[1])),
                       "ratio": float(np.median(res[2]) / np.median(res[1]))}
    return out


def render(data: dict) -> str:
    keys = list(next(iter(data["artifacts"].values()))["agreement"])
    out = ["# Which calls compute a row alike", "",
           f"`bench/shape_rounding.py` on {data['size']} ({data['cpu']}, onnxruntime "
           f"{data['onnxruntime']}, {data['date']}): the largest difference between the same "
           f"tokens' logits computed in two ways, over the largest logit (3 trials); a step of "
           f"two tokens per row against a one-token step (medians of {data['rounds']} "
           f"alternating rounds).", "",
           "| artifact | " + " | ".join(keys) + " | two-token step, batch 1 | batch 8 |",
           "|---" * (len(keys) + 3) + "|"]
    for name, a in data["artifacts"].items():
        cost = a["two_token_cost"]
        out.append(f"| {name} | " + " | ".join(f"{a['agreement'][k]:.2g}" for k in keys) +
                   f" | {cost['1']['ratio']:.2f}× | {cost['8']['ratio']:.2f}× |")
    f = data["first_difference"]
    out += ["", f"fp32, a call of 3 tokens against a one-token step, the first new token's "
                f"row: the first node whose output differs is `{f['node']}` ({f['op']}), by "
                f"{f['difference']:.2g}.",
            "", "The two-token step columns priced, before it existed, a graph that takes "
                "every row through the multi-token path; that graph is paired attention "
                "(`kvserve export --paired-attention`), whose own price "
                "`bench/paired_attention.py` measures "
                "([paired-attention.md](paired-attention.md))."]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:

    from kvserve.artifact.loader import load_lm
    from kvserve.bench.build import build

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="bench-100m")
    ap.add_argument("--rounds", type=int, default=20)
    parsed = parse_results_args(ap, argv, "shape-rounding.json", render)
    if parsed is None:
        return 0
    args, out = parsed
    built = build(args.size, Path(args.cache), genai=False, int8=True, int4=True)
    root = built.fp32.parent
    dirs = {"fp32": built.fp32, "int8-rows": root / "int8-rows", "int8-b64": built.int8,
            "int4-b32": root / "int4-b32", "int4-b64": built.int4}
    data = {**run_header(size=args.size, rounds=args.rounds),
            "first_difference": first_difference(
                built.fp32 / "model.onnx",
                json.loads((built.fp32 / "config.json").read_text())["vocab_size"]),
            "artifacts": {}}
    for label in ARTIFACTS:
        d = dirs[label]
        if not (d / "model.onnx").is_file():
            print(f"{label}: no artifact at {d} (bench/quant_blocks.py makes it)", flush=True)
            continue
        lm = load_lm(str(d), provider="cpu", threads=2, attention=False)
        data["artifacts"][label] = {"quantization": lm.manifest.get("quantization"),
                                    "agreement": agreement(lm),
                                    "two_token_cost": two_token_cost(lm, args.rounds)}
        print(f"{label}: done", flush=True)
    write_results(out, data, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
