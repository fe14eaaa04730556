"""The prefix cache's and speculation's bench cells (bench/speed_cells.py) on the real engine
with the tiny artifact, and their bookkeeping (turns, plan, merge) on tiny inputs. No timing
is asserted: only what the cells count and which tokens they make."""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from kvserve.bench import speed_cells as S
from kvserve.bench.main import plan, speed_plan
from kvserve.bench.merge import merge_speed
from kvserve.bench.turns import cells_of, runner_spec


def test_shared_prefix_pair_shares_exactly_the_prefix():
    a, b = S.shared_prefix_pair(300, 40, 8, serial=0)
    assert a.shape == b.shape == (48,)
    assert np.array_equal(a[:40], b[:40])
    assert np.all(a[40:] != b[40:])  # every tail token differs
    assert a.min() >= 2 and b.min() >= 2 and max(a.max(), b.max()) < 300
    c, _ = S.shared_prefix_pair(300, 40, 8, serial=1)
    assert not np.array_equal(a[:40], c[:40])  # a new serial: a new shared prefix
    again, _ = S.shared_prefix_pair(300, 40, 8, serial=0)
    assert np.array_equal(a, again)


def test_chat_prompt_grows_by_reply_and_user_turn():
    h = np.arange(5)
    nxt = S.next_chat_prompt(h, np.array([7, 8]), np.array([9]))
    assert nxt.tolist() == [0, 1, 2, 3, 4, 7, 8, 9]
    assert S.chat_lengths(4, 256, 32, 32) == [256, 320, 384, 448]


@pytest.fixture(scope="module")
def engines(artifact):
    from kvserve.bench.runner_kvserve import EngineRunner

    off = EngineRunner(str(artifact.dir), 2, max_batch=4)
    on = EngineRunner(str(artifact.dir), 2, max_batch=4, prefix_cache_mb=4,
                      speculative_tokens=4)
    yield off, on
    off.close()
    on.close()


def test_prefix_cell_reuses_the_shared_prefix_only_with_the_cache(engines, artifact):
    off, on = engines
    vocab = artifact.cfg.vocab_size
    got_on = S.prefix(on, vocab, 40, 4, itertools.count(), min_total=0.0)
    got_off = S.prefix(off, vocab, 40, 4, itertools.count(), min_total=0.0)
    # the 40 shared tokens: the second request lands in the slot the first one left, which
    # kept its rows (the pool alone would give 2 whole 16-token blocks, 32)
    assert got_on["cached_tokens"] == 40
    assert got_off["cached_tokens"] == 0
    assert got_on["first_ms"] > 0 and got_on["second_ms"] > 0


def test_chat_cell_sends_the_whole_history(engines, artifact):
    off, on = engines
    vocab = artifact.cfg.vocab_size
    a = S.chat(on, vocab, turns=3, first=40, user=8, reply=8, serial=3)
    b = S.chat(off, vocab, turns=3, first=40, user=8, reply=8, serial=3)
    assert a["prompt_tokens"] == b["prompt_tokens"] == S.chat_lengths(3, 40, 8, 8)
    assert a["cached_tokens"][0] == 0 and all(c > 0 for c in a["cached_tokens"][1:])
    # turn 2's history (40 + 8 reply) is cached up to its last computed row (the reply's last
    # token was never fed): the slot that served turn 1 kept them all, not whole blocks only
    assert a["cached_tokens"][1] == 40 + 8 - 1
    assert b["cached_tokens"] == [0, 0, 0]
    assert len(a["ttft_ms"]) == 3 and a["ttft_ms_sum"] == pytest.approx(sum(a["ttft_ms"]))


