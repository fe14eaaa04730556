"""Fused artifacts on onnxruntime releases whose ``GroupQueryAttention`` has no
``query_seqlens`` input (before 1.32; onnxruntime-gpu 1.31.1 is the newest CUDA build on PyPI
at the time of writing).

The fused graph feeds each call's right-padded rows with their valid lengths
(``query_seqlens``, the op's 17th input). Without that input the op takes every row as
``sequence_length`` long: row b's new tokens at cache rows [T - S, T), T = seqlens_k + 1. A
runner can keep the same result by counting the padding as tokens (``FusedLM``'s
``padding_counted``): it feeds seqlens_k = rows before the call + S - 1 (and query_seqlens =
S, which the graph still reads for learned positions), so row b's valid tokens sit at [P, P +
Q) with their true
positions, and its padding after them, beyond the slot's rows in use: never read (the causal
mask keeps a valid row from seeing the padding after it) and overwritten by the slot's next
call, as the padding of a verification already was. The slot's row count then advances by the
valid tokens alone. A decode step (one token a row) is the same call either way.

``FusedLM`` loads the artifact's graph with that input taken off every GroupQueryAttention
node (``without_query_seqlens``; the graph file itself and its manifest hash are untouched:
the file is verified, then rewritten in memory), its weights read from the artifact's
directory.
"""
from __future__ import annotations

import functools

import onnx

GQA = "GroupQueryAttention"
QUERY_SEQLENS_INDEX = 16  # the op's input ``query_seqlens``


@functools.cache
def gqa_takes_query_seqlens() -> bool:
    """Whether this onnxruntime's GroupQueryAttention has the ``query_seqlens`` input."""
    from onnxruntime.capi import onnxruntime_pybind11_state as C

    for schema in C.get_all_operator_schema():
        if schema.name == GQA and schema.domain == "com.microsoft":
            return len(schema.inputs) > QUERY_SEQLENS_INDEX
    return False


def without_query_seqlens(model: onnx.ModelProto) -> int:
    """Take ``query_seqlens`` (and the empty inputs before it) off every GroupQueryAttention
    node of ``model``, in place. Returns how many nodes changed."""
    changed = 0
    for node in model.graph.node:
        if node.op_type == GQA and len(node.input) > QUERY_SEQLENS_INDEX:
            kept = list(node.input)[:QUERY_SEQLENS_INDEX]
            while kept and not kept[-1]:
                kept.pop()
            del node.input[:]
            node.input.extend(kept)
            changed += 1
    return changed
