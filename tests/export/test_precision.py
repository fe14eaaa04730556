"""int8, int4 and fp16 exports of tiny models (fused graphs): the artifact verifies, holds only
the transformed graph, and its manifest carries the parity and perplexity figures (the relative
perplexity change)."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from export_matrix import LOGIT_TOL, THREADS

from kvserve.export.precision import FP16_TOLERANCE
from kvserve.artifact.verify import verify_artifacts
from kvserve.artifact.loader import load_lm

PRECISION_CONFIGS = {"int8": "postln", "fp16": "sinus", "int4": "nopos"}


@pytest.mark.parametrize("precision", ["int8", "fp16", "int4"])
def test_precision_artifact(store, precision):
    art = store.artifact(PRECISION_CONFIGS[precision])
    m = verify_artifacts(art)
    assert m["precision"] == precision
    assert not (art / "_fp32").exists()
    assert sorted(p.name for p in art.iterdir()) == sorted(
        ["config.json", "tokenizer.json", "tokenizer_config.json", "manifest.json", "model.onnx",
         "model.onnx.data"])  # tokenizer_config.json: ChatML, from the kvserve tokenizer
    assert m["kind"] == "fused"

    fp32, q = m["parity"]["fp32"], m["parity"][precision]
    assert max(fp32["max_abs_logit_prefill"], fp32["max_abs_logit_decode"]) <= LOGIT_TOL
    worst = max(q["max_abs_logit_prefill"], q["max_abs_logit_decode"])
    assert np.isfinite(worst) and worst > 0.0 and 0.0 <= q["token_agreement"] <= 1.0
    assert q["decode_steps"] >= 64 and q["batch"] == 3

    ppl = m["perplexity"]
    assert set(ppl) == {"fp32", precision, "relative_change", "eval_tokens", "eval_source"}
    assert ppl["eval_source"] == "text"
    assert ppl["eval_tokens"] >= 16 and ppl["fp32"] > 1.0 and ppl[precision] > 1.0
    assert ppl["relative_change"] == pytest.approx(ppl[precision] / ppl["fp32"] - 1.0)
    assert ppl["relative_change"] <= 0.10  # the default --max-ppl-increase

    ops = {n.op_type for n in onnx.load(str(art / "model.onnx"),
                                        load_external_data=False).graph.node}
    inits = onnx.load(str(art / "model.onnx")).graph.initializer
    types = {t.data_type for t in inits}
    if precision == "int8":
        assert q["tolerance"] is None  # int8 is judged by perplexity, not a logit bound
        # every weight matmul integer, its activations quantized per row in the graph
        assert {"MatMulInteger", "ReduceMax"} <= ops and "MatMul" not in ops
        assert "DynamicQuantizeLinear" not in ops  # (one scale over the whole batch)
        assert onnx.TensorProto.INT8 in types
    elif precision == "int4":
        assert q["tolerance"] is None  # judged by perplexity, as int8
        assert "MatMulNBits" in ops and "MatMul" not in ops  # every weight matmul is 4-bit
        assert onnx.TensorProto.UINT8 in types
    else:
        assert q["tolerance"] == FP16_TOLERANCE and worst <= FP16_TOLERANCE
        assert onnx.TensorProto.FLOAT16 in types
        assert onnx.TensorProto.FLOAT not in {t.data_type for t in inits if len(t.dims) == 2}
    print(f"{precision}: max |Δlogit| {worst:.3g}, agreement {q['token_agreement']:.3f}, "
          f"ppl fp32 {ppl['fp32']:.4g} -> {ppl[precision]:.4g} "
          f"({ppl['relative_change']:+.2%})")


def _nbits_blocks(art) -> set[int]:
    return {onnx.helper.get_attribute_value(a)
            for n in onnx.load(str(art / "model.onnx"), load_external_data=False).graph.node
            if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "block_size"}


def test_int4_blocks_of_64_hold_fewer_bytes_and_say_so(store, tmp_path):
    """--int4-block-size: every 4-bit matmul takes the asked block size; the manifest records it
    with the bits a weight it stores, and the same gates (parity, perplexity) as the default."""
    from kvserve.export.pipeline import export_artifacts

    default = store.artifact(PRECISION_CONFIGS["int4"])
    m32 = verify_artifacts(default)
    assert m32["quantization"] == {"op": "MatMulNBits", "bits": 4, "symmetric": True,
                                   "block_size": 32, "bits_per_weight": 5.0}
    assert _nbits_blocks(default) == {32}

    art = export_artifacts(store.checkpoint(PRECISION_CONFIGS["int4"]), tmp_path / "b64",
                           precision="int4", attention=False, progress=False, threads=THREADS,
                           int4_block=64)
    m = verify_artifacts(art)
    assert m["quantization"]["block_size"] == 64 and m["quantization"]["bits_per_weight"] == 4.5
    assert _nbits_blocks(art) == {64}
    q = m["parity"]["int4"]
    assert np.isfinite(q["max_abs_logit_decode"]) and 0.0 <= q["token_agreement"] <= 1.0
    assert m["perplexity"]["relative_change"] <= 0.10
    # half as many float32 scales: the data file is smaller by 4 bytes per 64 weights
    assert (art / "model.onnx.data").stat().st_size < (default / "model.onnx.data").stat().st_size


def test_int8_in_blocks_is_one_8_bit_op_a_matmul_and_says_so(store, tmp_path):
    """--int8-block-size: every weight matmul is an 8-bit MatMulNBits of the asked block size
    (no per-row quantization ops); the manifest records it, the same gates apply, the runtime
    serves it, and its 8-bit blocks are closer to fp32 than the default's 7-bit columns."""
    from kvserve.export.pipeline import export_artifacts

    rows = verify_artifacts(store.artifact(PRECISION_CONFIGS["int8"]))
    assert "quantization" not in rows  # the default: per-row int8 in standard ops
    art = export_artifacts(store.checkpoint(PRECISION_CONFIGS["int8"]), tmp_path / "b64",
                           precision="int8", attention=False, progress=False, threads=THREADS,
                           int8_block=64)
    m = verify_artifacts(art)
    assert m["precision"] == "int8"
    assert m["quantization"] == {"op": "MatMulNBits", "bits": 8, "symmetric": True,
                                 "block_size": 64, "bits_per_weight": 8.5}
    nodes = onnx.load(str(art / "model.onnx"), load_external_data=False).graph.node
    ops = {n.op_type for n in nodes}
    assert "MatMulNBits" in ops and not ops & {"MatMul", "MatMulInteger", "ReduceMax"}
    assert {onnx.helper.get_attribute_value(a) for n in nodes if n.op_type == "MatMulNBits"
            for a in n.attribute if a.name in ("bits", "block_size")} == {8, 64}
    q, r = m["parity"]["int8"], rows["parity"]["int8"]
    worst = max(q["max_abs_logit_prefill"], q["max_abs_logit_decode"])
    assert np.isfinite(worst) and worst < max(r["max_abs_logit_prefill"],
                                              r["max_abs_logit_decode"])
    assert m["perplexity"]["relative_change"] <= 0.10
    lm = load_lm(art, provider="cpu", threads=THREADS, attention=False)
    kv = lm.new_cache(2)
    lm.prefill(kv, 0, [[3, 4, 5, 6], [7, 8]])
    logits, _ = lm.decode(kv, 2, np.array([7, 9]))
    assert logits.shape == (2, lm.cfg.vocab_size) and np.isfinite(logits).all()


