"""The fused graph's structure, pinned: for every config of the export matrix and every option
of imported families, the node list (op, domain, name, inputs, outputs, attributes), the
initializers (name, shape, type) and the graph I/O hash to the digests recorded in
``fused_graph_digests.json``. Recorded from ``build_fused`` as one 153-line function; its
split into per-block builders (``fused_blocks``) builds the same graphs (byte-identical
protos, weights included, on these 44 cases when it was made).

A deliberate change to the graph: regenerate with
``python tests/export/test_fused_graph.py --update`` and say why in the commit."""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]

from export_matrix import CONFIGS, make_config  # noqa: E402
from test_fused_options import OPTIONS, _config  # noqa: E402

from kvserve.artifact.spec import FusedSpec  # noqa: E402
from kvserve.export import fused  # noqa: E402

DIGESTS = Path(__file__).with_name("fused_graph_digests.json")
SPECS = {"main": FusedSpec(), "attn": FusedSpec(attention=True),
         "norows": FusedSpec(logits_rows=None)}


def cases() -> dict[str, tuple]:
    """name -> (config, spec, dtype)."""
    out = {}
    for name in CONFIGS:
        for s, spec in SPECS.items():
            out[f"{name}-{s}"] = (make_config(name), spec, np.float32)
        out[f"{name}-main-float16"] = (make_config(name), SPECS["main"], np.float16)
    for name, opts in OPTIONS.items():
        out[f"opt-{name}-main"] = (_config(**opts), SPECS["main"], np.float32)
        out[f"opt-{name}-attn"] = (_config(**opts), SPECS["attn"], np.float32)
    return out


def weights(cfg) -> dict[str, np.ndarray]:
    import torch

    from kvserve.model.transformer import Transformer

    torch.manual_seed(0)
    return {k: v.detach().float().numpy() for k, v in Transformer(cfg).state_dict().items()}


def _value_info(v: onnx.ValueInfoProto) -> str:
    t = v.type.tensor_type
    dims = [d.dim_param or d.dim_value for d in t.shape.dim]
    return f"{v.name}:{t.elem_type}:{dims}"


def structure(m: onnx.ModelProto) -> str:
    """Everything of the graph but the initializers' values, one line per item."""
    g = m.graph
    lines = [f"ir {m.ir_version}", "opsets " + repr([(o.domain, o.version)
                                                     for o in m.opset_import])]
    lines += ["in " + _value_info(v) for v in g.input]
    lines += ["out " + _value_info(v) for v in g.output]
    lines += [f"init {t.name}:{t.data_type}:{list(t.dims)}" for t in g.initializer]
    for n in g.node:
        attrs = sorted((a.name, repr(helper.get_attribute_value(a))) for a in n.attribute)
        lines.append(f"node {n.op_type}|{n.domain}|{n.name}|{list(n.input)}|{list(n.output)}|"
                     f"{attrs}")
    return "\n".join(lines)


def digest(m: onnx.ModelProto) -> str:
    return hashlib.sha256(structure(m).encode()).hexdigest()


def build(name: str) -> onnx.ModelProto:
    cfg, spec, dtype = cases()[name]
    return fused.build_fused(cfg, weights(cfg), spec, dtype)


@pytest.mark.parametrize("name", list(cases()))
def test_graph_is_the_recorded_one(name):
    want = json.loads(DIGESTS.read_text())
    assert set(want) == set(cases())
    assert digest(build(name)) == want[name], name


def test_structure_sees_a_changed_attribute():
    """The digest is not blind: one attribute changed, or two nodes swapped, change it."""
    m = build("llama-main")
    before = digest(m)
    gqa = next(n for n in m.graph.node if n.op_type == "GroupQueryAttention")
    next(a for a in gqa.attribute if a.name == "local_window_size").i = 4
    assert digest(m) != before
    m = build("llama-main")
    nodes = list(m.graph.node)
    nodes[1], nodes[2] = nodes[2], nodes[1]
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    assert digest(m) != before


if __name__ == "__main__" and sys.argv[1:] == ["--update"]:
    DIGESTS.write_text(json.dumps({n: digest(build(n)) for n in cases()}, indent=1,
                                  sort_keys=True) + "\n")
    print(f"wrote {DIGESTS}")
