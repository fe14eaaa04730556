"""The bench harness's logic on tiny inputs (no timing, no models): targets and their grid,
tables, the generated block of docs/benchmarks.md, the plan, and the roofline's byte count."""
from __future__ import annotations

import json

import numpy as np
import pytest

from kvserve.bench import report
from kvserve.bench.main import plan, render_all


def _size(engine, genai, loop=None, *, grpc=None, score=None, hf_score=None, extra=None):
    def dec(v):
        return {c: {"tok_s": v * (int(c.split("x")[0]) ** 0.5)} for c in
                ("1x128", "1x512", "8x128", "8x512", "16x128")}
    runners = {"engine": {"decode": dec(engine), "sample_tokens": [1, 2, 3], "rss_peak_mb": 100,
                          "ttft_ms": {"32": 2.0, "512": 50.0},
                          "itl_ms": {"p50": 1.0, "p99": 2.0}},
               "genai": {"decode": dec(genai), "sample_tokens": [1, 2, 3],
                         "step_ms": {"16": 0.3, "256": 0.4, "1000": 0.6}},
               "loop": {"decode": dec(loop or engine), "sample_tokens": [1, 2, 3],
                        "step_ms": {"16": 0.5, "256": 0.6, "1000": 0.9}}}
    if grpc:
        runners["grpc"] = {"grpc": {"single_tok_s": grpc[0], "concurrent_tok_s": grpc[1],
                                    "concurrent_streams": 16, "server_rss_peak_mb": 150}}
    if score:
        runners["engine"]["score"] = {"tok_s": score, "sequences": 8, "tokens": 256}
        runners["hf"] = {"score": {"tok_s": hf_score, "sequences": 8, "tokens": 256}}
    out = {"size": "x", "label": "x", "runners": runners,
           "meta": {"load_before": 0.5, "load_after": 0.7, "quick": False, "seed": 1}}
    out.update(extra or {})
    return out


def test_targets_met_and_missed():
    res = {"bench-6m": _size(1300, 1000, grpc=(900, 5000), score=3000, hf_score=500)}
    ts = {t["target"]: t for t in report.targets(res)}
    b1 = ts["bench-6m: engine ≥ 1.0× onnxruntime-genai, batch 1, 128 new tokens"]
    assert b1["status"] == "met" and b1["ratio"] == pytest.approx(1.3)
    stretch = ts["bench-6m: stretch engine ≥ 1.2× onnxruntime-genai, batch 1, 128 new tokens"]
    assert stretch["status"] == "met"
    g = ts["bench-6m: gRPC one stream ≥ 0.9× onnxruntime-genai batch 1 (128 new tokens)"]
    assert g["ratio"] == pytest.approx(900 / 1000) and g["status"] == "met"
    c = ts["bench-6m: gRPC 16 streams ≥ 0.9× onnxruntime-genai batch 16"]
    assert c["ratio"] == pytest.approx(5000 / (1000 * 16 ** 0.5))  # genai's 16x128 cell
    assert c["status"] == "met"
    assert ts["bench-6m: Score ≥ 3× transformers eager (8 × 256)"]["status"] == "met"
    over = ts["bench-6m: engine overhead ≤ 10% over the raw loop (engine ≥ 0.9× loop, batch 1, "
              "128 new tokens)"]
    assert over["ratio"] == pytest.approx(1.0) and over["status"] == "met"


def test_at_most_targets_rss_and_step_ratios():
    size = _size(1000, 1000)
    size["runners"]["engine"]["rss_peak_mb"] = 500
    size["runners"]["genai"]["rss_peak_mb"] = 400
    size["runners"]["loop"]["step_ms_batch16"] = {"16": 2.0, "1000": 2.6}
    ts = {t["target"]: t for t in report.targets({"bench-100m": size})}
    rss = ts["bench-100m: engine peak RSS ≤ 1.1× onnxruntime-genai's"]
    assert rss["ratio"] == pytest.approx(1.25) and rss["status"] == "missed by 14%"
    b1 = ts["bench-100m: decode step at position 1000 ≤ 1.15× position 16, batch 1"]
    assert b1["ratio"] == pytest.approx(1.8) and b1["status"].startswith("missed")
    b16 = ts["bench-100m: decode step at position 1000 ≤ 1.5× position 16, batch 16"]
    assert b16["ratio"] == pytest.approx(1.3) and b16["status"] == "met"
    # with each turn's interleaved figures: the median of the turns' own ratios, not the
    # ratio of two best-of figures from different turns
    size["runners"]["loop"]["step_ms_turns"] = [{"16": 10.0, "1000": 11.0},
                                                {"16": 20.0, "1000": 22.4},
                                                {"16": 9.0, "1000": 10.8}]
    size["runners"]["genai"]["step_ms_turns"] = [{"16": 10.0, "1000": 13.0}]
    ts = {t["target"]: t for t in report.targets({"bench-100m": size})}
    b1 = ts["bench-100m: decode step at position 1000 ≤ 1.15× position 16, batch 1"]
    assert b1["ratio"] == pytest.approx(1.12) and b1["status"] == "met"
    assert "per turn 1.10/1.12/1.20" in b1["detail"] and "genai 1.30×" in b1["detail"]