@pytest.mark.parametrize("precision, blocks, match", [
    ("int8", {"int4_block": 64}, "the int4 block size applies to --precision int4 only"),
    ("int4", {"int8_block": 64}, "the int8 block size applies to --precision int8 only"),
    ("fp32", {"int8_block": 64}, "applies to --precision int8 only, not fp32"),
    ("int4", {"int4_block": 48}, r"must be one of 16, 32, 64, 128, 256, got 48"),
    ("int8", {"int8_block": 8}, r"int8 block size must be one of 16, 32, 64, 128, 256, got 8")])
def test_a_block_size_that_cannot_apply_is_refused_before_any_work(
        store, tmp_path, precision, blocks, match):
    from kvserve.export.pipeline import export_artifacts

    with pytest.raises(ValueError, match=match):
        export_artifacts(store.checkpoint(PRECISION_CONFIGS["int4"]), tmp_path / "a",
                         precision=precision, progress=False, **blocks)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("precision", ["int8", "fp16", "int4"])
def test_precision_artifact_runs_in_the_runtime(store, precision):
    """fp16 keeps its KV cache in float16 (the op writes it in place); the others float32."""
    art = store.artifact(PRECISION_CONFIGS[precision])
    m = json.loads((art / "manifest.json").read_text())
    want = "float16" if precision == "fp16" else "float32"
    assert m["runtime"]["kv"]["dtype"] == want
    assert m["graphs"]["model"]["io"]["past_key_values.0.key"]["dtype"] == want
    lm = load_lm(art, provider="cpu", threads=THREADS, attention=False)
    kv = lm.new_cache(1)
    lm.prefill(kv, 0, [[3, 4, 5, 6]])
    logits, _ = lm.decode(kv, 1, np.array([7]))
    assert logits.shape == (1, lm.cfg.vocab_size) and np.isfinite(logits).all()
    assert kv.k[0].numpy().dtype == np.dtype(want)


