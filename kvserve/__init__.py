"""kvserve: a causal transformer from PyTorch to a fast, trustworthy gRPC service.

Sub-packages: ``kvserve.model`` (torch; training, import from Hugging Face),
``kvserve.export`` (torch -> ONNX artifact), ``kvserve.artifact`` (the artifact contract and its
onnxruntime runners, no torch), ``kvserve.server`` (gRPC + OpenAI-compatible HTTP, no torch),
``kvserve.clients`` (Python clients and CLI commands), ``kvserve.bench`` (benchmarks). The top
level stays light: importing ``kvserve`` never imports torch.
"""
__version__ = "0.1.0"