def test_spec_cell_makes_the_same_tokens_with_speculation(engines):
    off, on = engines
    # a repeating prompt: n-gram drafts are found and accepted
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12] * 4, [20, 21, 22, 23] * 8]
    for batch in (1, 2):
        a, b = S.spec(on, prompts, batch, 24), S.spec(off, prompts, batch, 24)
        assert a["tokens_sha"] == b["tokens_sha"]
        assert a["tokens"] == b["tokens"] == 48
        assert b["drafted"] == 0 and b["acceptance"] is None
        assert 0 <= a["accepted"] <= a["drafted"]
        # without speculation every row of a batch takes its 24 tokens in the same steps
        assert b["short_batch_share"] == 0.0 and 0.0 <= a["short_batch_share"] <= 1.0
    best = S.best_spec(on, prompts, 2, 24, min_total=0.0)
    assert best["tokens_sha"] == a["tokens_sha"]
    # the decode begins when every row has its first token (the engine's own clock)
    toks, first, total = off.timed(np.asarray(prompts), 8)
    assert toks.shape == (2, 8) and 0 < first <= total


def test_best_turns_keeps_the_best_and_each_round():
    got = [{"round": 0, "second_ms": 5.0, "first_ms": 50.0},
           {"round": 2, "second_ms": 3.0, "first_ms": 60.0}]
    group, name, entry = S.best_turns(("prefix", 1000, 16), got, rounds=3)
    assert (group, name) == ("prefix", "1000+16")
    assert entry["second_ms"] == 3.0 and "round" not in entry
    assert entry["turns_second_ms"] == [5.0, None, 3.0]
    spec = [{"round": 0, "decode_tok_s": 10.0, "tok_s": 8.0, "tokens_sha": "a"},
            {"round": 1, "decode_tok_s": 12.0, "tok_s": 9.0, "tokens_sha": "b"}]
    _, name, entry = S.best_turns(("spec", 8), spec, rounds=3)
    assert name == "8" and entry["decode_tok_s"] == 12.0
    assert entry["turns_tok_s"] == [8.0, 9.0] and entry["tokens_sha"] == "varies"


def test_plan_and_cells_of_the_speed_features():
    p = plan("bench-6m", quick=False, repeats=2)
    assert p["engine_on"]["runner"] == "engine"
    assert p["engine_on"]["prefix_cache_mb"] > 0 and p["engine_on"]["speculative_tokens"] > 0
    assert p["engine"]["decode"] and p["engine"]["prefix"] == [[1000, 16]]
    assert "prefix_cache_mb" not in p["engine"]  # the baseline: both features off
    trained = plan("trained", quick=False, repeats=None)
    assert set(trained) - {"llamacpp"} == {"engine", "engine_on", "genai"}
    assert all(set(v) >= {"spec"} and "prefix" not in v for v in trained.values())
    assert speed_plan("small", False, 3) == {}
    prompts = [[1, 2, 3]] * 20
    has = {r: {"steps": False, "stream": False, "score": False} for r in trained}
    cells = cells_of(trained, has, prompts)
    assert [c.key for c in cells] == [("spec", 1), ("spec", 8)]
    assert cells[0].op == "speculation"  # (a Worker method; its plan is Worker.spec)
    assert len(cells[0].args["prompts"]) == trained["engine"]["spec"]["files"]
    assert sorted(cells[0].who) == sorted(trained)
    assert cells_of(trained, has, None) == []  # no prompts: no spec cell
    spec = runner_spec("engine_on", p["engine_on"], {"artifact": "a", "code_prompts": prompts})
    assert spec["runner"] == "engine" and "code_prompts" not in spec
    assert runner_spec("engine_int4", {}, {"int4_artifact": "q4"})["artifact"] == "q4"


def test_speed_only_results_merge_into_the_size():
    old = {"size": "bench-100m", "meta": {"date": "morning"},
           "runners": {"engine": {"decode": {"1x128": {"tok_s": 30}}, "spec": {"1": "old"}},
                       "hf": {"score": {"tok_s": 5}}}}
    new = {"meta": {"date": "evening"},
           "runners": {"engine": {"prefix": {"1000+16": {"second_ms": 9}}, "load_seconds": 1},
                       "engine_on": {"prefix": {"1000+16": {"second_ms": 1}}}}}
    old["runners"]["engine_on"] = {"prefix": {"1000+16": {"second_ms": 2}}}
    new["runners"]["engine_on"]["prefix_cache_mb"] = 256
    assert merge_speed(dict(old, label="a model"), new)["label"] == "a model"
    old["label"], new["label"] = "step 400 of 800", "finished"  # (the trained size's model)
    out = merge_speed(old, new)
    assert out["label"] == "finished"
    assert out["meta"] == {"date": "morning"} and out["speed_meta"] == {"date": "evening"}
    eng = out["runners"]["engine"]
    assert eng["decode"] == {"1x128": {"tok_s": 30}}  # the earlier cells stay
    assert eng["prefix"] == {"1000+16": {"second_ms": 9}} and "spec" not in eng
    assert out["runners"]["engine_on"]["prefix"]["1000+16"]["second_ms"] == 1
    assert out["runners"]["engine_on"]["prefix_cache_mb"] == 256
    assert out["runners"]["hf"] == {"score": {"tok_s": 5}}
    assert old["runners"]["engine"]["spec"] == {"1": "old"}  # (the input is not changed)


