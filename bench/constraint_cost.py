"""What constrained decoding costs on the CPU, apart from the model: building llguidance's
token table, one row's mask per step (a JSON schema, random logits), applying a mask, and a
batch of 8 masks computed in parallel after the model call or on a background thread while
it runs (an onnxruntime MatMul standing in for the LM head).

    python -m kvserve.bench.constraint_cost --qwen3 DIR   (DIR holds Qwen3's tokenizer.json)
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import numpy as np

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 4}},
    "required": ["name", "age", "tags"], "additionalProperties": False}


def _corpus():
    r = random.Random(0)
    words = ["".join(r.choice("abcdefghijklmnopqrstuvwxyzéü_0123456789")
                     for _ in range(r.randint(2, 9))) for _ in range(40000)]
    docs = [" ".join(r.choice(words) for _ in range(200)) for _ in range(2000)]
    return docs + [json.dumps({f"k{i}": [i, f"text {i}", {"x": i * 1.5}]}) for i in range(3000)]


def per_step(name, tokenizer_json, vocab, eos, steps=200):
    import llguidance.numpy as lln

    from kvserve.server.constraints import ConstraintSpec, GuideTokenizer, apply_bitmask

    g = GuideTokenizer(tokenizer_json, vocab, eos)
    rng = np.random.default_rng(0)
    c, mask, ts = g.constraint(ConstraintSpec.json_schema(SCHEMA)), \
        lln.allocate_token_bitmask(1, vocab), []
    for _ in range(steps):
        if c.done:
            c = g.constraint(ConstraintSpec.json_schema(SCHEMA))
        t = time.perf_counter()
        c.fill(mask)
        ts.append(time.perf_counter() - t)
        lg = rng.standard_normal((1, vocab)).astype(np.float32)
        apply_bitmask(lg, mask)
        c.consume(int(lg.argmax()))
    half = rng.integers(-2**31, 2**31 - 1, size=mask.shape, dtype=np.int64).astype(np.int32)
    lg = rng.standard_normal((1, vocab)).astype(np.float32)
    a = []
    for f in (apply_bitmask, lln.apply_token_bitmask_inplace):
        t = time.perf_counter()
        for _ in range(20):
            f(lg.copy(), half)
        a.append((time.perf_counter() - t) / 20 * 1e3)
    ts = np.array(ts) * 1e3
    print(f"{name}: vocab {vocab}: table built in {g.build_s * 1e3:.0f} ms; mask per step "
          f"median {np.median(ts):.3f} ms, mean {ts.mean():.3f}, p90 {np.percentile(ts, 90):.3f},"
          f" max {ts.max():.2f}; apply (half-open mask) {a[0]:.3f} ms, "
          f"llguidance.numpy {a[1]:.3f} ms")
    return g


def overlap(g, batch=8, hidden=256, steps=40):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from kvserve.server.constraint_masks import MaskBatch
    from kvserve.server.constraints import ConstraintSpec

    v = g.vocab_size
    w = np.random.default_rng(0).standard_normal((hidden, v)).astype(np.float32) * 0.05
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])], "head",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, v])],
        [numpy_helper.from_array(w, "W")])
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    sess = ort.InferenceSession(helper.make_model(graph).SerializeToString(), so,
                                providers=["CPUExecutionProvider"])
    x = np.random.default_rng(1).standard_normal((batch, hidden)).astype(np.float32)
    rng = np.random.default_rng(2)
    for background in (False, True):
        live = {i: g.constraint(ConstraintSpec.json_schema(SCHEMA)) for i in range(batch)}
        mb, run_t, mask_t, apply_t = MaskBatch(v, batch), [], [], []
        for _ in range(steps):
            rows = sorted(live.items())
            t0 = time.perf_counter()
            if background:
                mb.start(rows)
            y = sess.run(None, {"x": x})[0]
            t1 = time.perf_counter()
            mb.wait() if background else mb.fill(rows)
            t2 = time.perf_counter()
            mb.apply(y, rows)
            t3 = time.perf_counter()
            run_t.append(t1 - t0)
            mask_t.append(t2 - t1)
            apply_t.append(t3 - t2)
            noise = rng.standard_normal(y.shape).astype(np.float32) * 3  # a random model
            for i, c in rows:
                c.consume(int(np.argmax(y[i] + noise[i])))
                if c.done:
                    live[i] = g.constraint(ConstraintSpec.json_schema(SCHEMA))
        mb.close()
        print(f"batch {batch}, vocab {v}, background={background}: model call median "
              f"{np.median(run_t) * 1e3:.2f} ms; masks after it {np.median(mask_t) * 1e3:.3f} ms;"
              f" apply {np.median(apply_t) * 1e3:.3f} ms")


def main(argv=None):
    from kvserve.model.tokenizer import train_bpe

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--qwen3", type=Path, help="a directory with Qwen3's tokenizer.json")
    a = ap.parse_args(argv)
    docs = _corpus()
    for v in (4096, 16384, 32768):
        tok = train_bpe(docs, vocab_size=v, min_frequency=1)
        per_step(f"byte-level BPE {v}", tok.to_str(), tok.vocab_size, [tok.eos_id])
    if a.qwen3:
        g = per_step("Qwen3", (a.qwen3 / "tokenizer.json").read_text(), 151936,
                     [151645, 151643])
        overlap(g)


if __name__ == "__main__":
    main()