@pytest.mark.parametrize("precision", ["int8", "fp16"])
def test_serving_fp16_on_the_cpu_provider_warns(store, precision, caplog):
    from kvserve_testing import server_config

    from kvserve.server.app import App

    app = App(store.artifact(PRECISION_CONFIGS[precision]),
              server_config(provider="cpu", attention=False))
    with caplog.at_level("WARNING", logger="kvserve.server.app"):
        app.load()
    warned = [r for r in caplog.records if "made for the CUDA provider" in r.getMessage()]
    assert len(warned) == (precision == "fp16")


def test_int4_on_a_portable_export_says_why_it_is_portable(tmp_path):
    """int4 and int8 in blocks need the fused graph: refused before any export work, naming
    why the export is portable (a head_dim the fused graph cannot take, or --portable)."""
    import torch

    from kvserve.export.pipeline import export_artifacts
    from kvserve.model.checkpoint import save_checkpoint
    from kvserve.model.config import ModelConfig
    from kvserve.model.transformer import Transformer

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, d_model=48, n_layers=1, n_heads=2, n_kv_heads=1,
                      max_seq_len=32)  # head_dim 24
    ckpt = save_checkpoint(tmp_path / "ckpt", Transformer(cfg).eval())
    with pytest.raises(ValueError, match=r"int4 needs the fused graph.*head_dim 24 is not a "
                                         r"multiple of 16"):
        export_artifacts(ckpt, tmp_path / "a", precision="int4", progress=False)
    with pytest.raises(ValueError, match=r"this export is portable \(--portable\)"):
        export_artifacts(ckpt, tmp_path / "b", precision="int4", portable=True, progress=False)
    with pytest.raises(ValueError, match=r"--int8-block-size needs the fused graph.*head_dim 24"):
        export_artifacts(ckpt, tmp_path / "c", precision="int8", int8_block=32, progress=False)
    assert not any((tmp_path / n).exists() for n in "abc")