def test_runner_subset_results_merge_into_the_size():
    from kvserve.bench.merge import merge_runners

    old = {"meta": {"date": "morning"},
           "runners": {"grpc": {"decode": {"1x128": 1}, "error": "old"},
                       "genai": {"decode": {"1x128": 2}, "spec": {"1": "kept"}},
                       "hf": {"score": 3}}}
    new = {"meta": {"date": "evening"},
           "runners": {"grpc": {"decode": {"1x128": 10}},
                       "genai": {"decode": {"1x128": 20}, "spec": {"1": "new"}}}}
    out = merge_runners(old, new)
    assert out["runners"]["grpc"] == {"decode": {"1x128": 10}}  # replaced whole
    assert out["runners"]["genai"] == {"decode": {"1x128": 20}, "spec": {"1": "kept"}}
    assert out["runners"]["hf"] == {"score": 3} and out["meta"] == {"date": "morning"}
    assert out["runners_meta"]["grpc"] == {"date": "evening"}
    old["roofline"] = {"bandwidth": "morning"}
    assert merge_runners(old, {**new, "roofline": {"bandwidth": "evening"}})["roofline"] == \
        {"bandwidth": "morning"}  # (no engine in the run: its figures are the earlier ones)
    new["runners"]["engine"] = {"score": {"tok_s": 7}}
    assert merge_runners(old, {**new, "roofline": {"bandwidth": "evening"}})["roofline"] == \
        {"bandwidth": "evening"}  # set against the engine measured with it


def test_held_out_files_are_the_trainers_validation_documents(tmp_path):
    from kvserve.bench.trained import code_prompts, held_out_files
    from kvserve.model import data as D
    from kvserve.model.tokenizer import train_bpe

    files = []
    for i in range(12):
        f = tmp_path / f"m{i:02d}.py"
        f.write_text(f"def f{i}(x):\n    return x * {i} + {i * i}\n" * (3 + i))
        files.append(f)
    held = held_out_files(files, val_fraction=0.3)
    tok = train_bpe([f.read_text() for f in files], vocab_size=300, min_frequency=1)
    data = D.build_tokens(files, tok, tmp_path / "tokens", val_fraction=0.3)
    assert 0 < len(held) == data.meta["n_val_docs"]
    # the validation stream is exactly the held-out documents (each followed by eos)
    want = sum(len(tok.encode(f.read_text())) + 1 for f in held)
    assert data.meta["n_val"] == want
    (tmp_path / "tok.json").write_text(tok.to_str())
    prompts, names = code_prompts(tmp_path / "tok.json", held, n=1, length=8)
    assert len(prompts) == 1 and len(prompts[0]) == 8 and names[0] in {f.name for f in held}
    with pytest.raises(ValueError, match="held-out files"):
        code_prompts(tmp_path / "tok.json", held, n=len(held) + 1, length=8)


