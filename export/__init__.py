"""Export: a checkpoint -> a verified artifact directory (ONNX graphs, parity gate, manifest).

- ``pipeline``   ``export_artifacts``: graphs, precision, parity gate, manifest; all or nothing
- ``fused``      the default graph, built op by op on GroupQueryAttention (``fused_ops``: its
                 pieces)
- ``graphs``, ``onnx_export``  the portable graphs (``--portable``): torch modules exported
- ``precision``  fp16 / int8 / int4 transforms and the perplexity that judges them
- ``parity``     the gate: torch vs onnxruntime through the server's own runner
- ``cli``        ``kvserve export`` (torch imported only when it runs); ``logs`` quiets the
                 libraries it drives
The artifact contract (graph spec, manifest, verification, runners) is ``kvserve.artifact``,
torch-free; ``export`` writes it, the server reads it, and neither imports the other.
"""
