"""ONNX graph helpers shared by every wing: loading, walking, attributes, declared tensors.

One home for the small questions asked of a graph (which nodes are attention nodes, what a
node's attributes are, what dtype and shape ONNX can tell for a tensor, which tensors are
constant), so the rewrite, the inspection report, the feeds and the generation loop agree.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import onnx
from onnx import TensorProto, helper

from sparse_attention_op.op.spec import DOMAIN, OP_TYPE

ModelLike = Union[str, os.PathLike, bytes, onnx.ModelProto]
#: (domain, op_type) of ORT's GroupQueryAttention, the dense layers' attention.
GROUP_QUERY_ATTENTION = ("com.microsoft", "GroupQueryAttention")


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


def is_group_query_attention(node: onnx.NodeProto) -> bool:
    return (node.domain, node.op_type) == GROUP_QUERY_ATTENTION


def node_attributes(node: onnx.NodeProto) -> dict:
    """A node's attributes as Python values."""
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def subgraphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """Every subgraph (If/Loop/Scan bodies) of the graph, nested ones too."""
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield attribute.g
                yield from subgraphs(attribute.g)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                for sub in attribute.graphs:
                    yield sub
                    yield from subgraphs(sub)


def all_graphs(graph: onnx.GraphProto) -> list[onnx.GraphProto]:
    """The graph and every subgraph of it."""
    return [graph, *subgraphs(graph)]


def all_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """Every node of the graph and of its subgraphs."""
    for each in all_graphs(graph):
        yield from each.node


def constant_tensors(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    """Tensors fixed in the model: initializers that are not graph inputs, Constant outputs."""
    inputs = {i.name for i in graph.input}
    constants = {init.name: init for init in graph.initializer if init.name not in inputs}
    for node in graph.node:
        if node.op_type == "Constant" and node.output:
            for attribute in node.attribute:
                if attribute.name == "value":
                    constants[node.output[0]] = attribute.t
    return constants


@dataclass
class TensorInfo:
    name: str
    dtype: str  # "float32", "int64", ... or "?" where nothing declares it
    shape: list | None  # ints and symbolic names (None: an unnamed dim); None: rank unknown
    kind: str = ""  # "graph input", "constant", "computed" (node inputs only)
    elem_type: int = TensorProto.UNDEFINED

    @property
    def shape_text(self) -> str:
        if self.shape is None:
            return "?"
        return "[" + ", ".join("?" if d is None else str(d) for d in self.shape) + "]"


def dtype_name(elem_type: int) -> str:
    if elem_type == TensorProto.UNDEFINED:
        return "?"
    return str(helper.tensor_dtype_to_np_dtype(elem_type)) if elem_type != TensorProto.BFLOAT16 else "bfloat16"


def _tensor_info(value_info: onnx.ValueInfoProto) -> TensorInfo:
    tensor_type = value_info.type.tensor_type
    shape = None
    if tensor_type.HasField("shape"):
        shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor_type.shape.dim]
    return TensorInfo(value_info.name, dtype_name(tensor_type.elem_type), shape, elem_type=tensor_type.elem_type)


def declared_tensors(model: onnx.ModelProto) -> dict[str, TensorInfo]:
    """Dtype and shape of every tensor of the main graph that ONNX can tell, declared or
    inferred (inference is a convenience: a model it cannot handle keeps what it declares)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:
        inferred = model
    graph = inferred.graph
    found = {vi.name: _tensor_info(vi) for vi in [*graph.value_info, *graph.output, *graph.input]}
    for init in graph.initializer:
        found.setdefault(init.name, TensorInfo(init.name, dtype_name(init.data_type), list(init.dims), elem_type=init.data_type))
    for node in graph.node:  # Constant nodes' outputs: their value says what inference may not
        for attribute in node.attribute if node.op_type == "Constant" and node.output else ():
            if attribute.name == "value":
                tensor = attribute.t
                found[node.output[0]] = TensorInfo(node.output[0], dtype_name(tensor.data_type), list(tensor.dims), elem_type=tensor.data_type)
    return found


def tensor_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every tensor of the main graph whose type ONNX can tell."""
    return {name: info.elem_type for name, info in declared_tensors(model).items() if info.elem_type != TensorProto.UNDEFINED}


def declared_head_size(node: onnx.NodeProto, declared: dict[str, TensorInfo]) -> int | None:
    """The head size an attention node's declared (or inferred) input shapes fix: a past's
    last dim, or the query's width over its heads (packed QKV counts the kv heads twice)."""
    attributes = node_attributes(node)
    heads, kv_heads = int(attributes.get("num_heads", 0)), int(attributes.get("kv_num_heads", 0))
    inputs = list(node.input) + [""] * 5
    packed = not inputs[1]
    candidates = [(inputs[3], 3, 1), (inputs[0], 2, heads + (2 * kv_heads if packed else 0))]
    for tensor, axis, divisor in candidates:
        info = declared.get(tensor) if tensor else None
        if info is None or info.shape is None or len(info.shape) <= axis or divisor <= 0:
            continue
        size = info.shape[axis]
        if isinstance(size, int) and size > 0 and size % divisor == 0:
            return size // divisor
    return None