def test_missed_target_says_by_how_much_and_why():
    res = {"bench-6m": _size(800, 1000, loop=1000)}
    t = report.targets(res)[0]
    assert t["status"] == "missed by 20%"
    assert "engine-side cost" in t["why"] and "raw loop 1.00×" in t["detail"]
    assert "decode graph slower" in t["why"]  # loop step 0.5 ms vs genai 0.3 ms
    assert "~190 nodes" in t["why"]  # results without a runtime kind: the portable graphs


def test_fused_results_do_not_blame_the_portable_graph():
    size = _size(800, 1000, loop=1000)
    size["runners"]["loop"]["runtime"] = "fused"
    t = report.targets({"bench-6m": size})[0]
    assert "engine-side cost" in t["why"] and "raw runner's decode step is slower" in t["why"]
    assert "decode graph slower" not in t["why"]  # the same fused graph as genai's
    assert "capacity" not in t["why"] and "~190 nodes" not in t["why"]
    assert "decode_cost.py --profile" in t["why"]


def test_unmeasured_target_is_not_met():
    size = _size(1000, 1000)
    del size["runners"]["genai"]["decode"]["8x512"]
    ts = {t["target"]: t for t in report.targets({"bench-6m": size})}
    assert ts["bench-6m: engine ≥ 1.0× onnxruntime-genai, batch 8, 512 new tokens"][
        "status"] == "not measured"


def test_int8_target_reads_perplexity():
    size = _size(50, 50, extra={"int8_perplexity": {"fp32": 16000.0, "int8": 16100.0,
                                                    "relative_change": 0.00625},
                                "roofline": {"fp32": {"read_bytes": 400}, "int8": {
                                    "read_bytes": 110}, "bandwidth": {"gbps": 20,
                                                                      "array_mb": 512,
                                                                      "repeats": 5}}})
    size["runners"]["engine_int8"] = {"decode": {"1x128": {"tok_s": 100}}}
    ts = {t["target"]: t for t in report.targets({"bench-100m": size})}
    t = ts["bench-100m: int8 ≥ 2.5× fp32 at batch 1 (128 new tokens)"]
    assert t["ratio"] == pytest.approx(2.0) and "+0.62%" in t["detail"]
    assert "3.64×" in t["why"]


def test_render_and_doc_markers(tmp_path):
    res_dir = tmp_path / "results"
    res_dir.mkdir()
    (res_dir / "bench-6m.json").write_text(json.dumps(
        {**_size(1300, 1000, grpc=(900, 5000)), "size": "bench-6m"}))
    (res_dir / "profile.json").write_text("{}")  # not a results file: ignored
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# title\n\nintro\n")
    text = render_all(res_dir, doc)
    assert "| kvserve engine (in-process, server/engine.py) | 1,300 |" in text
    assert (res_dir / "tables.md").read_text().strip() == text.strip()
    body = doc.read_text()
    assert body.startswith("# title\n\nintro\n")
    assert body.count(report.START) == 1 and body.count(report.END) == 1
    # a second render replaces only what is between the markers
    doc.write_text(body + "\ntrailer\n")
    render_all(res_dir, doc)
    again = doc.read_text()
    assert again.count(report.START) == 1 and again.endswith("\ntrailer\n")
    assert "greedy outputs agree: bench-6m yes" in again
    # prose is wrapped; only table rows may be long
    assert all(len(line) <= report.WIDTH for line in again.splitlines()
               if not line.startswith("|")), max(again.splitlines(), key=len)


def test_plan_shapes():
    full = plan("bench-100m", quick=False, repeats=None)
    assert {"engine", "loop", "genai", "torch", "hf", "grpc", "engine_int8"} <= set(full)
    cells = {tuple(c) for c in full["engine"]["decode"]}
    assert {(1, 128), (1, 512), (8, 128), (8, 512), (16, 128), (16, 512)} <= cells
    assert full["engine"]["ttft"] == [32, 512] and full["loop"]["steps"] == [16, 256, 1000]
    quick = plan("bench-6m", quick=True, repeats=None)
    assert "engine_int8" not in quick
    assert quick["grpc"]["decode"] == [[1, 128], [8, 128]]  # one stream, 8 concurrent ones


