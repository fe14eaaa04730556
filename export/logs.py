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
    # onnxruntime's quantizer logs INFO lines per tensor through the root logger itself
    # (logging.info), so no logger level reaches it: filter its records
    logging.getLogger().addFilter(quiet_quantizer)
