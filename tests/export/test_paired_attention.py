"""Paired attention (``FusedSpec.paired``, ``kvserve export --paired-attention``): every
GroupQueryAttention gets one more query row per row, so every row takes the op's multi-token
path. That the graph says so and the runtime keeps its spare row, and that a token's logits
are then bit for bit the same from any call, up to the model's last position."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from kvserve.export.precision import pairing_helps


@pytest.mark.parametrize("precision, block, want", [
    ("fp32", None, True), ("int8", None, True), ("int8", 32, True), ("int8", 64, True),
    ("int8", 128, False), ("int4", 16, True), ("int4", 32, True), ("int4", 64, False),
    ("int4", 256, False)])
def test_pairing_helps_where_the_matmuls_compute_a_row_alike(precision, block, want):
    assert pairing_helps(precision, block) is want


def _short(root, precision: str, paired: bool = True, **extra):
    """A RoPE model of 48 positions (``extra``: more config) exported."""
    torch = pytest.importorskip("torch")
    from export_matrix import BASE, CONFIGS

    from kvserve.export.pipeline import export_artifacts
    from kvserve.model.checkpoint import save_checkpoint
    from kvserve.model.config import ModelConfig
    from kvserve.model.transformer import Transformer

    torch.manual_seed(3)
    cfg = ModelConfig(**{**BASE, **CONFIGS["llama"], "max_seq_len": 48, **extra})
    ckpt = save_checkpoint(root / "ckpt", Transformer(cfg).eval())
    return export_artifacts(ckpt, root / "a", precision=precision, progress=False, threads=1,
                            paired=paired)


@pytest.fixture(scope="module")
def short_int4(tmp_path_factory):
    """int4, paired."""
    return _short(tmp_path_factory.mktemp("paired"), "int4")


@pytest.fixture(scope="module")
def short_windowed(tmp_path_factory):
    """fp32 paired on request, with a sliding window (every layer), score soft-capping and q/k
    norms: the op's other inputs with the extra row."""
    return _short(tmp_path_factory.mktemp("paired_window"), "fp32", sliding_window=12,
                  attn_softcap=20.0, qk_norm=True)


@pytest.fixture(params=["int4", "fp32-windowed"])
def short(request, short_int4, short_windowed):
    return short_int4 if request.param == "int4" else short_windowed


def test_an_onnxruntime_without_query_seqlens_refuses_it(short_int4):
    """Its decode steps are two-row calls with a past, which GroupQueryAttention without
    ``query_seqlens`` (onnxruntime < 1.32) takes only at batch 1: refused, saying so."""
    from kvserve.artifact.fused import FusedLM

    with pytest.raises(RuntimeError, match="query_seqlens input"):
        FusedLM(short_int4, provider="cpu", threads=1, attention=False, padding_counted=True)


def test_the_graph_pads_each_attention_and_the_manifest_says_so(short_int4):
    m = json.loads((short_int4 / "manifest.json").read_text())
    assert m["runtime"]["paired_attention"] is True
    nodes = onnx.load(str(short_int4 / "model.onnx"), load_external_data=False).graph.node
    made = {o: n for n in nodes for o in n.output}
    gqa = [n for n in nodes if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == 2 and all(made[n.input[0]].op_type == "Pad" for n in gqa)
    assert all(made[n.input[5]].name == "pair.seqlens_k" for n in gqa)


def test_rows_alike_up_to_the_last_position(short):
    """Steps to the model's last position (the extra row's K/V and rotary one past it) give
    the logits a prefill of the same tokens gives, bit for bit; a verification ending there
    too; the startup probe agrees. (The export's parity gate held the graph to torch.)"""
    from kvserve.artifact.loader import load_lm
    from kvserve.server.rounding import rows_differ, shape_sensitive

    lm = load_lm(short, provider="cpu", threads=1, attention=False)
    assert lm.spare_rows == 1 and rows_differ(lm) == 0.0 and shape_sensitive(lm) == ""
    g = np.random.default_rng(0)
    ids = g.integers(3, lm.cfg.vocab_size, 48).tolist()
    kv = lm.new_cache(1, 16)
    lm.prefill(kv, 0, [ids[:20]], last=True)
    steps = [lm.decode(kv, 1, [t])[0][0].copy() for t in ids[20:]]
    assert int(kv.used[0]) == 48 and kv.capacity > 48
    whole = lm.prefill(lm.new_cache(1), 0, [ids], last=False).logits[0]
    assert all(np.array_equal(s, w) for s, w in zip(steps, whole[20:]))
    kv = lm.new_cache(1)
    lm.prefill(kv, 0, [ids[:44]], last=True)
    assert np.array_equal(lm.verify(kv, 1, [ids[44:]])[0, :4], whole[44:])


def test_paired_attention_needs_the_fused_graph(tmp_path):
    torch = pytest.importorskip("torch")
    from export_matrix import BASE, CONFIGS

    from kvserve.export.pipeline import export_artifacts
    from kvserve.model.checkpoint import save_checkpoint
    from kvserve.model.config import ModelConfig
    from kvserve.model.transformer import Transformer

    torch.manual_seed(0)
    ckpt = save_checkpoint(tmp_path / "ckpt",
                           Transformer(ModelConfig(**{**BASE, **CONFIGS["llama"]})).eval())
    with pytest.raises(ValueError, match=r"paired attention needs the fused graph.*--portable"):
        export_artifacts(ckpt, tmp_path / "a", portable=True, paired=True, progress=False)
    assert not (tmp_path / "a").exists()


def test_unpaired_unless_asked(main_artifact, store):
    from export_matrix import EXPORTS

    int4 = store.artifact(next(k for k, (p, _) in EXPORTS.items() if p == "int4"))
    for art in (main_artifact, int4):
        m = json.loads((art / "manifest.json").read_text())
        assert "paired_attention" not in m["runtime"]


def test_a_config_claiming_the_extra_rope_row_as_a_position_is_refused(short_int4, tmp_path):
    """The paired graph's RoPE tables hold max_seq_len + 1 rows (the extra query row's): a
    config.json edited to claim that row as a position is refused at load, not inside
    onnxruntime at the last position."""
    import shutil

    from kvserve_testing import rehash

    from kvserve.artifact.verify import VerifyError, verify_artifacts

    art = tmp_path / "a"
    shutil.copytree(short_int4, art)
    cfg = json.loads((art / "config.json").read_text())
    cfg["max_seq_len"] += 1
    (art / "config.json").write_text(json.dumps(cfg))
    rehash(art, "config.json")
    with pytest.raises(VerifyError, match=r"max_seq_len 49 in config\.json, position tables "
                                          r"of 48 rows"):
        verify_artifacts(art)
