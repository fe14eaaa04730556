"""The export tests' configuration matrix and figures (imported by conftest.py and the tests).

See conftest.py for the table of what each config varies.
"""
from __future__ import annotations

from kvserve.model.config import ModelConfig

# The figures, stated here (not imported) so a loosened constant in the code fails.
LOGIT_TOL = 1e-4  # max |Δlogit| torch vs onnxruntime, fp32
ATTN_TOL = 1e-5  # max |Δp| of attention probabilities on the matrix's small shapes
# the gate's attention bound on every shape: |Δp| <= ATTN_RTOL * p + ATTN_ATOL
ATTN_RTOL = 5e-4
ATTN_ATOL = 1e-6
THREADS = 1  # onnxruntime threads in tests: the CI machine has 2 cores, shared

# head_dim 16: onnxruntime's GroupQueryAttention on CPU needs a multiple of 16 (the fused graph)
BASE = dict(vocab_size=300, d_model=64, n_layers=2, n_heads=4, max_seq_len=512, init_std=0.1)

CONFIGS: dict[str, dict] = {
    "llama": dict(positions="rope", norm="rmsnorm", norm_placement="pre", final_norm=True,
                  ffn="swiglu", d_ff=64, n_kv_heads=2, tie_embeddings=True),
    "gpt2": dict(positions="learned", norm="layernorm", norm_placement="pre", final_norm=True,
                 ffn="gelu_tanh", n_kv_heads=4, tie_embeddings=True, qkv_bias=True,
                 out_bias=True, ffn_bias=True),
    "postln": dict(positions="learned", norm="layernorm", norm_placement="post",
                   final_norm=False, ffn="gelu", n_kv_heads=4, tie_embeddings=False,
                   qkv_bias=True, out_bias=True, ffn_bias=True),
    "sinus": dict(positions="sinusoidal", norm="rmsnorm", norm_placement="post", final_norm=True,
                  ffn="gelu_tanh", n_kv_heads=1, tie_embeddings=True, qkv_bias=True,
                  ffn_bias=True),
    "nopos": dict(positions="none", norm="layernorm", norm_placement="pre", final_norm=False,
                  ffn="relu", n_kv_heads=2, tie_embeddings=False, out_bias=True),
}
# how each config is exported: (precision, attention graphs)
EXPORTS: dict[str, tuple[str, bool]] = {
    "llama": ("fp32", True),
    "gpt2": ("fp32", False),
    "postln": ("int8", False),
    "sinus": ("fp16", False),
    "nopos": ("int4", False),
}
MAIN = "llama"

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\n\nprint(os.path.join('a', 'b'))\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i)\n",
] * 8


def make_config(name: str) -> ModelConfig:
    return ModelConfig(**{**BASE, **CONFIGS[name]})


def make_model(name: str):
    import torch

    from kvserve.model.transformer import Transformer

    torch.manual_seed(1234 + sorted(CONFIGS).index(name))
    return Transformer(make_config(name)).eval()
