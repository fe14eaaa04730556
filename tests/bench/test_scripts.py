"""Smoke tests of the measuring scripts (``kvserve bench --profile``'s
``bench/loop_profile.py`` and ``bench/decode_cost.py``): each runs end to end on a tiny exported
model with very few steps, through the real runners, engine and onnxruntime. Nothing here checks
a speed; the figures must exist, be positive and fit together."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

TEXTS = [f"line {i}: def f(x):\n    return x * {i}\n" for i in range(60)]


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    """A random-init 2-layer model (head_dim 16: the fused graph's minimum) with its
    tokenizer."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxscript")
    from kvserve.export.logs import quiet_torch_exporter
    from kvserve.model.checkpoint import save_checkpoint
    from kvserve.model.config import ModelConfig
    from kvserve.model.tokenizer import train_bpe
    from kvserve.model.transformer import Transformer

    quiet_torch_exporter()
    tok = train_bpe(TEXTS, vocab_size=300, min_frequency=1)
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=64, n_layers=2, n_heads=4,
                      n_kv_heads=2, max_seq_len=512, eos_token_id=tok.eos_id,
                      pad_token_id=tok.pad_id)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    root = tmp_path_factory.mktemp("bench_scripts")
    return save_checkpoint(root / "ckpt", model, tokenizer_json=tok.to_str())


@pytest.fixture(scope="module")
def tiny_artifact(tiny_ckpt) -> Path:
    """The fused artifact, with the attention-diagnostics graph."""
    from kvserve.export.pipeline import export_artifacts

    return Path(export_artifacts(tiny_ckpt, tiny_ckpt.parent / "artifact", attention=True,
                                 progress=False, threads=1))


def test_profile_end_to_end(tiny_artifact, tmp_path):
    from kvserve.bench.loop_profile import profile_to

    out = tmp_path / "results"
    out.mkdir()
    (out / "profile-findings.md").write_text("hand-written conclusions\n")
    data = profile_to(str(tiny_artifact), out, threads=1, steps=6, batches=(1, 2))
    saved = json.loads((out / "profile.json").read_text())
    assert saved["model"] == str(tiny_artifact) and saved["threads"] == 1
    for split in saved["loop"]:
        assert split["runner"] == "FusedLM" and split["steps"] == 6
        p = split["phases_us"]
        assert all(v > 0 for k, v in p.items() if k != "decode outside onnxruntime")
        assert p["inside onnxruntime"] <= p["decode call"]
        assert split["share"]["decode call"] + split["share"]["argmax"] == pytest.approx(1.0)
        assert 0 < split["outside_ort_share"] < 1
    assert [e["batch"] for e in saved["engine"]] == [1, 2]
    for e in saved["engine"]:
        assert e["engine_steps"] >= 5 and e["decode_us_per_step"] > 0
        assert e["overhead_us_per_step"] > 0 and e["ort_us_per_step"] > 0
        assert e["top"] and all(r["calls"] > 0 for r in e["top"])
        # the profiler saw the engine thread's iterations (installed via iteration_hook)
        assert any("engine.py" in r["function"] for r in e["top"])
    for a in saved["alloc"]:
        assert a["steps"] >= 5 and a["transient_peak_bytes_median"] > 0
    assert data["loop"] == saved["loop"]
    md = (out / "profile.md").read_text()
    assert "## 1. Raw loop (FusedLM.decode + argmax" in md
    assert "## 3. Allocations per engine iteration" in md
    assert md.rstrip().endswith("hand-written conclusions")
    assert "OnnxLM" not in md and "KVBuffers" not in md