def test_decode_weight_bytes_skips_the_embedding(tmp_path):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    from kvserve.bench.roofline import decode_weight_bytes

    emb = numpy_helper.from_array(np.zeros((1000, 64), np.float32), "emb")
    w = numpy_helper.from_array(np.zeros((64, 32), np.float32), "w")
    q = numpy_helper.from_array(np.zeros((64, 32), np.int8), "q")
    nodes = [helper.make_node("Gather", ["emb", "ids"], ["x"]),
             helper.make_node("MatMul", ["x", "w"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64,
                                                                     [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32])],
                          [emb, w, q])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g), str(path))
    got = decode_weight_bytes(path)
    assert got["read_bytes"] == 64 * 32 * 4 + 64 * 32
    assert got["embedding_bytes"] == 1000 * 64 * 4
    assert got["matmul_params"] == 64 * 32  # w (a MatMul's weight); not the table, not q


def test_matmul_peak_runs_onnxruntime():
    pytest.importorskip("onnx")
    from kvserve.bench.roofline import matmul_peak

    got = matmul_peak([(64, 32, 48), (8, 32, 16)], threads=1, repeats=2)
    assert set(got["gflops_by_shape"]) == {"64x32x48", "8x32x16"}
    assert got["gflops"] == max(got["gflops_by_shape"].values()) > 0


def test_score_roofline_and_step_floor_explain_the_targets():
    """The Score target's why names its compute roofline (3x transformers above it here), the
    step-ratio targets their memory floor; the per-size section prints the compute roofline."""
    from kvserve.bench.roofline import score_flops_per_token

    size = _size(1000, 1000, score=150, hf_score=100)
    size["runners"]["loop"]["step_ms_batch16"] = {"16": 20.0, "1000": 40.0}
    size["roofline"] = {"bandwidth": {"gbps": 30.0, "array_mb": 512, "repeats": 7},
                        "fp32": {"read_bytes": 4 * 10**6, "matmul_params": 10**6},
                        "model": {"n_layers": 2, "d_model": 64, "vocab_size": 512,
                                  "kv_bytes_per_token": 2 * 2 * 2 * 32 * 4},
                        "compute": {"gflops": 0.5, "gflops_by_shape": {"2048x64x256": 0.5}}}
    flops = score_flops_per_token(10**6, 2, 64, 256)
    assert flops == 2e6 + 4 * 2 * 64 * 128.5
    ts = {t["target"]: t for t in report.targets({"bench-100m": size})}
    sc = ts["bench-100m: Score ≥ 3× transformers eager (8 × 256)"]
    roof = 0.5e9 / flops  # ~240 tok/s: 3x transformers (300) is above it
    assert f"3× is 300 tok/s, above this machine's compute roofline of {roof:,.0f}" in sc["why"]
    b16 = ts["bench-100m: decode step at position 1000 ≤ 1.5× position 16, batch 16"]
    extra_ms = 16 * 984 * 1024 / 30e9 * 1e3
    assert f"a floor of {(20 + extra_ms) / 20:.2f}×" in b16["why"]
    text = "\n".join(report._size_tables("bench-100m", size))
    assert f"→ roofline {roof:,.0f} tok/s; the engine's Score reaches 150 tok/s" in text


def test_results_go_to_a_fresh_directory_unless_asked(tmp_path):
    """`kvserve bench` never overwrites the committed bench/results or docs/benchmarks.md by
    default."""
    import argparse

    from kvserve.bench.main import RESULTS, add_arguments, choose_results_dir

    p = argparse.ArgumentParser()
    add_arguments(p)

    def where(*argv: str):
        return choose_results_dir(p.parse_args(["--cache", str(tmp_path), *argv]))

    a, q = where(), where("--quick")
    assert a.parent == q.parent == tmp_path / "results" and q.name.endswith("-quick")
    assert where("--results", str(tmp_path / "mine")) == tmp_path / "mine"
    assert where("--update-committed") == RESULTS
    assert where("--render-only") == RESULTS  # reads the committed results; writes nothing
    with pytest.raises(SystemExit, match="--update-committed writes bench/results"):
        where("--update-committed", "--results", str(tmp_path / "mine"))