def test_hf_copy_of_a_checkpoint_has_the_same_logits(artifact, tmp_path):
    """bench/trained.py's kvserve -> transformers Llama copy (for onnxruntime-genai and
    llama.cpp): logits within 1e-4, and kvserve's own importer maps it back unchanged."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from kvserve.bench.trained import to_hf
    from kvserve.model.checkpoint import load_model
    from kvserve.model.hf_import import import_hf

    ckpt = Path(artifact.dir).parent / "ckpt"
    hf = to_hf(ckpt, tmp_path / "hf", atol=1e-4)
    assert json.loads((hf / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    back = load_model(import_hf(hf, tmp_path / "back"))
    a, b = load_model(ckpt).state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def _speed_size(off_ms, on_ms, chat_off, chat_on, spec_off, spec_on, genai=None):
    def runner(prefix_ms, chat_ttft, spec_b1, acc=None):
        sp = {str(b): {"decode_tok_s": v * b ** 0.5, "tok_s": v, "tokens": 64, "drafted": 100,
                       "accepted": None if acc is None else int(100 * acc),
                       "acceptance": acc, "tokens_sha": "same",
                       "turns_decode_tok_s": [v * b ** 0.5] * 3} for b, v in
              ((1, spec_b1), (8, spec_b1))}
        return {"prefix": {"1000+16": {"first_ms": 100.0, "second_ms": prefix_ms,
                                       "cached_tokens": 992,
                                       "turns_second_ms": [prefix_ms, prefix_ms * 1.1]}},
                "chat": {"8": {"ttft_ms_sum": chat_ttft, "total_ms_sum": chat_ttft * 2,
                               "ttft_ms": [chat_ttft / 8] * 8, "prompt_tokens": [256, 320],
                               "cached_tokens": [0, 0 if acc is None else 272],
                               "turns_ttft_ms_sum": [chat_ttft] * 3}},
                "spec": sp}
    g = genai or (off_ms, chat_off, spec_off)
    return {"runners": {"engine": runner(off_ms, chat_off, spec_off),
                        "engine_on": {**runner(on_ms, chat_on, spec_on, acc=0.5),
                                      "prefix_cache_mb": 256, "speculative_tokens": 4},
                        "genai": runner(*g)},
            "meta": {"code_files": ["os.py", "stat.py"], "code_prompt_tokens": 384}}


def test_speed_targets_met_missed_and_why():
    from kvserve.bench.targets import targets

    size = _speed_size(off_ms=500.0, on_ms=20.0, chat_off=2000.0, chat_on=300.0,
                       spec_off=100.0, spec_on=180.0, genai=(600.0, 1800.0, 160.0))
    ts = {t["target"]: t for t in targets({"trained": size, "bench-100m": size})}
    pre = ts["bench-100m: prefix cache: second request's TTFT ≤ 0.1× uncached (1,000 shared + "
             "16 tokens, batch 1)"]
    assert pre["ratio"] == pytest.approx(0.04) and pre["status"] == "met"
    chat = ts["bench-100m: chat replay (8 turns, whole history each turn): total TTFT ≥ 5× "
              "lower than without the cache"]
    assert chat["ratio"] == pytest.approx(2000 / 300) and chat["met"]
    g = ts["bench-100m: chat replay (8 turns, whole history each turn): total TTFT ≥ 5× lower "
           "than onnxruntime-genai"]
    assert g["ratio"] == pytest.approx(6.0) and g["met"]
    b1 = ts["trained: speculation ≥ 1.5× speculation off, batch 1 (held-out code, decode "
            "tok/s)"]
    assert b1["ratio"] == pytest.approx(1.8) and b1["met"]
    vs_g = ts["trained: speculation ≥ 1.3× onnxruntime-genai, batch 1 (held-out code, decode "
              "tok/s)"]
    assert vs_g["ratio"] == pytest.approx(180 / 160) and vs_g["status"] == "missed by 13%"
    assert "50% of the drafted tokens were accepted" in vs_g["why"]
    b8 = ts["trained: speculation never below speculation off, batch 8 (held-out code, decode "
            "tok/s)"]
    assert b8["met"]
    # random-init sizes: batch 1 is a figure, batch 8 a target; no llama.cpp without results
    assert not any("100m: speculation ≥ 1.5×" in k for k in ts)
    assert "bench-100m: speculation never below speculation off, batch 8 (held-out code, " \
           "decode tok/s)" in ts
    assert not any("llama.cpp" in k for k in ts)


def test_llamacpp_targets_pair_each_precision():
    from kvserve.bench.targets import targets

    def dec(v):
        return {"1x128": {"tok_s": v, "turns_tok_s": [v, v]},
                "8x128": {"tok_s": 4 * v, "turns_tok_s": [4 * v, 4 * v]}}
    size = {"runners": {"engine": {"decode": dec(100)}, "llamacpp": {"decode": dec(80)},
                        "engine_int8": {"decode": dec(200)},
                        "llamacpp_q8": {"decode": dec(250)}}}
    ts = {t["name"]: t for t in targets({"bench-100m+llamacpp": size})}
    assert ts["kvserve fp32 ≥ 1.0× llama.cpp f32, batch 1 (128 new tokens)"]["ratio"] == 1.25
    q8 = ts["kvserve int8 ≥ 1.0× llama.cpp q8_0, batch 8 (128 new tokens)"]
    assert q8["ratio"] == pytest.approx(0.8) and q8["status"] == "missed by 20%"
    assert not any("int4" in n for n in ts)  # no q4_0 results: no int4 target


def test_llamacpp_targets_quote_the_floor_of_kvserves_kernels():
    """Where the matrix products alone (``matmuls``) ran, a missed target says whether they
    were already below llama.cpp's whole step (no change to kvserve can meet it) or not."""
    from kvserve.bench.targets import targets

    def dec(v):
        return {"1x128": {"tok_s": v, "turns_tok_s": [v, v]},
                "8x128": {"tok_s": 4 * v, "turns_tok_s": [4 * v, 4 * v]}}
    size = {"runners": {"engine": {"decode": dec(90)}, "llamacpp": {"decode": dec(100)},
                        "matmuls": {"decode": dec(95)},
                        "engine_int4": {"decode": dec(90)}, "llamacpp_q4": {"decode": dec(100)},
                        "matmuls_int4": {"decode": dec(120)}}}
    ts = {t["name"]: t for t in targets({"bench-100m+llamacpp": size})}
    fp32 = ts["kvserve fp32 ≥ 1.0× llama.cpp f32, batch 1 (128 new tokens)"]
    assert not fp32["met"] and "made 95 tok/s in the same rounds, 0.95×" in fp32["why"]
    assert "no change to kvserve's graph or engine can meet this target" in fp32["why"]
    assert "matrix products alone 95 tok/s (0.95×)" in fp32["detail"]
    int4 = ts["kvserve int4 ≥ 1.0× llama.cpp q4_0, batch 1 (128 new tokens)"]
    assert "1.20× llama.cpp's whole model (kvserve's whole step reached 0.75 of them): the " \
           "rest of kvserve's step" in int4["why"]
    assert "can meet" not in int4["why"]


