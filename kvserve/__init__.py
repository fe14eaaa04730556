"""kvserve: a causal transformer from PyTorch to a fast, trustworthy gRPC service.

Sub-packages: ``kvserve.model`` (torch; training/import), ``kvserve.export`` (ONNX),
``kvserve.server`` (onnxruntime + gRPC, no torch). The top level stays light: importing
``kvserve`` never imports torch.
"""
__version__ = "0.1.0"