def test_score_profile_end_to_end(tiny_artifact):
    """bench/score_profile.py's measurement on the tiny model, one round: the bench's Score
    cell through the real engine, a profiled session and the roofline's subprocess."""
    from kvserve.bench import score_profile as S

    out = S.measure(tiny_artifact, rounds=1, threads=1)
    b, (r,) = out["best"], out["rounds"]
    scored = S.SEQUENCES * S.TOKENS
    assert b["tok_s"] > 0 and b["roofline_gflops"] > 0 and b["fraction"] > 0
    assert b["fraction"] == pytest.approx(b["tok_s"] * out["flops_per_token"]
                                          / (b["roofline_gflops"] * 1e9))
    assert sum(b["split"].values()) == pytest.approx(1.0)
    assert 0 < b["split"]["inside_ort"] < 1 and b["split"]["log_softmax"] > 0
    assert "MatMul" in b["op_shares"] and set(S.ATTENTION_OPS) & set(b["op_shares"])
    assert sum(b["op_shares"].values()) == pytest.approx(1.0)
    # every scored token went through every MatMul weight once (the lm_head included)
    assert r["profile"]["matmul_flops"] == 2 * out["model"]["matmul_params"] * scored
    # the peak was measured at the Score calls' own shapes too (2 sequences of 256 a call)
    V = out["model"]["vocab_size"]
    assert f"512x64x{V}" in r["peak_by_shape"] and f"2048x64x{V}" in r["peak_by_shape"]
    assert b["explained"]["product"] == pytest.approx(b["fraction"])
    a = b["attention"]  # (kvserve's kernel computes the causal products only; onnxruntime's
    assert a["causal_gflops"] > 0 and a["op"] in S.ATTENTION_OPS  # every query x every key)
    assert (a["computed_gflops"] == pytest.approx(a["causal_gflops"])) == (a["op"] == "KVAttention")
    text = S.render({"meta": {"date": "d", "machine": "m", "threads": 1, "rounds": 1,
                              "load_before": 0.0, "load_after": 0.0}, "sizes": {"tiny": out}})
    assert f"| tiny | {b['tok_s']:,.0f} | " in text


def test_decode_cost_end_to_end(tiny_artifact, tmp_path):
    from kvserve.bench import decode_cost

    out = tmp_path / "dc"
    rc = decode_cost.main(["--artifact", str(tiny_artifact), "--batch", "2", "1",
                           "--positions", "40", "4", "--steps", "5", "--warmup", "1",
                           "--block", "2", "--threads", "1", "--profile",
                           "--profile-steps", "3", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "decode_cost.json").read_text())
    assert res["runtime"] == "fused" and res["batches"] == [1, 2]
    assert res["positions"] == [4, 40]
    cells = {(c["graph"], c["batch"], c["position"]): c for c in res["cells"]}
    assert set(cells) == {(g, b, p) for g in ("plain", "attention") for b in (1, 2)
                          for p in (4, 40)}
    for (g, b, p), c in cells.items():
        assert c["steps"] == 5 and c["attention_columns"] == p + 1  # fused: own rows only
        assert 0 < c["min_ms"] <= c["median_ms"] and c["median_ort_ms"] > 0
        assert c["median_ort_ms"] <= c["median_ms"]
    for b in (1, 2):
        r = res["ratios"][f"batch {b}"]
        for key in ("plain: step(40) / step(4)", "attention: step(40) / step(4)",
                    "attention asked / not asked @ 4", "attention asked / not asked @ 40"):
            assert r[key] > 0
    t1, t2 = res["target"]["batch 1"], res["target"]["batch 2"]
    assert t1["ratio_max"] == 1.15 and isinstance(t1["met"], bool) and not t1["applies"]
    assert t1["ratio"] == res["ratios"]["batch 1"]["plain: step(40) / step(4)"]
    assert t2["ratio_max"] is None and t2["met"] is None
    assert res["arithmetic"]["mac_ratio"] > 1
    prof = res["profile_ms_per_step_by_op"]
    assert set(prof) == {"b1@4", "b1@40", "b2@4", "b2@40"}
    for ops in prof.values():
        # (the plain graph's attention on the native kernel where it is built)
        assert {"GroupQueryAttention", "KVAttention"} & set(ops)
        assert all(v >= 0 for v in ops.values())
    md = (out / "decode_cost.md").read_text()
    assert "| attention graph (attention asked) | 2 | 40 | 41 |" in md


def test_decode_cost_output_paths(tmp_path):
    from kvserve.bench.decode_cost import output_paths

    assert output_paths(str(tmp_path / "x.json")) == (tmp_path / "x.json", tmp_path / "x.md")
    assert output_paths(str(tmp_path)) == (tmp_path / "decode_cost.json",
                                           tmp_path / "decode_cost.md")