def test_an_int4_artifacts_block_size_is_in_its_target_and_row():
    """The int4 runner's results carry its artifact's quantization (the worker reads the
    manifest): the llama.cpp target and the table row say which block size ran."""
    from kvserve.bench.report import label
    from kvserve.bench.targets import targets

    q = {"op": "MatMulNBits", "bits": 4, "symmetric": True, "block_size": 64,
         "bits_per_weight": 4.5}
    dec = {"1x128": {"tok_s": 110, "turns_tok_s": [110]},
           "8x128": {"tok_s": 400, "turns_tok_s": [400]}}
    size = {"runners": {"engine_int4": {"decode": dec, "quantization": q},
                        "llamacpp_q4": {"decode": {c: {**v, "turns_tok_s": [100]}
                                                   for c, v in dec.items()}}}}
    ts = {t["name"]: t for t in targets({"bench-100m+llamacpp": size})}
    t = ts["kvserve int4 (blocks of 64: 4.5 bits a weight) ≥ 1.0× llama.cpp q4_0, batch 1 "
           "(128 new tokens)"]
    assert t["met"] and t["ratio"] == pytest.approx(1.1)
    assert label("engine_int4", size["runners"]["engine_int4"]) == \
        "kvserve engine, int4 artifact (blocks of 64: 4.5 bits a weight)"
    assert label("engine_int4", {}) == "kvserve engine, int4 artifact"


