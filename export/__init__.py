"""Export: a checkpoint -> prefill/decode ONNX graphs, parity gate, manifest, verify.

``spec``, ``manifest`` and ``verify`` are torch-free (the server uses them); ``graphs``,
``onnx_export``, ``parity`` and ``cli`` need torch.
"""
