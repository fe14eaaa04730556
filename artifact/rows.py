"""Row-wise work on the host after a model call, on onnxruntime's CPU provider.

``LogSoftmax``: log-probabilities of many logits rows at once (Score's per-token logprobs).
onnxruntime's kernel (vectorised exp, rows split over the session's threads) measured 13x
numpy's ``model.sampling.log_softmax`` on 256 x 4,096 rows and 6x on 256 x 16,384 (2-core
bench machine): at the 6M bench size numpy's pass had been a quarter of a Score call. The
values agree with numpy's to a few ulps (2e-6 measured).
"""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper


class LogSoftmax:
    """``log_softmax(rows)`` over the last axis of (T, V) float32 rows. Its session's threads
    sleep when idle (no spinning), so they never compete with the model's own."""

    def __init__(self, threads: int):
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["t", "v"])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["t", "v"])
        graph = helper.make_graph([helper.make_node("LogSoftmax", ["x"], ["y"], axis=-1)],
                                  "log_softmax_rows", [x], [y])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
        model.ir_version = 10
        so = ort.SessionOptions()
        so.intra_op_num_threads = max(1, threads)
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        so.log_severity_level = 3
        self._session = ort.InferenceSession(model.SerializeToString(), so,
                                             providers=["CPUExecutionProvider"])

    def __call__(self, rows: np.ndarray) -> np.ndarray:
        """(T, V) -> (T, V) float32."""
        x = np.ascontiguousarray(rows, np.float32)
        return self._session.run(None, {"x": x.reshape(-1, x.shape[-1])})[0].reshape(x.shape)