def test_rewound_steps_repeat_the_same_position(tiny_artifact):
    """What makes decode_cost's samples comparable: every slot of a filled cache holds the
    same sequence, and a step rewound with ``cache.used -= 1`` is the same step again."""
    from kvserve.artifact.loader import load_lm
    from kvserve.bench.decode_cost import filled_cache, rewind

    lm = load_lm(tiny_artifact, provider="cpu", threads=1, attention=False)
    prompt = np.random.default_rng(0).integers(2, lm.cfg.vocab_size, 31)
    cache = filled_cache(lm, 3, 30, prompt)
    assert list(cache.used[:3]) == [30, 30, 30]
    tokens = np.full(3, int(prompt[30]), np.int64)
    first = lm.decode(cache, 3, tokens)[0].copy()
    np.testing.assert_allclose(first[1:], first[:1].repeat(2, 0), rtol=1e-5, atol=1e-5)
    rewind(cache, 3)
    assert list(cache.used[:3]) == [30, 30, 30]
    again = lm.decode(cache, 3, tokens)[0]
    np.testing.assert_allclose(again, first, rtol=1e-5, atol=1e-5)
    # the same as the sequence prefilled in one go
    ref = lm.new_cache(1)
    whole = lm.prefill(ref, 0, [[int(t) for t in prompt]]).logits[0][-1]
    np.testing.assert_allclose(first[0], whole, rtol=1e-4, atol=1e-4)


def test_rewind_clears_the_portable_mask_row():
    """The portable cache (``KVBuffers``) marks each filled row in its attention mask too: a
    rewind that only lowered ``used`` would leave the stale row attended next to the new one
    (measured: logits off by ~1e-2 on the tiny model), so ``rewind`` clears it."""
    from kvserve.artifact.portable import KVBuffers
    from kvserve.bench.decode_cost import rewind
    from kvserve.model.config import ModelConfig

    cfg = ModelConfig(vocab_size=300, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                      max_seq_len=512)
    kv = KVBuffers(cfg, 3)
    rows = [np.ones((3, cfg.n_kv_heads, 1, cfg.head_dim), np.float32)
            for _ in range(2 * cfg.n_layers)]
    for _ in range(5):
        kv.append(3, rows)
    before = (kv.used.copy(), kv.mask.copy())
    kv.append(2, rows)  # a decode step of slots 0 and 1
    rewind(kv, 2)
    np.testing.assert_array_equal(kv.used, before[0])
    np.testing.assert_array_equal(kv.mask, before[1])


