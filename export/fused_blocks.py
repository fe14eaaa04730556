"""The fused graph's blocks, one builder each: the norms (plain and with the residual add
fused in), linear layers, the embedding (token, scale, positions), one attention
(``GroupQueryAttention``), one transformer layer (pre- or post-norm, sandwich norms), the
head (final norm, the rows asked for, the logits). ``fused.build_fused`` calls them in order;
the feed-forward variants and the small subgraphs are ``fused_ops``."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from kvserve.artifact.spec import (POSITION_TABLE, QUERY_SEQLENS, ROPE_COS, ROPE_SIN, SEQLENS_K,
                                   TOTAL_SEQUENCE_LENGTH, FusedSpec)
from kvserve.model.config import ModelConfig

from .fused_ops import MS, Builder, ffn, positions, qk_norm, rope_cache, sinusoidal_table, softcap


class FusedBlocks:
    """Adds the nodes and initializers of each block to ``b``; a block takes the name of its
    input tensor and returns the name of its output."""

    def __init__(self, b: Builder, cfg: ModelConfig, weights: dict[str, np.ndarray],
                 spec: FusedSpec):
        self.b, self.cfg, self.W, self.spec = b, cfg, weights, spec
        self.rms = cfg.norm == "rmsnorm"
        self.pre = cfg.norm_placement == "pre"
        self.rope: list[str] = []  # the cos/sin initializers, when RoPE
        self._paired: list[str] = []  # the counters of a paired graph (``paired_counters``)
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else \
            1.0 / float(np.sqrt(cfg.head_dim))

    # --- linear layers and norms ----------------------------------------------------------
    def linear(self, x: str, prefix: str) -> str:
        b, W = self.b, self.W
        y = b.one("MatMul", [x, b.init(prefix + ".weight.T", W[prefix + ".weight"].T)])
        if prefix + ".bias" in W:
            y = b.one("Add", [y, b.init(prefix + ".bias", W[prefix + ".bias"])])
        return y

    def norm_params(self, prefix: str) -> list[str]:
        # Gemma's (offset + w) RMSNorm: the offset is folded into the gain (float32, as torch)
        w = self.W[prefix + ".weight"]
        if self.rms:
            w = w + np.float32(self.cfg.norm_offset)
        p = [self.b.init(prefix + ".weight", w)]
        if not self.rms:
            p.append(self.b.init(prefix + ".bias", self.W[prefix + ".bias"]))
        return p

    def norm(self, x: str, prefix: str) -> str:
        op = "RMSNormalization" if self.rms else "LayerNormalization"
        return self.b.one(op, [x, *self.norm_params(prefix)], axis=-1,
                          epsilon=self.cfg.norm_eps, stash_type=1)

    def skip_norm(self, delta: str, residual: str, prefix: str) -> tuple[str, str]:
        """norm(delta + residual), and the sum itself."""
        op = "SkipSimplifiedLayerNormalization" if self.rms else "SkipLayerNormalization"
        out = self.b.op(op, [delta, residual, *self.norm_params(prefix)], n_out=4, domain=MS,
                        epsilon=self.cfg.norm_eps)
        return out[0], out[3]

    # --- embedding --------------------------------------------------------------------------
    def embedding(self) -> str:
        """Token embeddings (B, S, C), Gemma's scale, learned / sinusoidal positions added;
        RoPE's cos/sin tables kept for the attention blocks."""
        b, cfg = self.b, self.cfg
        x = b.one("Gather", [b.init("tok_emb.weight", self.W["tok_emb.weight"]), "input_ids"])
        if cfg.embed_scale is not None:  # Gemma: embeddings times sqrt(d_model)
            x = b.one("Mul", [x, b.init("embed_scale", np.array(cfg.embed_scale, np.float32))])
        if cfg.positions in ("learned", "sinusoidal"):
            table = self.W["pos_emb.weight"] if cfg.positions == "learned" else \
                sinusoidal_table(cfg.max_seq_len, cfg.d_model)
            x = b.one("Add", [x, b.one("Gather", [b.init(POSITION_TABLE, table),
                                                  positions(b)])])  # (B, S, C)
        if cfg.positions == "rope":
            # (a paired graph's extra row sits one position past the call's last)
            cos, sin = rope_cache(cfg.max_seq_len + int(self.spec.paired), cfg.head_dim,
                                  cfg.rope_base, cfg.rope_scaling)
            self.rope = [b.init(ROPE_COS, cos), b.init(ROPE_SIN, sin)]
        return x

    # --- attention ----------------------------------------------------------------------------
    def attention(self, i: int, h: str) -> str:
        """Layer ``i``'s attention on the normed stream ``h``: packed q/k/v, optional q/k norm,
        one GroupQueryAttention (cache in place, rotary inside), the output projection."""
        b, cfg, spec, p = self.b, self.cfg, self.spec, f"layers.{i}"
        qkv = self.linear(h, p + ".attn.qkv")  # (B, S, (H + 2 Hkv) D)
        if cfg.qk_norm:
            qkv = qk_norm(b, cfg, qkv, *self.norm_params(p + ".attn.q_norm"),
                          *self.norm_params(p + ".attn.k_norm"))
        layer_rope = self.rope if cfg.layer_rope(i) else []
        window = cfg.layer_window(i)
        seqlens, qlens, attn = SEQLENS_K, QUERY_SEQLENS, f"{p}/attn"
        if spec.paired:  # one more query row per row (a right-padded row's first padding
            # position; the longest rows' last one copied), counted (the runtime counts it in
            # total_sequence_length: a host input, not computed on the device)
            qkv = b.one("Pad", [qkv, b.i64("pair.pads", [0, 0, 0, 0, 1, 0])], mode="edge")
            (seqlens, qlens), attn = self.paired_counters(), f"{p}/attn_paired"
        gqa_in = [qkv, "", "", spec.past(i, "key"), spec.past(i, "value"), seqlens,
                  TOTAL_SEQUENCE_LENGTH, *(layer_rope or ["", ""]), "", "", "", "", "", "", "",
                  qlens]
        outs = [attn, spec.present(i, "key"), spec.present(i, "value")]
        if spec.attention:
            outs.append(spec.attn(i))
        b.nodes.append(helper.make_node(
            "GroupQueryAttention", gqa_in, outs, name=f"{p}/gqa", domain=MS,
            num_heads=cfg.n_heads, kv_num_heads=cfg.n_kv_heads, scale=float(self.scale),
            do_rotary=int(bool(layer_rope)), rotary_interleaved=0,
            # the op keeps the last local_window_size keys, the query's own included: our
            # (and Hugging Face's) sliding_window exactly (W - 1 fails the parity gate)
            local_window_size=-1 if window is None else window,
            softcap=float(cfg.attn_softcap or 0.0),
            **({"qk_output": 2} if spec.attention else {})))
        if spec.paired:  # the extra row's output dropped
            b.nodes.append(helper.make_node(
                "Slice", [attn, b.i64("pair.first", [0]), b.i64("pair.last", [-1]),
                          b.i64("const.axis1", [1])], [f"{p}/attn"], name=f"{p}/unpair"))
        a = self.linear(f"{p}/attn", p + ".attn.out")  # (B, S, C)
        if cfg.sandwich_norm:  # Gemma 2: a norm on the branch output, before the residual add
            a = self.norm(a, p + ".norm1_post")
        return a

    def paired_counters(self) -> list[str]:
        """``seqlens_k`` and ``query_seqlens`` counting the paired graph's extra query row
        (built once, shared by every layer)."""
        if not self._paired:
            one = self.b.init("pair.one_i32", np.array(1, np.int32), keep_dtype=True)
            self._paired = [self.b.one("Add", [name, one], name=f"pair.{name}")
                            for name in (SEQLENS_K, QUERY_SEQLENS)]
        return self._paired

    # --- one layer ------------------------------------------------------------------------------
    def layer(self, i: int, residual: str, delta: str | None) -> tuple[str, str | None]:
        """Layer ``i`` on the stream. Pre-norm: the stream is ``residual`` + ``delta`` (the
        last branch output, not yet added: its add is fused into the next norm); post-norm:
        ``residual`` alone, and ``delta`` stays None."""
        p = f"layers.{i}"
        if self.pre:
            h, residual = (self.norm(residual, p + ".norm1"), residual) if delta is None else \
                self.skip_norm(delta, residual, p + ".norm1")
        else:
            h = residual
        a = self.attention(i, h)
        if self.pre:
            h, residual = self.skip_norm(a, residual, p + ".norm2")
        else:
            residual, _ = self.skip_norm(a, residual, p + ".norm1")
            h = residual
        f = ffn(self.b, self.cfg, h, p + ".ffn", self.linear)
        if self.cfg.sandwich_norm:
            f = self.norm(f, p + ".norm2_post")
        if self.pre:
            return residual, f
        residual, _ = self.skip_norm(f, residual, p + ".norm2")
        return residual, None

    # --- head -------------------------------------------------------------------------------------
    def head(self, residual: str, delta: str | None, dtype) -> str:
        """Final norm, the rows asked for (``logits_rows``), the LM head, float32 logits,
        Gemma 2's final soft-capping; the graph output ``logits``."""
        b, cfg, spec = self.b, self.cfg, self.spec
        if self.pre:
            if cfg.final_norm:
                x, _ = self.skip_norm(delta, residual, "norm_f")
            else:
                x = b.one("Add", [delta, residual])
        else:
            x = self.norm(residual, "norm_f") if cfg.final_norm else residual
        if spec.logits_rows:  # only the rows asked for go through the head (a prefill: its last)
            rows = b.one("Unsqueeze", [spec.logits_rows, b.i64("const.axis_last", [-1])])
            x = b.one("GatherND", [x, rows], batch_dims=1)  # (B, R, C)
        lm_head = self.W.get("lm_head.weight", self.W["tok_emb.weight"])
        logits = b.one("MatMul", [x, b.init("lm_head.weight.T", lm_head.T)])  # (B, R, V)
        if dtype != np.float32:
            logits = b.one("Cast", [logits], to=TensorProto.FLOAT)
        if cfg.final_softcap is not None:
            logits = softcap(b, logits, cfg.final_softcap, "final_softcap")
        b.nodes.append(helper.make_node("Identity", [logits], ["logits"], name="logits"))
        return "logits"
