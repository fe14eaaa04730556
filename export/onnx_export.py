"""One function that turns (model, GraphSpec) into an ONNX file."""
from __future__ import annotations

import contextlib
import io
import logging
import warnings
from pathlib import Path

import onnx
import torch

from kvserve.model.transformer import Transformer

from .graphs import GraphModule, dynamic_shapes, example_inputs
from kvserve.artifact.spec import OPSET, GraphSpec

log = logging.getLogger(__name__)


def export_graph(model: Transformer, spec: GraphSpec, out_dir: str | Path) -> Path:
    """Export one graph with the dynamo exporter; weights go to ``<name>.onnx.data``."""
    out_dir = Path(out_dir)
    path = out_dir / spec.filename
    module = GraphModule(model.eval(), spec).eval()
    cfg = model.cfg
    args = example_inputs(model, spec)
    with torch.no_grad(), warnings.catch_warnings(), _quiet():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module, args, dynamo=True, opset_version=OPSET,
            input_names=spec.input_names(cfg), output_names=spec.output_names(cfg),
            dynamic_shapes=dynamic_shapes(model, spec), optimize=True, verbose=False,
        )
    program.save(str(path), external_data=True)
    if spec.with_past:
        _name_dim(path, "attention_mask", 1, "total_sequence_length")
    _check_io(path, spec, cfg)
    log.info("exported %s", path)
    return path


@contextlib.contextmanager
def _quiet():
    """The exporter prints progress lines on stdout; keep them out of the user's terminal."""
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink):
        yield


def _name_dim(path: Path, tensor: str, axis: int, name: str) -> None:
    """Give an inferred symbolic dimension (e.g. ``s53``) its conventional name everywhere."""
    m = onnx.load(str(path), load_external_data=False)
    old = next(i for i in m.graph.input if i.name == tensor).type.tensor_type.shape.dim[axis]
    if not old.dim_param or old.dim_param == name:
        return
    before = old.dim_param
    for v in (*m.graph.input, *m.graph.output, *m.graph.value_info):
        for d in v.type.tensor_type.shape.dim:
            if d.dim_param == before:
                d.dim_param = name
    onnx.save(m, str(path))  # the proto only: initializers keep pointing at <name>.onnx.data


def _check_io(path: Path, spec: GraphSpec, cfg) -> None:
    m = onnx.load(str(path), load_external_data=False)
    got_in = [i.name for i in m.graph.input]
    got_out = [o.name for o in m.graph.output]
    if got_in != spec.input_names(cfg) or got_out != spec.output_names(cfg):
        raise RuntimeError(f"exported {spec.name} has unexpected I/O: inputs {got_in}, "
                           f"outputs {got_out}")
