"""The pure parts of ``bench/score_profile.py``: op-type totals of an onnxruntime profile, the
MatMul FLOPs read from its shapes, the roofline fraction and its factors, the docs block. The
profile events here are made by hand in onnxruntime's format (one ``model_run`` Session event
per graph run, ``*_kernel_time`` Node events with ``op_name`` and the shapes); one test reads a
real profile of a one-MatMul graph."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from kvserve.bench import score_profile as S


def _node(op: str, ts: float, dur: float, x: list[int], y: list[int]) -> dict:
    return {"cat": "Node", "name": f"{op.lower()}_1_kernel_time", "ts": ts, "dur": dur,
            "args": {"op_name": op, "input_type_shape": [{"float": x}],
                     "output_type_shape": [{"float": y}]}}


def _run(ts: float, dur: float) -> dict:
    return {"cat": "Session", "name": "model_run", "ts": ts, "dur": dur}


def _events() -> list[dict]:
    """Two graph runs: a (2, 256, 64) x (64, 128) MatMul (4.19 MFLOP) in 100 us and
    attention in 50 us, a norm (fused, unfused name) in 10 us; the second run's MatMul takes
    200 us."""
    ev = []
    for k, (t0, mm) in enumerate(((0.0, 100.0), (1000.0, 200.0))):
        ev += [_run(t0, 400.0),
               _node("MatMul", t0 + 1, mm, [2, 256, 64], [2, 256, 128]),
               _node("GroupQueryAttention", t0 + 2 + mm, 50.0, [2, 256, 192], [2, 256, 64]),
               _node("SkipSimplifiedLayerNormalization", t0 + 300, 10.0, [2, 256, 64],
                     [2, 256, 64])]
    ev.append({"cat": "Node", "name": "matmul_1_fence_before", "ts": 5.0, "dur": 0.0,
               "args": {"op_name": "MatMul"}})  # not a kernel time: ignored
    return ev


def test_matmul_flops_from_the_recorded_shapes():
    args = _node("MatMul", 0, 1, [2, 256, 64], [2, 256, 128])["args"]
    assert S.matmul_flops(args) == 2 * 512 * 64 * 128


def test_op_shares_sum_each_op_type_in_the_window():
    both = S.op_shares(_events())
    assert both["nodes_us"] == pytest.approx(300 + 100 + 20)
    assert both["run_us"] == 800.0
    assert both["ops"]["MatMul"] == {"us": 300.0, "calls": 2, "share": pytest.approx(300 / 420)}
    assert list(both["ops"]) == ["MatMul", "GroupQueryAttention",
                                 "SkipSimplifiedLayerNormalization"]  # by time
    assert sum(o["share"] for o in both["ops"].values()) == pytest.approx(1.0)
    flops = 2 * 512 * 64 * 128
    assert both["matmul_flops"] == 2 * flops
    assert both["matmul_gflops"] == pytest.approx(2 * flops / 300e-6 / 1e9)
    assert both["matmul_by_shape"] == {"512x64x128": {"us": 300.0, "gflops": pytest.approx(
        2 * flops / 300e-6 / 1e9)}}
    # the second run alone (its window as run_windows gives it)
    w = S.run_windows(_events())
    assert w == [(0.0, 400.0), (1000.0, 1400.0)]
    second = S.op_shares(_events(), *w[1])
    assert second["ops"]["MatMul"]["us"] == 200.0 and second["run_us"] == 400.0
    assert second["matmul_gflops"] == pytest.approx(flops / 200e-6 / 1e9)
    assert S.op_shares([], 0, 1)["matmul_gflops"] is None


def test_roofline_fraction_and_its_factors():
    # 100 GFLOP/s, 10 MFLOP a token: 10,000 tok/s; 7,000 reached
    r = S.roofline(7000.0, 100.0, 10e6)
    assert r["roofline_tok_s"] == pytest.approx(10_000.0)
    assert r["fraction"] == pytest.approx(0.7)
    prof = S.op_shares(_events(), *S.run_windows(_events())[0])
    # 512 tokens at 10 MFLOP each over the MatMul's 4.19 MFLOP; the timed call: 0.1 s at
    # 5,120 tok/s, 0.9 of it in onnxruntime
    fl = 2 * 512 * 64 * 128
    e = S.explained({"inside_ort": 0.9, "seconds": 0.1}, prof, 100.0, 10e6, 512)
    assert e["matmul_share"] == pytest.approx(100 / 160)
    t_mm = 0.1 * 0.9 * 100 / 160
    assert e["matmul_efficiency"] == pytest.approx(fl / 100e9 / t_mm)
    assert e["matmul_efficiency_profiled"] == pytest.approx(prof["matmul_gflops"] / 100.0)
    assert e["flops_over_matmul_flops"] == pytest.approx(512 * 10e6 / fl)
    # the factors multiply to the fraction of the timed call
    assert e["product"] == pytest.approx(S.roofline(512 / 0.1, 100.0, 10e6)["fraction"])
    # MatMul at 100 GFLOP/s: its t_mm seconds become 4.19 MFLOP / 100 GFLOP/s
    assert e["ceiling_matmul_at_roofline"] == pytest.approx(
        512 * 10e6 / 100e9 / (0.1 - t_mm + fl / 100e9))


def test_attention_gflops_on_the_causal_and_the_computed_flops():
    prof = S.op_shares(_events(), *S.run_windows(_events())[0])  # attention: 50 us
    a = S.attention_gflops(prof, n_layers=2, d_model=64, tokens=255, scored=512)
    causal = 4 * 2 * 64 * 128 * 512  # (255 + 1) / 2 = 128 positions on average
    assert a["causal_gflops"] == pytest.approx(causal / 50e-6 / 1e9)
    assert a["computed_gflops"] == pytest.approx(a["causal_gflops"] * 2 * 255 / 256)
    assert S.attention_gflops({"ops": {}}, 2, 64, 255, 512) is None
    assert a["op"] == "GroupQueryAttention"
    ours = S.attention_gflops({"ops": {"KVAttention": {"us": 50.0}}}, 2, 64, 255, 512)
    assert ours["op"] == "KVAttention"  # kvserve's kernel computes the causal products only
    assert ours["computed_gflops"] == pytest.approx(ours["causal_gflops"])
    assert ours["causal_gflops"] == pytest.approx(a["causal_gflops"])


def test_same_shape_efficiency_weighs_each_shape_by_its_time():
    prof = {"matmul_by_shape": {"a": {"us": 100.0, "gflops": 50.0},
                                "b": {"us": 300.0, "gflops": 100.0}}}
    # a at its alone-speed 100 would take 50 us, b at 200 would take 150 us: 200 / 400
    assert S.same_shape_efficiency(prof, {"a": 100.0, "b": 200.0}) == pytest.approx(0.5)
    assert S.same_shape_efficiency(prof, {"a": 100.0}) is None  # a shape not measured


def _round(tok_s: float, gflops: float, run_us: float, mm_us: float) -> dict:
    ev = [_run(0.0, run_us), _node("MatMul", 1.0, mm_us, [2, 256, 64], [2, 256, 128]),
          _node("GroupQueryAttention", 2.0 + mm_us, 50.0, [2, 256, 192], [2, 256, 64])]
    return {"timed": {"tok_s": tok_s, "seconds": S.SEQUENCES * S.TOKENS / tok_s,
                      "inside_ort": 0.9,
                      "log_softmax": 0.05, "rest": 0.05},
            "profile": S.op_shares(ev), "roofline_gflops": gflops, "load": 2.0,
            "peak_by_shape": {"2048x64x128": gflops, "512x64x128": gflops * 1.1},
            "fraction": S.roofline(tok_s, gflops, 10e6)["fraction"]}


def test_summarise_keeps_the_best_of_each_measurement():
    """A burst halves a round's roofline (round 2) or its Score call (round 1): the summary
    takes the fastest call, the fastest profiled pass and the highest GFLOP/s of the run."""
    rounds = [_round(2000.0, 200.0, 400.0, 200.0), _round(4000.0, 100.0, 300.0, 100.0),
              _round(3800.0, 190.0, 350.0, 150.0)]
    out = S.summarise(rounds, 10e6, {"n_layers": 2, "d_model": 64}, 1953)
    b = out["best"]
    assert b["tok_s"] == 4000.0 and b["roofline_gflops"] == 200.0
    assert b["fraction"] == pytest.approx(4000.0 * 10e6 / 200e9)
    assert b["fraction_all_shapes"] == pytest.approx(4000.0 * 10e6 / 220e9)
    assert b["op_shares"]["MatMul"] == pytest.approx(100 / 150)  # round 2's pass: the fastest
    assert b["round_fractions"] == pytest.approx([0.1, 0.4, 0.2])
    assert out["peak_by_shape"] == {"2048x64x128": 200.0, "512x64x128": pytest.approx(220.0)}
    assert b["explained"]["product"] == pytest.approx(b["fraction"])
    assert b["attention"]["causal_gflops"] > 0 and out["chunk_tokens"] == 1953


def test_real_profile_of_one_matmul(tmp_path):
    """onnxruntime's own profile of a one-node graph reads as one MatMul of the right FLOPs."""
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.ones((32, 48), np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "mm",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16, 32])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])
    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "p")
    sess = ort.InferenceSession(helper.make_model(g, opset_imports=[
        helper.make_opsetid("", 17)]).SerializeToString(), so,
        providers=["CPUExecutionProvider"])
    for _ in range(3):
        sess.run(None, {"x": np.ones((4, 16, 32), np.float32)})
    events = json.loads(open(sess.end_profiling()).read())
    w3 = S.run_windows(events)
    assert len(w3) == 3
    p = S.op_shares(events, w3[1][0], w3[2][1] + 1)  # the last two runs
    assert p["ops"]["MatMul"]["calls"] == 2 and p["ops"]["MatMul"]["share"] == 1.0
    assert p["matmul_flops"] == 2 * 2 * 64 * 32 * 48
    assert list(p["matmul_by_shape"]) == ["64x32x48"]
    assert p["matmul_gflops"] > 0 and math.isfinite(p["matmul_gflops"])