def test_floor_runner_runs_the_artifacts_own_products(artifact, tmp_path):
    """``matmuls``: every product with a constant weight of the artifact (fp32, and its int4
    conversion), one input each, the lm_head at one row a sequence; the fp32 products are
    the artifact's own weights (a product's output is x @ W)."""
    onnx = pytest.importorskip("onnx")
    from onnx import numpy_helper

    from kvserve.bench.runner_base import prompts_for
    from kvserve.bench.runner_floor import PRODUCTS, MatmulFloorRunner, floor_graph
    from kvserve.export.precision import convert

    src = Path(artifact.dir) / "model.onnx"
    g = onnx.load(str(src)).graph
    inits = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    products = [n for n in g.node if n.op_type in PRODUCTS and n.input[1] in inits]
    model, feeds = floor_graph(src)
    assert len(feeds) == len(products) == 4 * artifact.cfg.n_layers + 1
    assert [f[5] for f in feeds].count(True) == 1  # the lm_head
    r = MatmulFloorRunner(str(artifact.dir), 2)
    out = r.generate(prompts_for(2, 5, artifact.cfg.vocab_size), 3)
    assert out.shape == (2, 3)
    b = r._binding(2, 1)
    r.sess.run_with_iobinding(b)
    got = b.copy_outputs_to_cpu()[0]  # (2, 1, N): the first product of layer 0
    x = np.random.default_rng(0).standard_normal((2, 1, feeds[0][2])).astype(np.float32)
    np.testing.assert_allclose(got, x @ inits[products[0].input[1]], rtol=1e-4, atol=1e-4)
    q4 = tmp_path / "int4"
    q4.mkdir()
    convert(src, q4 / "model.onnx", "int4")
    _, feeds4 = floor_graph(q4 / "model.onnx")
    assert [f[2:4] for f in feeds4] == [f[2:4] for f in feeds]
    r4 = MatmulFloorRunner(str(q4), 2)
    assert r4.generate(prompts_for(1, 4, artifact.cfg.vocab_size), 2).shape == (1, 2)


def test_speed_tables_render(tmp_path):
    from kvserve.bench.report_speed import prefix_chat_tables, spec_table

    size = _speed_size(500.0, 20.0, 2000.0, 300.0, 100.0, 180.0)
    lines = "\n".join(prefix_chat_tables(size) + spec_table(size))
    assert "| kvserve engine, server defaults (prefix cache 256 MB, speculation K ≤ 4) | " \
           "100.0 | 20.0 | 992 |" in lines
    assert "| kvserve engine, prefix cache and speculation off | 2,000 | 4,000 | 250.0 | 0 |" \
        in lines
    assert "after 384 tokens of each file" in lines and "`os.py`" in lines
    assert "50% (b1), 50% (b8) | yes/yes |" in lines


def test_llamacpp_only_plan_pairs_the_same_cells():
    from kvserve.bench.main import llamacpp_installed, llamacpp_only_plan

    p = llamacpp_only_plan("bench-100m", quick=False, rep=2)
    if not llamacpp_installed():
        assert p == {}
        return
    assert set(p) == {"engine", "engine_int8", "engine_int4", "llamacpp", "llamacpp_q8",
                      "llamacpp_q4", "matmuls", "matmuls_int8", "matmuls_int4"}
    assert all(v["decode"] == [[1, 128], [8, 128]] for v in p.values())
    assert {p[k]["quant"] for k in p if k.startswith("llamacpp")} == {"f32", "q8_0", "q4_0"}
    assert runner_spec("llamacpp_q4", p["llamacpp_q4"], {})["runner"] == "llamacpp"
    assert not any(p[k]["sample_tokens"] for k in p if k.startswith("matmuls"))
    paths = {"artifact": "fp32", "int8_artifact": "int8", "int4_artifact": "int4"}
    for name, art in (("matmuls", "fp32"), ("matmuls_int8", "int8"), ("matmuls_int4", "int4"),
                      ("engine_int4", "int4"), ("engine_on", "fp32")):
        spec = runner_spec(name, p.get(name, {}), paths)
        assert (spec["runner"], spec["artifact"]) == (name.split("_")[0], art)