def test_grpc_floor_measures_a_bare_grpcio_server(tmp_path):
    from kvserve.bench.grpc_floor import main

    out = tmp_path / "floor.json"
    assert main(["--mb", "0.5", "--calls", "2", "--out", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert saved["request_bytes"] == 500_000 and len(saved["settings"]) == 2
    for s in saved["settings"].values():
        assert len(s["peak_bytes"]) == 2 and s["max_x"] >= s["median_x"]
        assert s["max_x"] == pytest.approx(max(s["peak_bytes"]) / 500_000, abs=0.01)


def test_runners_take_turns(tiny_artifact, tiny_ckpt, tmp_path):
    """``bench/turns.py`` end to end: real runner processes (the engine, the raw loop, the gRPC
    server with its client) alive side by side, taking turns at every cell for two rounds;
    one runner that cannot load is reported without losing the others."""
    from kvserve.bench.turns import run_turns
    from kvserve.model.config import ModelConfig

    vocab = ModelConfig.from_dict(json.loads((tiny_artifact / "config.json").read_text())
                                  ).vocab_size
    spec = dict(prompt_len=8, decode=[[1, 6], [2, 6]], batches=[1, 2], ttft=[8], itl=6,
                steps=[4, 20], step_count=3, step_batches=[2], sample_tokens=True)
    plan = {"engine": {**spec, "score": [2, 12]}, "loop": dict(spec),
            "grpc": {"prompt_len": 8, "decode": [[1, 6], [2, 6]]},
            "nonesuch": dict(spec), "hf": {**spec, "repeats": 1}}
    paths = dict(artifact=str(tiny_artifact), ckpt=str(tiny_ckpt), hf=str(tmp_path / "no-hf"),
                 genai=None, int8_artifact=None, vocab=vocab, threads=1,
                 workdir=str(tmp_path))
    out = run_turns(plan, paths, rounds=2, workdir=tmp_path, settle=0.0)  # (no timing here)
    assert "unknown runner 'nonesuch'" in out["nonesuch"]["error"]
    assert out["hf"].get("error")  # no HF directory: it fails to load, the rest go on
    for r in ("engine", "loop", "grpc"):
        assert not out[r].get("error"), out[r].get("error")
        for cell in ("1x6", "2x6"):
            c = out[r]["decode"][cell]
            assert len(c["turns_tok_s"]) == 2 and abs(c["tok_s"] - max(c["turns_tok_s"])) < 0.1
        assert out[r]["rss_peak_mb"] > 0
    assert out["engine"]["sample_tokens"] == out["loop"]["sample_tokens"]
    assert len(out["engine"]["sample_tokens"]) == 16
    for r in ("engine", "loop"):
        assert out[r]["ttft_ms"]["8"] > 0 and out[r]["itl_ms"]["n"] == 5
    assert set(out["loop"]["step_ms"]) == {"4", "20"} == set(out["loop"]["step_ms_batch2"])
    turns = out["loop"]["step_ms_turns"]  # each turn: every position, interleaved
    assert len(turns) == 2 and all(set(t) == {"4", "20"} and min(t.values()) > 0 for t in turns)
    assert out["loop"]["step_ms"]["20"] == min(t["20"] for t in turns)
    assert "step_ms" not in out["engine"]  # the engine has no step of its own
    assert out["engine"]["score"]["tok_s"] > 0 and "score" not in out["loop"]
    g = out["grpc"]["grpc"]
    assert g["concurrent_streams"] == 2 and g["single_tok_s"] > 0 and g["concurrent_tok_s"] > 0
    assert g["server_rss_peak_mb"] > 0


def test_bench_runs_as_a_script_and_shadows_no_standard_module():
    """``python bench/decode_cost.py`` puts bench/ first on sys.path: no module there may
    take a standard library module's name (bench/profile.py once shadowed ``profile``)."""
    bench = Path(__file__).resolve().parents[2] / "bench"
    assert not {p.stem for p in bench.glob("*.py")} & set(sys.stdlib_module_names)
    r = subprocess.run([sys.executable, str(bench / "decode_cost.py"), "--help"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("usage: decode_cost.py"), r.stderr


def test_quant_blocks_measures_each_block_size(tiny_ckpt, tmp_path):
    """``bench/quant_blocks.py``'s pieces on the tiny model: each artifact's fidelity from its
    manifest, every artifact timed in the same rounds, one table row a block size."""
    from kvserve.bench import quant_blocks
    from kvserve.export.pipeline import export_artifacts

    arts = {b: Path(export_artifacts(tiny_ckpt, tmp_path / f"b{b}", precision="int4",
                                     attention=False, progress=False, threads=1,
                                     int4_block=b)) for b in (32, 64)}
    fid = [quant_blocks.fidelity(a) for a in arts.values()]
    assert [(f["block_size"], f["bits_per_weight"]) for f in fid] == [(32, 5.0), (64, 4.5)]
    assert fid[1]["data_mb"] < fid[0]["data_mb"]
    assert all(0 <= f["token_agreement"] <= 1 and f["max_abs_logit"] > 0 for f in fid)
    sp = quant_blocks.speed(arts, [1, 2], rounds=2, threads=1)
    assert set(sp) == {"1", "2"} and sp["1"]["32"]["vs_first"] == 1.0
    assert all(len(c["rounds"]) == 2 and c["tok_s"] > 0 for B in sp.values() for c in B.values())
    md = quant_blocks.render({"size": "tiny", "cpu": "cpu", "threads": 1, "onnxruntime": "x",
                              "date": "today", "rounds": 2, "artifacts": fid, "speed": sp})
    rows = [line for line in md.splitlines() if line.startswith("| 32 |") or
            line.startswith("| 64 |")]
    assert len(rows) == 2 and "| 4.5 |" in rows[1] and f"({sp['1']['64']['vs_first']:.2f}×)" \
        in rows[1]
    assert md.startswith("## int4 block size") and "(× block 32)" in md
    # the results file holds one entry a size; a file of one size's results reads as such
    one = tmp_path / "one.json"
    one.write_text(json.dumps({"size": "tiny", "artifacts": fid}))
    assert list(quant_blocks.load(one)["sizes"]) == ["tiny"]
    assert quant_blocks.load(tmp_path / "none.json") == {"sizes": {}}


def test_quant_blocks_sets_int8s_default_beside_its_blocks(tiny_ckpt, tmp_path):
    """int8: block 0 is kvserve's default per-row int8 (no quantization entry in its
    manifest), the first row of the table and what the others are compared with."""
    from kvserve.bench import quant_blocks
    from kvserve.export.pipeline import export_artifacts

    arts = {b: Path(export_artifacts(tiny_ckpt, tmp_path / f"b{b}", precision="int8",
                                     attention=False, progress=False, threads=1,
                                     int8_block=b or None)) for b in (0, 64)}
    fid = [quant_blocks.fidelity(a) for a in arts.values()]
    assert [(f["block_size"], f["bits_per_weight"]) for f in fid] == [(0, 8), (64, 8.5)]
    moved = [quant_blocks.batch_movement(a, threads=1, steps=2) for a in arts.values()]
    assert moved[0] == 0.0 and np.isfinite(moved[1])  # per-row int8: by construction
    fid = [{**f, "batch_movement": m} for f, m in zip(fid, moved)]
    sp = quant_blocks.speed(arts, [1], rounds=1, threads=1)
    assert sp["1"]["0"]["vs_first"] == 1.0 and sp["1"]["64"]["tok_s"] > 0
    res = {"size": "tiny", "precision": "int8", "cpu": "cpu", "threads": 1,
           "onnxruntime": "x", "date": "today", "rounds": 1, "artifacts": fid, "speed": sp}
    md = quant_blocks.render_all({"sizes": {"tiny": res}})
    assert md.startswith("## int8 block size") and "(× rows (default))" in md
    assert "| rows (default) | 8 |" in md and "| 64 | 8.5 |" in md and "q8_0" in md
    assert "| 0 |" in md.split("| rows (default) |")[1].splitlines()[0]  # its batch movement


def test_burst_admission_measures_both_cells(tiny_artifact):
    """bench/burst_admission.py on the tiny artifact: both ways of both cells timed every
    round."""
    from kvserve.bench.burst_admission import NEW_WAYS, WAYS, measure, measure_new, render

    cached = measure(tiny_artifact, requests=3, rounds=2, threads=1, system_tokens=64)
    new = measure_new(tiny_artifact, requests=3, rounds=2, threads=1)
    for res, ways in ((cached, WAYS), (new, NEW_WAYS)):
        assert set(res["ways"]) == set(ways) and res["last_ttft_ratio"] > 0
        for w in ways:
            r = res["ways"][w]
            assert len(r["rounds_last_ttft_ms"]) == 2 and 0 < r["mean_ttft_ms"] <= \
                r["last_ttft_ms"] + 1e-9
    md = render({"requests": 3, "rounds": 2, "threads": 1, "cpu": "x", "onnxruntime": "y",
                 "date": "z", "sizes": {"tiny": {"cached": cached, "new": new}}})
    assert md.count("| tiny |") == 2


def test_prefix_tokens_measures_both_ways(tiny_artifact, monkeypatch):
    """bench/prefix_tokens.py on the tiny artifact (smaller chats and prefix): both cells timed
    both ways every round; to the token, every burst request restores the whole 100-token
    prefix and the chats more of their histories than in whole blocks."""
    import kvserve.bench.prefix_tokens as P

    for name, value in (("CHATS", 2), ("TURNS", 3), ("FIRST", 40), ("SYSTEM", 100),
                        ("BURST", 3)):
        monkeypatch.setattr(P, name, value)
    res = P.measure(tiny_artifact, rounds=2, threads=1)
    for cell in ("chats", "burst"):
        ways = res[cell]["ways"]
        assert res[cell]["ratio"] > 0 and all(len(ways[w]["rounds_ms"]) == 2 for w in P.WAYS)
        token, whole = (ways[w]["cached_tokens"] for w in P.WAYS)
        assert token > whole, cell
    assert res["burst"]["ways"][P.WAYS[0]]["cached_tokens"] == 3 * 100
    md = P.render({"rounds": 2, "threads": 1, "cpu": "x", "onnxruntime": "y", "date": "z",
                   "sizes": {"tiny": res}})
    assert md.count("| tiny |") == 2


def test_score_shared_measures_both_ways(tiny_artifact, monkeypatch):
    """bench/score_shared.py on the tiny artifact (fewer questions, shorter contexts): every
    cell timed both ways every round, the same logprobs both ways (1e-4)."""
    import kvserve.bench.score_shared as S

    for name, value in (("QUESTIONS", 2), ("CONTEXT", 40), ("HEADER", 30), ("LONG", 80)):
        monkeypatch.setattr(S, name, value)
    res = S.measure(tiny_artifact, rounds=2, threads=1)
    for cell in S.CELLS:
        c = res[cell]
        assert c["ratio"] > 0 and all(len(c["ways"][w]["rounds_ms"]) == 2 for w in S.WAYS)
        assert c["max_logprob_diff"] <= 1e-4, cell
    md = S.render({"rounds": 2, "threads": 1, "cpu": "x", "onnxruntime": "y", "date": "z",
                   "sizes": {"tiny": res}})
    assert md.count("| tiny |") == len(S.CELLS)


def test_score_keep_measures_every_way(tiny_artifact, monkeypatch):
    """bench/score_keep.py on the tiny artifact (fewer requests, a short header): every cell
    timed every way every round; the few-shot cell takes the header from the cache where
    rows are kept (always, adaptive), never where none are; one-off requests take nothing."""
    import kvserve.bench.score_keep as S

    for name, value in (("REQUESTS", 6), ("WARM", 4), ("HEADER", 40)):
        monkeypatch.setattr(S, name, value)
    monkeypatch.setattr(S, "CELLS", {"one-off": (S._one_off, 20), "few-shot": (S._few_shot, 0)})
    res = S.measure(tiny_artifact, rounds=2, threads=1)
    for cell in S.CELLS:
        assert all(len(res[cell][w]["rounds_ms"]) == 2 for w in S.WAYS), cell
    assert all(res["one-off"][w]["cached_tokens"] == 0 for w in S.WAYS)
    few = res["few-shot"]
    assert few["always"]["cached_tokens"] > 0  # (the header: all but the timed phase's first)
    assert few["adaptive"]["cached_tokens"] == few["always"]["cached_tokens"]
    assert few["never"]["cached_tokens"] == 0
    md = S.render({"rounds": 2, "threads": 1, "cpu": "x", "onnxruntime": "y", "date": "z",
                   "sizes": {"tiny": res}})
    assert md.count("| tiny |") == 2 * len(S.WAYS)


@pytest.mark.parametrize("script, name", [("prefix_tokens", "prefix-tokens"),
                                          ("score_shared", "score-shared"),
                                          ("score_keep", "score-keep"),
                                          ("burst_admission", "burst-admission"),
                                          ("shape_rounding", "shape-rounding"),
                                          ("attention_cost", "attention-cost"),
                                          ("long_prompt", "long-prompt"),
                                          ("cuda_report", "cuda")])
def test_committed_tables_are_their_json_rendered(script, name):
    """A bench script's committed .md is its rendering of the committed .json."""
    import importlib

    from kvserve.bench.common import committed_results

    render = importlib.import_module(f"kvserve.bench.{script}").render
    res = committed_results("a test") / f"{name}.json"
    assert res.with_suffix(".md").read_text() == render(json.loads(res.read_text()))


def test_lookup_peers_committed_table_is_its_json_rendered():
    """bench/results/lookup-peers.md is bench/lookup_peers.py's rendering of its .json (the
    figures docs/speed.md quotes come from the file, not from hand edits)."""
    from kvserve.bench.common import committed_results
    from kvserve.bench.lookup_peers import render

    res = committed_results("a test") / "lookup-peers.json"
    assert res.with_suffix(".md").read_text() == render(json.loads(res.read_text()))


def test_paired_attention_committed_table_is_its_json_rendered():
    """bench/results/paired-attention.md is bench/paired_attention.py's rendering of its .json
    (docs/speed.md quotes it)."""
    from kvserve.bench.common import committed_results
    from kvserve.bench.paired_attention import render

    res = committed_results("a test") / "paired-attention.json"
    assert res.with_suffix(".md").read_text() == render(json.loads(res.read_text()))


def test_paired_attention_measures_steps_and_the_server(tiny_artifact):
    """bench/paired_attention.py's two measurements on the tiny artifact (standing in for both
    graphs): the probe's figures, a step ratio per batch and context, the three runners with
    their tokens compared."""
    from kvserve.bench import paired_attention as pa

    res = pa.steps(tiny_artifact, tiny_artifact, threads=1, rounds=2, contexts=(16, 32))
    assert set(res["rows_differ"]) == {"paired", "unpaired"}
    assert set(res["steps"]) == {f"{b}/{c}" for b in pa.BATCHES for c in (16, 32)}
    assert all(s["ratio"] > 0 for s in res["steps"].values())
    res["server"] = pa.server(tiny_artifact, tiny_artifact, threads=1, rounds=2, new=8)
    for B in map(str, pa.BATCHES):
        cell = res["server"][B]["runners"]
        assert set(cell) == {pa.OFF, pa.PAIRED, pa.UNPAIRED}
        assert all(r["same_tokens"] == 1.0 for r in cell.values())  # (one artifact: exact)
    md = pa.render({"rounds": 2, "new_tokens": 8, "threads": 1, "cpu": "x",
                    "onnxruntime": "y", "date": "z", "cells": {"tiny": res}})
    # the first step row, 3 runners and 2 ratios per batch
    assert md.count("| tiny |") == 1 + 5 * len(pa.BATCHES)


def test_shape_rounding_measures_on_the_tiny_artifact(tiny_artifact):
    """bench/shape_rounding.py's three measurements on the tiny fp32 artifact: every way of
    computing a row within the export's 1e-4, the first differing node found in the graph (or
    none), a two-token step timed at batch 1 and 8, and the table rendered from them."""
    from kvserve.artifact.loader import load_lm
    from kvserve.bench.shape_rounding import agreement, first_difference, render, two_token_cost

    lm = load_lm(str(tiny_artifact), provider="cpu", threads=1, attention=False)
    agree = agreement(lm, trials=1)
    assert len(agree) == 5 and all(0 <= v <= 1e-4 for v in agree.values())
    first = first_difference(tiny_artifact / "model.onnx", lm.cfg.vocab_size)
    assert first["difference"] >= 0 and (first["op"] is None) == (first["difference"] == 0)
    cost = two_token_cost(lm, rounds=2)
    assert set(cost) == {"1", "8"} and all(c["ratio"] > 0 for c in cost.values())
    md = render({"size": "tiny", "rounds": 2, "cpu": "x", "onnxruntime": "y", "date": "d",
                 "first_difference": first,
                 "artifacts": {"fp32": {"agreement": agree, "two_token_cost": cost}}})
    assert "| fp32 |" in md


@pytest.mark.parametrize("paired", [False, True])
def test_attention_cost_times_the_graph_with_and_without_attention(tiny_ckpt, tmp_path, paired):
    """bench/attention_cost.py on a tiny artifact (paired too: its attention takes a padded
    query): the graph without attention has no GroupQueryAttention and no present outputs,
    runs, and gives logits of the same shape; both graphs timed every round at each
    position, the cache read counted for every layer's K and V up to the position."""
    import onnx
    import onnxruntime as ort

    from kvserve.bench import attention_cost as ac
    from kvserve.export.pipeline import export_artifacts
    from kvserve.model.config import ModelConfig

    art = Path(export_artifacts(tiny_ckpt, tmp_path / "a", attention=False, progress=False,
                                threads=1, paired=paired))
    cfg = ModelConfig.load(art / "config.json")
    bare = ac.without_attention(onnx.load(str(art / "model.onnx")), cfg.head_dim)
    assert not [n for n in bare.graph.node if n.op_type == "GroupQueryAttention"]
    assert [o.name for o in bare.graph.output] == ["logits"]
    sess = ort.InferenceSession(bare.SerializeToString(), providers=["CPUExecutionProvider"])
    step = ac.Step(sess, cfg, capacity=16, spare=int(paired))
    step.at(5)
    step.run()
    assert step.binding.copy_outputs_to_cpu()[0].shape == (1, 1, cfg.vocab_size)
    res = ac.measure(art, positions=[4, 12], rounds=2, threads=1)
    for p, c in res["positions"].items():
        assert all(len(r) == 2 for r in c["rounds"].values())
        assert c["step_ms"] > 0 and c["without_attention_ms"] > 0 and c["floor_ms"] > 0
        assert c["cache_mb"] * 2**20 == 2 * cfg.n_kv_heads * cfg.head_dim * 4 * \
            cfg.n_layers * (int(p) + 1)
    from kvserve.artifact import native_build

    native = native_build.library()[0] is not None
    if native:  # (the third graph: the same on kvserve's kernel)
        assert res["kernel"].startswith("kvserve native attention")
        assert all(c["native_step_ms"] > 0 and c["step_speedup"] > 0
                   and c["swiglu_speedup"] > 0 for c in res["positions"].values())
        res["prefill"] = ac.measure_prefill(art, 1, 1, calls=((0, 20), (10, 5)))
        assert set(res["prefill"]) == {"0+20", "10+5"}
        assert all(c["native_ms"] > 0 and c["ratio"] > 0 for c in res["prefill"].values())
    md = ac.render({"size": "tiny", "rounds": 2, "threads": 1, "cpu": "x", "onnxruntime": "y",
                    "date": "z", "prefill_rounds": 1, "precisions": {"fp32": res}})
    assert md.count("| fp32 |") == 2 + 2 * native
    assert ("kvserve's attention ms" in md) == native
    assert ("kvserve's SwiGLU too" in md) == native


def test_long_prompt_measures_both_ways(tiny_artifact, monkeypatch):
    """bench/long_prompt.py on the tiny artifact (a 150-token prompt in chunks of 32): both
    ways every round, the streams stepping while the prompt is fed a chunk an iteration, and
    its rows' first token the same both ways."""
    import time

    import kvserve.bench.long_prompt as L
    from kvserve.artifact.fused import FusedLM
    from kvserve.server.scheduler import Scheduler

    monkeypatch.setattr(L, "PROMPT_TOKENS", 150)
    monkeypatch.setattr(L, "ASKED", (16,))
    monkeypatch.setattr(Scheduler, "prefill_tokens",
                        lambda self: self.prefill_chunk_tokens or 32)
    for name in ("decode", "verify"):  # (steps of a few ms: the streams outlast the prompt)
        step = getattr(FusedLM, name)
        monkeypatch.setattr(FusedLM, name, lambda *a, _step=step, **k: time.sleep(0.003) or
                            _step(*a, **k))
    res = L.measure(tiny_artifact, rounds=2, threads=1)
    assert [s["chunk_tokens"] for s in res["settings"].values()] == [32, 16]
    for s in res["settings"].values():
        for w in L.WAYS:
            rounds = s["ways"][w]["rounds"]
            assert len(rounds) == 2 and all(r["ttft_ms"] > 0 and r["longest_gap_ms"] > 0
                                            for r in rounds)
        assert s["ways"][L.WAYS[0]]["stream_tokens"] >= 4  # (a step between two chunks)
    md = L.render({"rounds": 2, "threads": 1, "cpu": "x", "onnxruntime": "y", "date": "z",
                   "sizes": {"tiny": res}})
    assert md.count("| tiny |") == 6


def test_results_options_choose_where_results_go(tmp_path):
    """The bench scripts' shared --out / --update-committed / --render-only: the cache's by
    default, --out's, the committed ones when asked (a bare --render-only re-renders those),
    and --out with --update-committed refused."""
    import argparse

    from kvserve.bench.common import RESULTS, add_results_options, results_path

    ap = argparse.ArgumentParser()
    add_results_options(ap, "x.json")

    def where(*argv):
        return results_path(ap, ap.parse_args(["--cache", str(tmp_path), *argv]), "x.json")

    assert where() == tmp_path / "x.json"
    assert where("--out", str(tmp_path / "o.json")) == tmp_path / "o.json"
    assert where("--render-only", "--out", str(tmp_path / "o.json")) == tmp_path / "o.json"
    assert where("--update-committed") == where("--render-only") == RESULTS / "x.json"
    with pytest.raises(SystemExit):
        where("--update-committed", "--out", str(tmp_path / "o.json"))
