"""The fused graph's SwiGLU on kvserve's native library (``artifact.native_swiglu``): the op
against the export's four ops, the rewrite of every group and only those whose intermediate
tensors nothing else reads, none in a half-precision graph. The runner tests (``lm``'s
``fused``) and ``test_native_attention``'s runner comparison run graphs with it."""
from __future__ import annotations


import onnx
import pytest

from kvserve.artifact import native_swiglu as NS
from kvserve.artifact.fused import FusedLM


@pytest.fixture
def library(native_library) -> str:
    return native_library


def test_the_op_equals_onnxruntimes_ops(library):
    """A decode row, a few rows, a prefill's 300, values far into both tails: 1e-5 of the
    largest output."""
    assert NS.check(library) <= NS.TOLERANCE


def _graph(artifacts) -> onnx.ModelProto:
    return onnx.load(str(artifacts["fused"] / "model.onnx"), load_external_data=False)


def test_every_swiglu_of_the_export_becomes_one_node(library, artifacts):
    model = _graph(artifacts)
    layers = FusedLM(artifacts["fused"], provider="cpu", threads=1, attention=False,
                     attention_kernel="onnxruntime").cfg.n_layers
    assert len(NS.groups(model)) == layers
    before = len(model.graph.node)
    assert NS.rewrite(model) == layers
    assert len(model.graph.node) == before - 3 * layers
    assert sum(n.op_type == NS.OP and n.domain == NS.DOMAIN for n in model.graph.node) == layers
    assert not any(n.op_type == "Sigmoid" for n in model.graph.node)
    lm = FusedLM(artifacts["fused"], provider="cpu", threads=1, attention=False)
    assert f"SwiGLU ({layers})" in lm.attention_kernel


def test_a_group_whose_tensors_are_read_elsewhere_stays(library, artifacts):
    model = _graph(artifacts)
    first = NS.groups(model)[0]
    sig = first[1]
    model.graph.output.append(onnx.helper.make_tensor_value_info(sig.output[0],
                                                                 onnx.TensorProto.FLOAT, None))
    n = len(NS.groups(_graph(artifacts)))
    assert len(NS.groups(model)) == n - 1
    assert sig.name not in {g[1].name for g in NS.groups(model)}


def test_unnamed_nodes_are_told_apart(artifacts):
    """Readers compared as nodes, not by name: with every name erased, a third reader of a
    group's tensor still keeps that group."""
    model = _graph(artifacts)
    n = len(NS.groups(model))
    split = NS.groups(model)[0][0]
    for node in model.graph.node:
        node.name = ""
    model.graph.node.append(onnx.helper.make_node("Identity", [split.output[1]], ["extra"]))
    assert len(NS.groups(model)) == n - 1


def test_a_half_precision_graph_keeps_its_ops(artifacts):
    model = _graph(artifacts)
    model.graph.input[-1].type.tensor_type.elem_type = onnx.TensorProto.FLOAT16
    assert NS.groups(model) and NS.rewrite(model) == 0