def test_llamacpp_runner_makes_kvserves_greedy_tokens(artifact, tmp_path, monkeypatch):
    """The tiny model's weights through the sdist's convert_hf_to_gguf.py (f32) and q8_0
    quantization; llama.cpp's greedy tokens equal kvserve's raw loop's at batch 1 and 3, with
    a prefill longer than one llama_decode chunk, and with prompt lookup its plain ones. Needs
    llama-cpp-python and its sdist's converter (KVSERVE_LLAMACPP_SRC, or one fetched into the
    bench cache)."""
    import os

    pytest.importorskip("llama_cpp")
    from kvserve.bench.common import CACHE
    from kvserve.bench.gguf_convert import SRC_ENV, gguf_files
    from kvserve.bench.runner_base import prompts_for
    from kvserve.bench.runner_kvserve import LoopRunner
    from kvserve.bench.runner_llamacpp import N_BATCH, LlamaCppRunner

    assert 3 * 200 > N_BATCH
    from kvserve.bench.trained import to_hf

    if not os.environ.get(SRC_ENV) and not (CACHE / "llamacpp-src").is_dir():
        pytest.skip(f"no llama-cpp-python source distribution ({SRC_ENV})")
    hf = to_hf(Path(artifact.dir).parent / "ckpt", tmp_path / "hf")
    files = gguf_files(hf, tmp_path / "gguf", CACHE, ("f32", "q8_0"))
    assert files["q8_0"].stat().st_size < files["f32"].stat().st_size
    ll = LlamaCppRunner(str(files["f32"]), 2)
    loop = LoopRunner(str(artifact.dir), 2)
    try:
        vocab = artifact.cfg.vocab_size
        for B, P in ((1, 12), (3, 200)):  # 3 × 200 rows: more than one chunk
            prompts = prompts_for(B, P, vocab)
            assert np.array_equal(ll.generate(prompts, 8), loop.generate(prompts, 8))
        toks, first, total = ll.timed(prompts_for(1, 12, vocab), 4)
        assert toks.shape == (1, 4) and 0 < first <= total
        # prompt lookup (bench/lookup_peers.py): prompts that repeat a pattern draft from it;
        # the kept tokens are the plain path's, the rejected rows leave the cache
        lookup = LlamaCppRunner(str(files["f32"]), 2, lookup=10)

        def alone(prompts):  # each sequence's plain tokens in a batch of its own (the plain
            # runner's one cache for 8 sequences rounds a near-tie of this model otherwise:
            # sequence 6 of the forced drafts below, its last token)
            return np.concatenate([ll.generate(p[None], 24) for p in prompts])
        try:
            for B in (1, 2, 8):
                pattern = prompts_for(B, 6, vocab, seed=3)
                prompts = np.concatenate([pattern] * 4, axis=1)
                assert np.array_equal(lookup.generate(prompts, 24), alone(prompts))
            assert lookup.drafted > 0 and 0 <= lookup.accepted <= lookup.drafted
            # drafts that are the plain continuation, one token wrong in some: accepted runs,
            # rejections at different places, sequences finishing at different steps
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            prompts = prompts_for(8, 12, vocab, seed=4)
            plain = alone(prompts)

            def drafts(ids, ngram, k):
                s = next(b for b in range(8) if list(ids[:12]) == prompts[b].tolist())
                g = len(ids) - 12  # generated so far
                d = plain[s, g:g + k].copy()
                if len(d) > 1 and (g + s) % 3:
                    d[(g + s) % len(d)] = (d[(g + s) % len(d)] + 1) % vocab
                return d[:k - s % 3] if k > s % 3 else d[:1]

            monkeypatch.setattr(LlamaPromptLookupDecoding, "find_candidate_pred_tokens",
                                staticmethod(drafts))
            lookup.drafted = lookup.accepted = 0
            assert np.array_equal(lookup.generate(prompts, 24), alone(prompts))
            assert 0 < lookup.accepted < lookup.drafted
        finally:
            lookup.close()
        # bench/lookup_peers.py's cell: every runner timed each round, tokens compared with
        # their own runtime's plain path (kvserve's speedups keep them all: fp32)
        monkeypatch.undo()
        from kvserve.bench.lookup_peers import BATCHES, LOOKUP_RUN, ON, measure, render

        cell = measure(Path(artifact.dir), files["f32"], "fp32", rounds=2, new=8, threads=1)
        assert sorted(cell) == sorted(map(str, BATCHES))
        for res in cell.values():
            assert all(len(r["rounds_tok_s"]) == 2 for r in res["runners"].values())
            assert res["runners"][ON]["same_tokens"] == 1.0 and len(res["ratios"]) == 2
            assert res["runners"][LOOKUP_RUN]["same_tokens"] == 1.0
            assert res["cached_tokens"] == 0  # (new prompts each round)
        md = render({"new_tokens": 8, "rounds": 2, "threads": 1, "cpu": "x", "onnxruntime": "y",
                     "llama_cpp": "z", "date": "d", "cells": {"tiny fp32 / f32": cell}})
        assert md.count("| tiny fp32 / f32 |") == 2 * 4 + 2 * 2  # runners and ratios, b1, b8
    finally:
        ll.close()


