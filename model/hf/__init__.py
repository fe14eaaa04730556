"""One small mapper module per Hugging Face family behind the driver in ``hf_import``.

Each family module has ``PREFIX`` (the tensor-name prefix it strips), ``SUPPORTED`` (rows of
the table ``kvserve import-hf --help`` prints), ``KEYS`` (per model_type: the config.json keys
it reads or knows to be inert), ``config(hf, support, extra) -> ModelConfig`` and
``state(source, cfg) -> kvserve state dict``.
"""
from __future__ import annotations

from . import gemma, gpt2, llama, phi3, qwen

FAMILIES = {"gpt2": gpt2, "llama": llama, "qwen": qwen, "gemma": gemma, "phi3": phi3}
