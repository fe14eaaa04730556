"""Quieting the libraries the exporter drives, for the entry points' logging setup (the CLI,
the bench, test fixtures). Torch-free: only logger names."""
from __future__ import annotations

import logging

# the torch exporter logs a warning per optional torchvision op it cannot register
TORCH_EXPORTER_REGISTRATION = "torch.onnx._internal.exporter._registration"


def quiet_torch_exporter() -> None:
    """The torch exporter's per-op registration warnings: users need none of them."""
    logging.getLogger(TORCH_EXPORTER_REGISTRATION).setLevel(logging.ERROR)


def quiet_quantizer(record: logging.LogRecord) -> bool:
    """A root-logger filter: drop onnxruntime.quantization's records below WARNING."""
    path = record.pathname.replace("\\", "/")
    return record.levelno >= logging.WARNING or "/onnxruntime/quantization/" not in path


def quiet_exporter_logs() -> None:
    """Keep the libraries' narration out of the terminal (``kvserve export``)."""
    quiet_torch_exporter()
    # the exporter's graph passes narrate every rewrite at INFO
    for name in ("onnx_ir", "onnxscript"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # onnxruntime's quantizers log INFO lines per tensor: some through the root logger itself
    # (logging.info), which no logger level reaches (so: a filter of their records), some
    # through their module's logger (MatMulNBitsQuantizer: int4, int8 in blocks)
    logging.getLogger().addFilter(quiet_quantizer)
    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)