def test_speed_cells_of_an_earlier_run_are_marked_and_not_paired():
    """A runner a --speed-only run did not measure (llama.cpp, where it is not installed)
    keeps its cells, marked with the run they come from: its rounds pair with none of this
    run's, so a target takes the ratio of best figures and the table says so."""
    from kvserve.bench.figures import paired_speed, per_round_speed
    from kvserve.bench.report_speed import spec_table

    def spec(turns):
        return {"spec": {"1": {"decode_tok_s": max(turns), "turns_decode_tok_s": turns,
                               "tok_s": max(turns)}}}

    old = {"meta": {"date": "d0"}, "speed_meta": {"date": "d1"},
           "runners": {"engine_on": spec([100, 400]), "llamacpp": spec([50, 300])}}
    new = {"meta": {"date": "d2"}, "runners": {"engine_on": spec([200, 220]),
                                                "engine": spec([100, 110])}}
    out = merge_speed(old, new)
    assert out["runners"]["llamacpp"]["speed_date"] == "d1"
    assert "speed_date" not in out["runners"]["engine_on"]
    assert paired_speed(out, "engine_on", "engine", "spec", "1", "decode_tok_s") == 2.0
    assert per_round_speed(out, "engine_on", "engine", "spec", "1", "decode_tok_s") == \
        "; per round 2.00/2.00"  # (the rounds' ratios, in order)
    assert per_round_speed(out, "engine_on", "llamacpp", "spec", "1", "decode_tok_s") == ""
    # best over best (220 / 300), not the median of 200/50 and 220/300
    assert paired_speed(out, "engine_on", "llamacpp", "spec", "1",
                        "decode_tok_s") == pytest.approx(220 / 300)
    assert "from an earlier run (d1)" in "\n".join(spec_table(out))
    again = merge_speed(out, {"meta": {"date": "d3"}, "runners": {"engine_on": spec([1])}})
    assert again["runners"]["llamacpp"]["speed_date"] == "d1"  # (the run that measured it)
    back = merge_speed(again, {"meta": {"date": "d4"}, "runners": {"llamacpp": spec([7])}})
    assert "speed_date" not in back["runners"]["llamacpp"]


def test_decode_cells_of_two_runs_are_not_paired():
    """After a --runners merge, a runner measured in the new run and one left from the earlier
    run have turns from different rounds: their ratio is best over best."""
    from kvserve.bench.figures import paired
    from kvserve.bench.merge import merge_runners

    def dec(turns):
        return {"decode": {"1x128": {"tok_s": max(turns), "turns_tok_s": turns}}}

    old = {"meta": {"date": "d0"}, "runners": {"engine": dec([100, 300]),
                                                "genai": dec([50, 250])}}
    assert paired(old, "engine", "genai", "1x128") == pytest.approx((2 + 1.2) / 2)
    out = merge_runners(old, {"meta": {"date": "d1"}, "runners": {"engine": dec([90, 120])}})
    assert paired(out, "engine", "genai", "1x128") == pytest.approx(120 / 250)
    both = merge_runners(out, {"meta": {"date": "d2"},
                               "runners": {"engine": dec([10, 20]), "genai": dec([5, 40])}})
    assert paired(both, "engine", "genai", "1x128") == pytest.approx((2 + 0.5) / 2)