def _result(size: str, fraction: float) -> dict:
    med = {"tok_s": 700.0, "roofline_tok_s": 1000.0, "fraction": fraction,
           "split": {"inside_ort": 0.97, "log_softmax": 0.02, "rest": 0.01},
           "op_shares": {"MatMul": 0.8, "GroupQueryAttention": 0.12, "Split": 0.05,
                         "Mul": 0.03},
           "matmul_gflops": 90.0, "matmul_vs_same_shapes": 0.95,
           "explained": {"inside_ort": 0.97, "matmul_share": 0.8, "matmul_efficiency": 0.9,
                         "matmul_efficiency_profiled": 0.88,
                         "flops_over_matmul_flops": 1.03, "product": 0.72,
                         "ceiling_matmul_at_roofline": 0.8}}
    return {"best": {**med, "fraction_all_shapes": fraction - 0.05,
                     "attention": {"causal_gflops": 20.0, "computed_gflops": 39.8},
                     "round_fractions": [fraction, 0.5]}}


def test_render_writes_a_row_per_size_between_the_markers(tmp_path):
    from kvserve.bench.report import update_doc

    res = {"meta": {"date": "2026-12-01 19:00 UTC", "machine": "cpu, 2 cores", "rounds": 3,
                    "threads": 2,
                    "load_before": 1.5, "load_after": 2.0},
           "sizes": {"bench-6m": _result("bench-6m", 0.7)}}
    text = S.render(res)
    assert ("| bench-6m | 700 | 1,000 | 0.70 (0.65) | 97.0% | 2.0% | 1.0% | 80.0% | 12.0% | "
            "8.0% | 0.90; 0.88 | 0.95 |") in text
    assert "bench-6m: Split 5.0%, Mul 3.0%." in text
    assert "0.97 × 0.80 × 0.90 × 1.03 = 0.72" in " ".join(text.split())
    assert "bench-6m: 20 GFLOP/s on the causal FLOPs the roofline counts (40 on the products" \
        in " ".join(text.split())
    assert "would reach bench-6m: 0.80 of the roofline" in " ".join(text.split())
    assert "Each round's own fraction (its Score call over its roofline): bench-6m: 0.70, 0.50" \
        in " ".join(text.split())
    doc = tmp_path / "speed.md"
    doc.write_text(f"# speed\n\n{S.START}\nold\n{S.END}\n\ntail\n")
    update_doc(doc, text, S.START, S.END)
    body = doc.read_text()
    assert body.startswith("# speed\n\n") and body.endswith("\n\ntail\n")
    assert "old" not in body and body.count(S.START) == 1
