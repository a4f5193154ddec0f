"""Normalising a model's SparseAttention nodes for the bridge.

The PyOp bridge requires every declared input and attribute on the node (DESIGN.md
section 2), so each SparseAttention node gets: explicit values for its optional
attributes, an empty placeholder tensor in every absent optional input slot, and a
unique identity (``sao_node_key``) that keys its GPU state. Model-level faults (bad
attributes, inconsistent optional inputs) are refused here, naming the node. Other nodes
are left alone.
"""

from __future__ import annotations

import copy
import os
import uuid
from pathlib import Path
from typing import Union

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .bridge import NODE_KEY_ATTRIBUTE
from .spec import DOMAIN, INPUT_NAMES, OP_TYPE, OpAttributes, SparseAttentionError

ModelLike = Union[str, os.PathLike, bytes, onnx.ModelProto]

#: Initializer that stands in for an absent optional input (key/value when packed,
#: cos/sin without rotary). The spec module reads an empty optional input as absent.
ABSENT_FLOAT = "sao_absent_float"
_OPTIONAL = {"key", "value", "cos_cache", "sin_cache"}


def load_model(model: ModelLike) -> onnx.ModelProto:
    """A ModelProto from a path, serialized bytes or a ModelProto (which is copied)."""
    if isinstance(model, onnx.ModelProto):
        return copy.deepcopy(model)
    if isinstance(model, (bytes, bytearray)):
        return onnx.load_from_string(bytes(model))
    if isinstance(model, (str, os.PathLike)):
        path = Path(model)
        if not path.is_file():
            raise FileNotFoundError(f"no ONNX model at {path}")
        return onnx.load(str(path))
    raise TypeError(f"model must be a path, bytes or onnx.ModelProto, got {type(model).__name__}")


def is_sparse_attention(node: onnx.NodeProto) -> bool:
    return node.op_type == OP_TYPE and node.domain == DOMAIN


def _iter_graphs(graph: onnx.GraphProto):
    """The graph and every subgraph (If/Loop/Scan bodies) below it."""
    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from _iter_graphs(attribute.g)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                for sub in attribute.graphs:
                    yield from _iter_graphs(sub)


def prepare_model(model: ModelLike, *, session_token: str | None = None) -> onnx.ModelProto:
    """Return a copy of ``model`` whose SparseAttention nodes the bridge can run.

    ``session_token`` prefixes every node identity; each call without one draws a fresh
    token, so two models prepared separately never share GPU state.
    """
    prepared = load_model(model)
    token = session_token or uuid.uuid4().hex
    count = 0
    placeholder_needed = False
    for graph in _iter_graphs(prepared.graph):
        for node in graph.node:
            if not is_sparse_attention(node):
                continue
            placeholder_needed |= _normalise_node(node, f"{token}/{count}:{node.name}")
            count += 1
    if placeholder_needed and not any(init.name == ABSENT_FLOAT for init in prepared.graph.initializer):
        prepared.graph.initializer.append(numpy_helper.from_array(np.zeros((0,), np.float32), ABSENT_FLOAT))
    if count and not any(op.domain == DOMAIN for op in prepared.opset_import):
        prepared.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return prepared


def node_attributes(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _normalise_node(node: onnx.NodeProto, node_key: str) -> bool:
    """Fill defaults, placeholders and identity in place; True if a placeholder is used."""
    label = f"SparseAttention node '{node.name or node_key}'"
    attrs = node_attributes(node)
    try:
        attributes = OpAttributes.from_mapping(attrs)
    except SparseAttentionError as error:
        raise SparseAttentionError(f"{label}: {error}") from None
    inputs = list(node.input) + [""] * (len(INPUT_NAMES) - len(node.input))
    if len(inputs) > len(INPUT_NAMES):
        raise SparseAttentionError(f"{label}: has {len(inputs)} inputs, the operator takes {len(INPUT_NAMES)}")
    named = dict(zip(INPUT_NAMES, inputs))
    for name, value in named.items():
        if name not in _OPTIONAL and not value:
            raise SparseAttentionError(f"{label}: input '{name}' is required")
    if bool(named["key"]) != bool(named["value"]):
        raise SparseAttentionError(f"{label}: inputs 'key' and 'value' must both be given, or both absent for packed QKV")
    if attributes.do_rotary and not (named["cos_cache"] and named["sin_cache"]):
        raise SparseAttentionError(f"{label}: inputs 'cos_cache' and 'sin_cache' are required when do_rotary = 1")
    used_placeholder = False
    for index, name in enumerate(INPUT_NAMES):
        if name in _OPTIONAL and not inputs[index]:
            inputs[index] = ABSENT_FLOAT
            used_placeholder = True
    del node.input[:]
    node.input.extend(inputs)

    explicit = {
        "scale": float(attributes.scale),
        "do_rotary": int(attributes.do_rotary),
        "rotary_interleaved": int(attributes.rotary_interleaved),
        NODE_KEY_ATTRIBUTE: node_key,
    }
    kept = [a for a in node.attribute if a.name not in explicit]
    del node.attribute[:]
    node.attribute.extend(kept)
    node.attribute.extend(helper.make_attribute(name, value) for name, value in explicit.items())
    return used_placeholder