def test_an_installed_package_writes_nothing_into_itself(tmp_path, monkeypatch):
    """Installed (not a checkout), ``REPO`` is the package in site-packages: the committed
    results are refused with a message; scratch results go under --cache (whose default is
    the working directory's .bench there, bench/common.py)."""
    import argparse

    from kvserve.bench import common, main as bench_main

    monkeypatch.setattr(common, "CHECKOUT", False)
    p = argparse.ArgumentParser()
    bench_main.add_arguments(p)
    for argv in (["--update-committed"], ["--render-only"]):
        with pytest.raises(SystemExit, match="is an installed package: run it from a "
                                             "checkout, or give --results"):
            bench_main.choose_results_dir(p.parse_args(["--cache", str(tmp_path), *argv]))
    got = bench_main.choose_results_dir(p.parse_args(["--cache", str(tmp_path)]))
    assert got.parent == tmp_path / "results"


@pytest.mark.parametrize("module, argv", [
    ("decode_cost", ["--update-committed"]), ("quant_blocks", ["--update-committed"]),
    ("score_profile", ["--update-docs"]), ("score_profile", ["--render-only"]),
    ("constrained_decode", ["--update-docs"]), ("spec_replay", ["--update"]),
])
def test_the_other_bench_scripts_refuse_committed_writes_when_installed(module, argv,
                                                                       monkeypatch):
    """Each refuses before it measures anything (a run's minutes are not lost)."""
    import importlib

    from kvserve.bench import common

    monkeypatch.setattr(common, "CHECKOUT", False)
    main = importlib.import_module(f"kvserve.bench.{module}").main
    with pytest.raises(SystemExit, match="is an installed package"):
        main(argv)


def test_decode_cost_out_and_update_committed_exclude_each_other(capsys):
    from kvserve.bench.decode_cost import main

    with pytest.raises(SystemExit) as e:
        main(["--out", "x.json", "--update-committed"])
    assert e.value.code == 2
    assert "--out and --update-committed exclude each other" in capsys.readouterr().err


def test_repeats_must_be_at_least_one():
    import argparse

    from kvserve.bench.main import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args(["--repeats", "3"]).repeats == 3
    for bad in ("0", "-1"):
        with pytest.raises(SystemExit):
            p.parse_args(["--repeats", bad])


def test_cells_are_shared_by_the_runners_that_measure_them():
    from kvserve.bench.turns import cells_of

    base = dict(decode=[[1, 128], [8, 128]], ttft=[32], itl=128, steps=[16, 1000],
                step_batches=[16], score=[8, 256])
    plan = {"engine": base, "genai": {**base, "score": None},
            "hf": {**base, "decode": [[1, 128]], "steps": [], "itl": 0},
            "grpc": {"decode": [[1, 128], [8, 128]]}}
    has = {"engine": {"steps": False, "stream": True, "score": True},
           "genai": {"steps": True, "stream": True, "score": False},
           "hf": {"steps": False, "stream": False, "score": True},
           "grpc": {"steps": False, "stream": False, "score": False}}
    cells = {c.key: c.who for c in cells_of(plan, has)}
    assert list(cells) == [("decode", 1, 128), ("decode", 8, 128), ("ttft", 32),
                           ("itl", 128), ("step", 1), ("step", 16), ("score", 8, 256)]
    assert cells[("decode", 1, 128)] == ["engine", "genai", "hf", "grpc"]
    assert cells[("decode", 8, 128)] == ["engine", "genai", "grpc"]
    assert cells[("itl", 128)] == ["engine", "genai"]
    assert cells[("step", 16)] == ["genai"]  # the engine has no step of its own
    # one turn measures every position, interleaved
    step = next(c for c in cells_of(plan, has) if c.key == ("step", 16))
    assert step.args["positions"] == [16, 1000] and step.args["batch"] == 16
    assert cells[("score", 8, 256)] == ["engine", "hf"]
    # a runner that failed to load has no cells
    assert all("hf" not in who for who in (c.who for c in cells_of(plan, {
        k: v for k, v in has.items() if k != "hf"})))


def test_turn_spread_is_reported():
    from kvserve.bench.report import _turns

    res = {"bench-6m": {"meta": {"rounds": 2}, "runners": {"engine": {"decode": {
        "1x128": {"turns_tok_s": [100.0, 110.0]}, "8x128": {"turns_tok_s": [200.0, 260.0]},
        "16x128": {"turns_tok_s": [300.0]}}}}}}
    text = _turns(res)
    assert "best of 2 turns" in text and "median 30%" in text and "at most 30%" in text
    assert "same round" in text
    assert _turns({"x": {"meta": {}}}) == ""


