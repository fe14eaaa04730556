"""`kvserve export --precision int8` / `int4` does not print onnxruntime's quantizers'
narration (INFO lines per tensor, through the root logger or their module's); their warnings
still get through."""
from __future__ import annotations

import logging

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def test_quantizer_info_is_filtered_warnings_are_not(tmp_path):
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from kvserve.export.logs import quiet_exporter_logs, quiet_quantizer

    w = numpy_helper.from_array(np.ones((64, 64), np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])], [w])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]),
              tmp_path / "m.onnx")
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record)

    root, handler, level = logging.getLogger(), Keep(), logging.getLogger().level
    root.removeFilter(quiet_quantizer)  # an earlier `kvserve export` in this process set it
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        quantize_dynamic(tmp_path / "m.onnx", tmp_path / "a.onnx", weight_type=QuantType.QInt8)
        loud = [r for r in seen if "/onnxruntime/quantization/" in r.pathname]
        assert [r for r in loud if r.levelno == logging.INFO]  # what the CLI hides
        seen.clear()
        quiet_exporter_logs()
        quantize_dynamic(tmp_path / "m.onnx", tmp_path / "b.onnx", weight_type=QuantType.QInt8)
        assert [r.levelno for r in seen] == [r.levelno for r in loud
                                             if r.levelno >= logging.WARNING]
        logging.info("kvserve's own INFO")  # only the quantizer's records are filtered
        assert seen[-1].getMessage() == "kvserve's own INFO"
    finally:
        root.removeFilter(quiet_quantizer)
        root.removeHandler(handler)
        root.setLevel(level)


def test_the_block_quantizers_info_is_quieted_too(tmp_path):
    """MatMulNBitsQuantizer (int4, int8 in blocks) logs through its module's logger."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    from kvserve.export.logs import quiet_exporter_logs, quiet_quantizer

    w = numpy_helper.from_array(np.ones((64, 64), np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])], [w])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record)

    root, handler, level = logging.getLogger(), Keep(), logging.getLogger().level
    ort_q = logging.getLogger("onnxruntime.quantization")
    ort_level = ort_q.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    ort_q.setLevel(logging.NOTSET)  # (an earlier `kvserve export` in this process set it)
    try:
        MatMulNBitsQuantizer(model, bits=4, block_size=32).process()
        assert any(r.name.startswith("onnxruntime.quantization") and r.levelno == logging.INFO
                   for r in seen)  # what the CLI hides
        seen.clear()
        quiet_exporter_logs()
        MatMulNBitsQuantizer(model, bits=8, block_size=32).process()
        assert not [r for r in seen if r.levelno < logging.WARNING]
    finally:
        root.removeFilter(quiet_quantizer)
        root.removeHandler(handler)
        root.setLevel(level)
        ort_q.setLevel(ort_level)