@pytest.mark.parametrize("precision", ["int8", "fp32"])
def test_a_rows_logits_do_not_depend_on_its_batch(store, main_artifact, precision):
    """The same sequence gives bitwise the same logits alone and next to others, through
    prefill and decode steps: int8 quantizes activations per row (with one scale for the
    whole batch, as quantize_dynamic did, a row moved with its neighbours)."""
    art = store.artifact(PRECISION_CONFIGS["int8"]) if precision == "int8" else main_artifact
    lm = load_lm(art, provider="cpu", threads=1, attention=False)
    V = lm.cfg.vocab_size
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(2, V, n)) for n in (9, 23, 4, 15)]
    alone, batch = lm.new_cache(1), lm.new_cache(4)
    a = lm.prefill(alone, 0, prompts[:1], last=True).logits[0][-1].copy()
    b = lm.prefill(batch, 0, prompts, last=True).logits[0][-1].copy()
    assert np.array_equal(a, b), np.abs(a - b).max()
    for step in range(8):
        t = int(rng.integers(2, V))
        a = lm.decode(alone, 1, [t])[0][0].copy()
        b = lm.decode(batch, 4, [t, *rng.integers(2, V, 3).tolist()])[0][0].copy()
        assert np.array_equal(a, b), (step, np.abs(a - b).max())


@pytest.mark.parametrize("precision, blocks", [("int8", {"int8_block": 64}), ("int4", {})])
def test_a_neighbours_attention_step_leaves_a_row_of_an_nbits_artifact_as_alone(
        store, tmp_path, precision, blocks):
    """A decode step carrying one request's attention runs the whole batch through the
    diagnostics graph. Unpacked (as other artifacts' diagnostics sessions are, to hold no second
    copy), MatMulNBits takes another compute path: the neighbour's logits moved by 0.02. Its
    sessions therefore always take the packed copy: the row moves by the attention op's own
    rounding only (a tolerance of 1e-4 on these tiny models; measured ~1e-6)."""
    from kvserve.export.pipeline import export_artifacts

    art = export_artifacts(store.checkpoint(PRECISION_CONFIGS[precision]), tmp_path / "a",
                           precision=precision, attention=True, progress=False,
                           threads=THREADS, **blocks)
    lm = load_lm(art, provider="cpu", threads=THREADS, attention=True)
    alone, batch = lm.new_cache(1), lm.new_cache(2)
    lm.prefill(alone, 0, [[3, 4, 5, 6, 7, 8]])
    lm.prefill(batch, 0, [[3, 4, 5, 6, 7, 8]])
    lm.prefill(batch, 1, [[9, 10, 11]], attention=True)
    worst = 0.0
    for t in range(5):
        a = lm.decode(alone, 1, [12 + t])[0][0].copy()
        b, _ = lm.decode(batch, 2, [12 + t, 20 + t], attention=True)
        worst = max(worst, float(np.abs(a - b[0]).max()))
    print(f"{precision}: a row beside an attention step moved by {worst:.3g}")
    assert worst <= 1e-4


@pytest.mark.parametrize("K, bits, want", [(128, 8, 8.5), (48, 8, 8 * (64 + 4) / 48),
                                            (128, 4, 4.5), (80, 4, 8 * (2 * 32 + 2 * 4) / 80)])
def test_bits_a_weight_count_the_padding_of_short_columns(tmp_path, K, bits, want):
    """A column shorter than a block of 64, or not a multiple of it, is padded to whole blocks:
    the manifest's bits a weight are what the graph stores (found by a review: a model of
    d 64 in blocks of 256 said 8.125 and held ~4x the weights' bytes)."""
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    from kvserve.export.precision import quantization

    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((K, 32))
                                .astype(np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, K])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32])], [w])
    q = MatMulNBitsQuantizer(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]),
                             bits=bits, block_size=64, is_symmetric=True)
    q.process()
    onnx.save(q.model.model, str(tmp_path / "m.onnx"))
    got = quantization(f"int{bits}", 64, tmp_path / "m.onnx")
    assert got["bits_per_weight"] == pytest.approx(want, abs=1e-4)