def test_ratios_pair_the_turns_of_the_same_round():
    from kvserve.bench.report import paired

    def cell(turns):
        return {"tok_s": max(t for t in turns if t), "turns_tok_s": turns}

    size = {"runners": {
        "engine": {"decode": {"1x128": cell([100.0, 60.0, 110.0])}},
        "genai": {"decode": {"1x128": cell([100.0, 50.0, 130.0]), "8x128": cell([400.0])}},
        "grpc": {"decode": {"8x128": cell([None, 300.0])}},
        "old": {"decode": {"1x128": {"tok_s": 90.0}}}}}
    # rounds: 1.0, 1.2, 0.846 -> median 1.0 (the bests alone would say 110/130 = 0.846)
    assert paired(size, "engine", "genai", "1x128") == pytest.approx(1.0)
    assert paired(size, "grpc", "genai", "8x128") == pytest.approx(300 / 400)  # unpaired
    assert paired(size, "old", "genai", "1x128") == pytest.approx(90 / 130)  # no turns: bests
    from kvserve.bench.report import per_round

    assert per_round(size, "engine", "genai", "1x128") == "; per round 1.00/1.20/0.85"
    assert per_round(size, "old", "genai", "1x128") == ""


def test_a_miss_never_reads_as_its_goal():
    """0.9996 against 1.0 is missed: shown with the digits that say so, never '1.00x, missed by
    0%'; the same for an at-most target just over its limit."""
    from kvserve.bench.targets import shown_ratio

    size = _size(999.6, 1000)
    size["runners"]["loop"]["step_ms"] = {"16": 1.0, "1000": 1.1504}
    ts = {t["target"]: t for t in report.targets({"bench-100m": size})}
    t = ts["bench-100m: engine ≥ 1.0× onnxruntime-genai, batch 1, 128 new tokens"]
    assert t["met"] is False and t["status"] == "missed by 0.04%"
    assert shown_ratio(t) == "0.9996×"
    s = ts["bench-100m: decode step at position 1000 ≤ 1.15× position 16, batch 1"]
    assert s["met"] is False and shown_ratio(s) == "1.1504×" and s["status"] == "missed by 0.03%"
    ok = ts["bench-100m: engine overhead ≤ 10% over the raw loop (engine ≥ 0.9× loop, batch 1, "
            "128 new tokens)"]
    assert ok["met"] and shown_ratio(ok) == "1.00×"


def test_grid_writes_each_reason_once():
    """Targets x sizes, ratio and a mark per cell; a reason shared by several missed cells is
    one footnote, referenced from each."""
    from kvserve.bench.targets import grid

    six = _size(800, 1000, loop=1000)
    hundred = _size(900, 1000, loop=1000)
    ts = report.targets({"bench-6m": six, "bench-100m": hundred})
    lines = grid(ts)
    text = "\n".join(lines)
    assert lines[0] == "| target | bench-6m | bench-100m |"
    row = next(x for x in lines if x.startswith("| engine ≥ 1.0× onnxruntime-genai, batch 1, 128"))
    assert row == "| engine ≥ 1.0× onnxruntime-genai, batch 1, 128 new tokens | 0.80× ✗ ¹˒² | " \
                  "0.90× ✗ ¹˒² |"
    stretch = next(x for x in lines if x.startswith("| stretch engine ≥ 1.2×"))
    assert stretch.endswith(" | – |")  # a bench-6m target only
    notes = [x for x in lines if x[:1].isdigit()]
    assert len(notes) == len(set(notes))
    for t in ts:
        for n in t["notes"]:
            assert text.count(n) == 1, n  # written once, however many cells it explains
    assert "- engine ≥ 1.0× onnxruntime-genai, batch 1, 128 new tokens: 0.80×, missed by 20%; " \
           "800 vs 1,000 tok/s; raw loop 1.00×" in text


def test_committed_block_is_the_rendering_of_the_committed_results():
    """docs/benchmarks.md's generated block and bench/results/tables.md are what
    `kvserve bench --render-only --update-committed` makes of bench/results/*.json."""
    from kvserve.bench.common import BENCH_DOC, RESULTS

    section = report.render(report.load_results(RESULTS))
    text = BENCH_DOC.read_text()
    assert text.count(report.START) == 1 and text.count(report.END) == 1
    block = text.split(report.START, 1)[1].split(report.END, 1)[0]
    assert block.strip() == section.strip(), \
        "docs/benchmarks.md is stale: run kvserve bench --render-only --update-committed"
    assert (RESULTS / "tables.md").read_text().strip() == section.strip()
