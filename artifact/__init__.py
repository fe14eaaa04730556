"""The artifact contract, torch-free: what an exported directory holds (graph spec, manifest,
verification) and how onnxruntime runs it. ``export`` writes artifacts with it; ``server``
reads them with it; it imports neither.

- ``spec``      graph I/O names, shapes and KV layout, written into the manifest and read back
- ``manifest``  sha256 of every file; read/write
- ``verify``    the artifact is exactly what its manifest says, or nothing loads
- ``providers`` execution providers and session options
- ``fused``     the fused GroupQueryAttention graph's runner and its device-resident KV cache
- ``portable``  the standard-ops graphs' runner (``kvserve export --portable``)
- ``longrope``  LongRoPE rows crossing original_max_position_embeddings: refilled once
- ``load_lm``   the runner an artifact's manifest asks for
"""
