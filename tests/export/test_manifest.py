"""The manifest: every file hashed, graph I/O names and symbolic shapes, the runtime entry the
runner reads, opset, versions, parity and perplexity figures (fused and portable artifacts)."""
from __future__ import annotations

import hashlib
import json
import platform

import onnx
import onnxruntime
import pytest
import torch
from export_matrix import LOGIT_TOL

import kvserve
from kvserve.artifact.spec import ALL_SPECS, OPSET, FusedSpec
from kvserve.model.config import ModelConfig

ELEM = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.INT64: "int64",
        onnx.TensorProto.INT32: "int32"}
FUSED_SPECS = (FusedSpec(), FusedSpec(attention=True))


@pytest.fixture(scope="module", params=["fused", "portable"])
def kind(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def art(kind, store, main_artifact):
    return main_artifact if kind == "fused" else store.artifact("llama", portable=True)


@pytest.fixture(scope="module")
def manifest(art) -> dict:
    return json.loads((art / "manifest.json").read_text())


def test_every_file_hashed(art, manifest, kind):
    main_artifact = art
    on_disk = sorted(p.relative_to(main_artifact).as_posix() for p in main_artifact.rglob("*")
                     if p.is_file() and p.name != "manifest.json")
    assert sorted(manifest["files"]) == on_disk
    assert {"config.json", "tokenizer.json"} <= set(on_disk)
    if kind == "fused":  # the diagnostics graph shares the main graph's weights file
        assert {"model.onnx", "model.onnx.data", "model_attn.onnx"} <= set(on_disk)
        assert "model_attn.onnx.data" not in on_disk
    for spec in ALL_SPECS if kind == "portable" else ():
        assert {spec.filename, spec.filename + ".data"} <= set(on_disk)
    for rel, entry in manifest["files"].items():
        data = (main_artifact / rel).read_bytes()
        assert entry["sha256"] == hashlib.sha256(data).hexdigest(), rel
        assert entry["bytes"] == len(data), rel


def test_versions_opset_and_model(art, main_ckpt, manifest, kind):
    main_artifact = art
    # the lowest version that runs it: 2 for a fused graph that takes logits_rows
    assert manifest["format_version"] == {"fused": 2, "portable": 1}[kind]
    assert manifest["producer"] == {"kvserve": kvserve.__version__, "torch": torch.__version__,
                                    "onnx": onnx.__version__,
                                    "onnxruntime": onnxruntime.__version__,
                                    "python": platform.python_version()}
    assert manifest["opset"] == OPSET == 23  # RMSNormalization is an opset-23 op
    assert manifest["precision"] == "fp32" and manifest["kind"] == kind
    cfg = ModelConfig.load(main_artifact / "config.json")
    rt = manifest["runtime"]
    assert rt["kind"] == kind and rt["kv"] == {
        "layout": "shared_buffer" if kind == "fused" else "new_rows", "dtype": "float32",
        "num_layers": cfg.n_layers, "num_kv_heads": cfg.n_kv_heads, "head_size": cfg.head_dim}
    assert rt["past_present_share_buffer"] is (kind == "fused")
    assert rt["names"]["past_key"] == "past_key_values.%d.key"
    assert rt["graphs"] == ({"main": "model.onnx", "attention": "model_attn.onnx"}
                            if kind == "fused" else
                            {s.name: s.filename for s in ALL_SPECS})
    assert manifest["model"] == {"n_layers": cfg.n_layers, "n_heads": cfg.n_heads,
                                 "n_kv_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
                                 "vocab_size": cfg.vocab_size, "max_seq_len": cfg.max_seq_len,
                                 "eos_token_id": cfg.eos_token_id,
                                 "pad_token_id": cfg.pad_token_id}
    assert manifest["source"]["weights_sha256"] == hashlib.sha256(
        (main_ckpt / "model.safetensors").read_bytes()).hexdigest()
    assert (main_artifact / "config.json").read_bytes() == (main_ckpt / "config.json").read_bytes()


def test_parity_and_perplexity_figures(manifest):
    p = manifest["parity"]["fp32"]
    assert set(p) == {"max_abs_logit_prefill", "max_abs_logit_decode", "decode_steps", "batch",
                      "greedy_tokens_equal", "token_agreement", "max_abs_attention",
                      "tolerance", "max_rel_attention", "attention_rtol"}
    assert max(p["max_abs_logit_prefill"], p["max_abs_logit_decode"]) <= LOGIT_TOL
    assert p["max_abs_attention"] <= 1e-5 and p["greedy_tokens_equal"]
    assert p["max_rel_attention"] <= p["attention_rtol"] == 5e-4
    ppl = manifest["perplexity"]  # the checkpoint has a tokenizer: figures on a stdlib text
    assert ppl["fp32"] > 1.0 and ppl["eval_tokens"] >= 16


def test_graph_io_names_and_shapes(art, manifest, kind):
    cfg = ModelConfig.load(art / "config.json")
    specs = FUSED_SPECS if kind == "fused" else ALL_SPECS
    assert set(manifest["graphs"]) == {s.name for s in specs}
    for spec in specs:
        g = manifest["graphs"][spec.name]
        assert g["file"] == spec.filename
        assert g["inputs"] == spec.input_names(cfg) and g["outputs"] == spec.output_names(cfg)
        assert set(g["io"]) == set(g["inputs"]) | set(g["outputs"])
        seq = "sequence_length"  # decode takes 1 token per step or a chunk
        io = g["io"]
        assert io["input_ids"]["shape"] == ["batch_size", seq]
        rows = "logits_rows" if kind == "fused" else seq  # fused: the positions asked for
        assert io["logits"]["shape"] == ["batch_size", rows, cfg.vocab_size]
        if kind == "fused":
            assert manifest["runtime"]["logits_rows"] == "logits_rows"
            assert io["logits_rows"] == {"dtype": "int64", "shape": ["batch_size", rows]}
            assert io["seqlens_k"] == io["query_seqlens"] == {"dtype": "int32",
                                                              "shape": ["batch_size"]}
            assert io["total_sequence_length"] == {"dtype": "int32", "shape": []}
            buf = ["batch_size", cfg.n_kv_heads, "max_cache_length", cfg.head_dim]
            assert all(io[n]["shape"] == buf for n in io if n.startswith(("past_", "present.")))
            with_attention = spec.attention
        else:
            assert io["attention_mask"]["shape"] == ["batch_size", "total_sequence_length"]
            kv = ["batch_size", cfg.n_kv_heads, seq, cfg.head_dim]
            assert all(io[n]["shape"] == kv for n in g["outputs"] if n.startswith("present."))
            if spec.with_past:
                past = ["batch_size", cfg.n_kv_heads, "past_sequence_length", cfg.head_dim]
                assert all(io[n]["shape"] == past for n in g["inputs"] if n.startswith("past_"))
            with_attention = spec.with_attention
        if with_attention:
            assert io["attn_weights.0"]["shape"] == ["batch_size", cfg.n_heads, seq,
                                                     "total_sequence_length"]

        # the graph itself: same names and dtypes, the manifest's numbers are its fixed dims,
        # the manifest's symbols are dynamic dims
        model = onnx.load(str(art / spec.filename), load_external_data=False)
        assert {o.domain: o.version for o in model.opset_import}.get("", None) == OPSET
        values = list(model.graph.input) + list(model.graph.output)
        assert [v.name for v in values] == [*g["inputs"], *g["outputs"]]
        for v in values:
            want = io[v.name]
            assert ELEM[v.type.tensor_type.elem_type] == want["dtype"], v.name
            dims = v.type.tensor_type.shape.dim
            assert len(dims) == len(want["shape"]), v.name
            for d, w in zip(dims, want["shape"]):
                if isinstance(w, int):
                    assert d.HasField("dim_value") and d.dim_value == w, (v.name, w)
                else:
                    assert d.HasField("dim_param") and d.dim_param, (v.name, w)
