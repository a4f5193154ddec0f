"""Normalising a model's SparseAttention nodes for the bridge.

The PyOp bridge requires every declared input and attribute on the node (DESIGN.md
section 2), so each SparseAttention node gets: explicit values for its optional
attributes, an empty placeholder tensor in every absent optional input slot, and a
unique identity (``sao_node_key``) that keys its GPU state. The bridge cannot carry
float16 either, so a float16 node is wrapped in Casts: its float16 inputs are cast to
float32 in front of it and its outputs back to float16 behind it, and the graph keeps its
float16 interface. Model-level faults (bad attributes, inconsistent optional inputs,
unsupported types) are refused here, naming the node. Other nodes are left alone.
"""

from __future__ import annotations

import copy
import os
import uuid
from pathlib import Path
from typing import Union

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .bridge import NODE_KEY_ATTRIBUTE, STORAGE_ATTRIBUTE
from .spec import DOMAIN, INPUT_NAMES, OP_TYPE, OpAttributes, SparseAttentionError

ModelLike = Union[str, os.PathLike, bytes, onnx.ModelProto]

#: Initializer that stands in for an absent optional input (key/value when packed,
#: cos/sin without rotary). The spec module reads an empty optional input as absent.
ABSENT_FLOAT = "sao_absent_float"
_OPTIONAL = {"key", "value", "cos_cache", "sin_cache"}
_FLOAT_SLOTS = [i for i, name in enumerate(INPUT_NAMES) if name in ("query", "key", "value", "past_key", "past_value", "cos_cache", "sin_cache")]
_INT_SLOTS = [i for i, name in enumerate(INPUT_NAMES) if i not in _FLOAT_SLOTS]
#: Suffix of the float32 tensors between a float16 node's Casts.
FLOAT32_SUFFIX = "_sao_f32"


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
    types = tensor_types(prepared)
    count = 0
    placeholder_needed = False
    for graph in _iter_graphs(prepared.graph):
        nodes = []
        for node in graph.node:
            if not is_sparse_attention(node):
                nodes.append(node)
                continue
            placeholder_needed |= _normalise_node(node, f"{token}/{count}:{node.name}")
            nodes.extend(_compute_in_float32(node, types))
            count += 1
        del graph.node[:]
        graph.node.extend(nodes)
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
        STORAGE_ATTRIBUTE: "float32",  # _compute_in_float32 marks float16 nodes
    }
    kept = [a for a in node.attribute if a.name not in explicit]
    del node.attribute[:]
    node.attribute.extend(kept)
    node.attribute.extend(helper.make_attribute(name, value) for name, value in explicit.items())
    return used_placeholder




def tensor_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every tensor of the main graph whose type ONNX can infer."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # inference is a convenience: fall back to what the graph declares
        inferred = model
    graph = inferred.graph
    types = {vi.name: vi.type.tensor_type.elem_type for vi in [*graph.input, *graph.value_info, *graph.output]}
    types.update({init.name: init.data_type for init in graph.initializer})
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            types[node.output[0]] = node.attribute[0].t.data_type
    return {name: t for name, t in types.items() if t != TensorProto.UNDEFINED}


def _compute_in_float32(node: onnx.NodeProto, types: dict[str, int]) -> list[onnx.NodeProto]:
    """The node, wrapped in Casts when its float inputs are float16 (else just the node)."""
    label = f"SparseAttention node '{node.name}'"
    for slot in _FLOAT_SLOTS:
        elem = types.get(node.input[slot], TensorProto.FLOAT)
        if node.input[slot] != ABSENT_FLOAT and elem not in (TensorProto.FLOAT, TensorProto.FLOAT16):
            raise SparseAttentionError(
                f"{label}: input '{INPUT_NAMES[slot]}' is {TensorProto.DataType.Name(elem)}; float32 and float16 are supported"
            )
    for slot in _INT_SLOTS:
        elem = types.get(node.input[slot], TensorProto.INT32)
        if elem != TensorProto.INT32:
            raise SparseAttentionError(f"{label}: input '{INPUT_NAMES[slot]}' must be int32, got {TensorProto.DataType.Name(elem)}")
    half = [slot for slot in _FLOAT_SLOTS if types.get(node.input[slot]) == TensorProto.FLOAT16]
    if not half:
        return [node]
    if types.get(node.input[0]) != TensorProto.FLOAT16:
        raise SparseAttentionError(f"{label}: float16 inputs need a float16 query (the operator has one type T)")
    for attribute in node.attribute:
        if attribute.name == STORAGE_ATTRIBUTE:
            attribute.s = b"float16"
    before = []
    for slot in half:
        source = node.input[slot]
        cast_name = f"{source}{FLOAT32_SUFFIX}_{node.name or 'node'}"
        before.append(helper.make_node("Cast", [source], [cast_name], to=TensorProto.FLOAT, name=f"{cast_name}_cast"))
        node.input[slot] = cast_name
    after = []
    for index, output in enumerate(node.output):
        if not output:
            continue
        float32_name = f"{output}{FLOAT32_SUFFIX}"
        node.output[index] = float32_name
        after.append(helper.make_node("Cast", [float32_name], [output], to=TensorProto.FLOAT16, name=f"{output}_to_float16"))
    return before + [node] + after
