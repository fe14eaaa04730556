"""The floor of kvserve's decode on onnxruntime's kernels (``matmuls``, ``matmuls_int8``,
``matmuls_int4``): the artifact's own matrix products (``MatMul``, ``MatMulInteger``,
``MatMulNBits`` with a constant weight: every layer's projections and the lm_head), with
nothing between them, in one session made with the engine's session options.

Each decode call of a cell becomes one run of those products at its shape: the prefill
(B x prompt rows through every product but the lm_head, which the real graph applies to the
last row only) and then one row a sequence per new token, as the engine's calls are. Their
wall time is what onnxruntime's kernels alone take for the cell's arithmetic and weight reads:
no attention, norms, activations, sampling or Python between the calls. A peer whose whole
step is faster than this floor is ahead on kernels, which no change to kvserve's graph or
engine can close (the llama.cpp targets' reasons quote it). The outputs are bound once
(``IOBinding``, preallocated) so that no output allocation is timed; no tokens come out
(``generate`` returns zeros: the plan does not sample them). Its peak RSS says nothing
(the weights pass through a protobuf in memory): the tables leave it out.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .runner_base import Runner

PRODUCTS = ("MatMul", "MatMulInteger", "MatMulNBits")


def floor_graph(model_path: Path):
    """(model, [(input name, output name, K, N, input dtype, is the lm_head)]): every matrix
    product of the model at ``model_path`` with a constant weight, each with an input of its
    own (B, S, K) and its output (B, S, N) a graph output."""
    import onnx
    from onnx import helper

    src = onnx.load(str(model_path), load_external_data=True)
    g = src.graph
    inits = {t.name: t for t in g.initializer}
    vocab = next((d.dim_value for o in g.output if o.name == "logits"
                  for d in o.type.tensor_type.shape.dim[-1:]), 0)
    nodes, inputs, outputs, used, feeds = [], [], [], {}, []
    for node in g.node:
        if node.op_type not in PRODUCTS or len(node.input) < 2 or node.input[1] not in inits:
            continue
        if node.op_type == "MatMulNBits":
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            K, N = attrs["K"], attrs["N"]
        else:
            K, N = inits[node.input[1]].dims
        dtype = np.uint8 if node.op_type == "MatMulInteger" else np.float32
        name = f"floor.in{len(feeds)}"
        elem = onnx.TensorProto.UINT8 if dtype is np.uint8 else onnx.TensorProto.FLOAT
        inputs.append(helper.make_tensor_value_info(name, elem, ["B", "S", K]))
        out = f"floor.out{len(feeds)}"
        outputs.append(helper.make_tensor_value_info(
            out, onnx.TensorProto.INT32 if node.op_type == "MatMulInteger"
            else onnx.TensorProto.FLOAT, None))
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.input[0] = name
        del copy.output[:]
        copy.output.append(out)
        nodes.append(copy)
        for i in copy.input[1:]:
            if i and i in inits:
                used[i] = inits[i]
        feeds.append((name, out, K, N, dtype, bool(vocab) and N == vocab))
    if not feeds:
        raise ValueError(f"{model_path} has no matrix product with a constant weight")
    graph = helper.make_graph(nodes, "matmuls", inputs, outputs, list(used.values()))
    model = helper.make_model(graph, opset_imports=list(src.opset_import))
    model.ir_version = src.ir_version
    return model, feeds


class MatmulFloorRunner(Runner):
    """A decode cell's matrix products alone (see the module's docstring)."""
    name = "matmuls"

    def __init__(self, artifact: str, threads: int):
        import onnxruntime as ort

        from kvserve.artifact.providers import session_options

        model, self.feeds = floor_graph(Path(artifact) / "model.onnx")
        self.sess = ort.InferenceSession(model.SerializeToString(), session_options(threads),
                                         providers=["CPUExecutionProvider"])
        self._bound: dict[tuple[int, int], object] = {}
        self._arrays: list[np.ndarray] = []  # the bound inputs and outputs (kept alive)

    def _binding(self, B: int, S: int):
        """The binding of a run at B sequences x S rows (the lm_head: one row a sequence)."""
        b = self._bound.get((B, S))
        if b is None:
            b = self._bound[(B, S)] = self.sess.io_binding()
            rng = np.random.default_rng(0)
            for name, out, K, N, dtype, head in self.feeds:
                rows = 1 if head else S
                x = (rng.integers(0, 256, (B, rows, K)).astype(np.uint8) if dtype is np.uint8
                     else rng.standard_normal((B, rows, K)).astype(np.float32))
                y = np.empty((B, rows, N), np.int32 if dtype is np.uint8 else np.float32)
                self._arrays += [x, y]
                b.bind_cpu_input(name, x)
                b.bind_output(out, "cpu", 0, y.dtype, list(y.shape), y.ctypes.data)
        return b

    def generate(self, prompts: np.ndarray, n: int) -> np.ndarray:
        B, P = prompts.shape
        prefill, decode = self._binding(B, P), self._binding(B, 1)
        self.sess.run_with_iobinding(prefill)
        for _ in range(n - 1):
            self.sess.run_with_iobinding(decode)
        return np.zeros((B, n), np.int64)
