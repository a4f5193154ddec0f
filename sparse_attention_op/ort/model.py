"""prepare_model: a model whose SparseAttention nodes run through the bridge.

Each SparseAttention node is checked (attributes, required inputs, element types, a
constant layout's CSR), given an identity (``<session token>/<index>:<name>``) that keys its
GPU state, and replaced by the bridge's op (rewrite.py), which runs it on WebGPU. The graph's
inputs and outputs keep their names, shapes, dtypes and meaning. Model-level faults raise
:class:`~sparse_attention_op.op.spec.SparseAttentionError` naming the node. Other nodes are left
alone.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import onnx
from onnx import TensorProto, external_data_helper, helper, numpy_helper

from sparse_attention_op.op.spec import FLOAT_INPUTS, INPUT_NAMES, OPTIONAL_INPUTS, OpAttributes, SparseAttentionError, check_layout
from sparse_attention_op.ort.bridge import BRIDGE_DOMAIN, BRIDGE_FORMAT, OP_TYPES
from sparse_attention_op.ort.graph import ModelLike, all_graphs, constant_tensors, is_sparse_attention, load_model, node_attributes, tensor_types
from sparse_attention_op.ort.rewrite import NodePlan, expand
from sparse_attention_op.settings import SessionSettings

_INT_INPUTS = [name for name in INPUT_NAMES if name not in FLOAT_INPUTS]
#: The metadata entry of a prepared model that names its bridge format (bridge.BRIDGE_FORMAT).
FORMAT_KEY = "sparse_attention_op.bridge_format"


def prepare_model(
    model: ModelLike,
    *,
    session_token: str | None = None,
    kv_check: str = "exact",
    profile: bool | str = False,
    f16_cache: bool = True,
    scope: str = "",
) -> onnx.ModelProto:
    """Return a copy of ``model`` whose SparseAttention nodes the bridge runs.

    ``session_token`` prefixes every node identity; each call without one draws a fresh
    token, so two models prepared separately never share GPU state; ``scope`` tells apart
    the models that share one token (a GenAI folder's, by their file names). ``kv_check``,
    ``profile`` and ``f16_cache`` are the session's settings (see create_session), stamped
    on every node; a bad one raises :class:`~sparse_attention_op.settings.SettingsError`.
    """
    settings = SessionSettings.of(kv_check=kv_check, profile=profile, f16_cache=f16_cache)
    prepared = load_model(model)
    check_not_prepared(prepared)
    token = session_token or uuid.uuid4().hex
    main = prepared.graph
    types = tensor_types(prepared)
    constants = set(constant_tensors(main))
    count = 0
    # Subgraph (If/Loop/Scan) bodies are rewritten in place.
    for graph in all_graphs(main):
        for index, node in enumerate(graph.node):
            if is_sparse_attention(node):
                plan = _plan(node, f"{token}/{scope}{count}:{node.name}", settings, types, constants | set(constant_tensors(graph)), main, graph)
                graph.node[index].CopyFrom(expand(plan))
                count += 1
    if count:
        if not any(op.domain == BRIDGE_DOMAIN for op in prepared.opset_import):
            prepared.opset_import.append(helper.make_opsetid(BRIDGE_DOMAIN, 1))
        _set_metadata(prepared, FORMAT_KEY, str(BRIDGE_FORMAT))
    return prepared


#: Domain of the bridge's ops in formats 1 and 2, which wrapped native nodes in Python ops.
_FORMAT_2_DOMAIN = "ai.sparse_attention_op"


def is_bridge_node(node: onnx.NodeProto) -> bool:
    return (node.domain == BRIDGE_DOMAIN and node.op_type in OP_TYPES.values()) or node.domain == _FORMAT_2_DOMAIN


def load_for_session(model: ModelLike) -> tuple[onnx.ModelProto, Path | None]:
    """The model, and the folder of its external weights where a path's model has any: those
    stay in their files for ORT to read there (a model of several GB is no protobuf message
    a session could be handed whole). Only a constant layout's values are read in, for
    prepare_model's checks."""
    if not isinstance(model, (str, os.PathLike)):
        return load_model(model), None
    path = Path(model)
    if not path.is_file():
        raise FileNotFoundError(f"no ONNX model at {path}")
    proto = onnx.load(str(path), load_external_data=False)
    load_constant_layouts(proto, path.parent)
    external = any(external_data_helper.uses_external_data(init) for graph in all_graphs(proto.graph) for init in graph.initializer)
    return proto, path.parent.resolve() if external else None


def bridge_format(model: onnx.ModelProto) -> int | None:
    """The bridge format a prepared model was written for; None for a model without the
    bridge's ops. Models prepared before the format was recorded are format 1."""
    if not any(is_bridge_node(node) for graph in all_graphs(model.graph) for node in graph.node):
        return None
    stamped = {entry.key: entry.value for entry in model.metadata_props}.get(FORMAT_KEY, "1")
    return int(stamped) if stamped.isdigit() else 0


def check_not_prepared(model: onnx.ModelProto) -> None:
    """Refuse a model that holds the bridge's ops already. Its nodes carry the identity of the
    session or folder it was prepared for: a session of it would share that GPU state, keep
    those settings, and its refused calls would not reach it as exceptions. One prepared for
    another bridge format is named as such: its ops' inputs and outputs are not this version's."""
    found = bridge_format(model)
    if found is not None and found != BRIDGE_FORMAT:
        raise SparseAttentionError(
            f"the model was prepared by a sparse_attention_op with bridge format {found}; this version runs format "
            f"{BRIDGE_FORMAT}: prepare the original model (the one with SparseAttention nodes) again"
        )
    if found is not None:
        raise SparseAttentionError(
            "the model is prepared already (it holds the bridge's ops, which belong to the session or GenAI folder it "
            "was prepared for): pass the original model, the one with SparseAttention nodes"
        )


def _set_metadata(model: onnx.ModelProto, key: str, value: str) -> None:
    for entry in model.metadata_props:
        if entry.key == key:
            entry.value = value
            return
    model.metadata_props.add(key=key, value=value)


def _plan(node, node_key: str, settings: SessionSettings, types: dict, constants: set, *graphs) -> NodePlan:
    label = f"SparseAttention node '{node.name or node_key}'"
    try:
        attributes = OpAttributes.from_mapping(node_attributes(node))
    except SparseAttentionError as error:
        raise SparseAttentionError(f"{label}: {error}") from None
    if len(node.input) > len(INPUT_NAMES):
        raise SparseAttentionError(f"{label}: has {len(node.input)} inputs, the operator takes {len(INPUT_NAMES)}")
    named = dict(zip(INPUT_NAMES, list(node.input) + [""] * (len(INPUT_NAMES) - len(node.input))))
    for name, value in named.items():
        if name not in OPTIONAL_INPUTS and not value:
            raise SparseAttentionError(f"{label}: input '{name}' is required")
    if bool(named["key"]) != bool(named["value"]):
        raise SparseAttentionError(f"{label}: inputs 'key' and 'value' must both be given, or both absent for packed QKV")
    if attributes.do_rotary and not (named["cos_cache"] and named["sin_cache"]):
        raise SparseAttentionError(f"{label}: inputs 'cos_cache' and 'sin_cache' are required when do_rotary = 1")
    float16 = _float_type(label, named, types) == TensorProto.FLOAT16
    for name in _INT_INPUTS:
        elem = types.get(named[name], TensorProto.INT32)
        if elem != TensorProto.INT32:
            raise SparseAttentionError(f"{label}: input '{name}' must be int32, got {TensorProto.DataType.Name(elem)}")
    layout = (named["block_row_indices"], named["block_col_indices"])
    if all(name in constants for name in layout):  # checked once here, not per call
        _check_constant_layout(label, layout, graphs)
    return NodePlan(node=node, attributes=attributes, node_key=node_key, settings=settings, float16=float16)


def _float_type(label: str, named: dict, types: dict) -> int:
    """The node's T: float32 or float16, the same for every float input ONNX can type."""
    seen = {}
    for name in FLOAT_INPUTS:
        if named[name] and named[name] in types:
            seen[name] = types[named[name]]
    for name, elem in seen.items():
        if elem not in (TensorProto.FLOAT, TensorProto.FLOAT16):
            raise SparseAttentionError(f"{label}: input '{name}' is {TensorProto.DataType.Name(elem)}; float32 and float16 are supported")
    kinds = set(seen.values())
    if len(kinds) > 1:
        detail = ", ".join(f"{n}: {TensorProto.DataType.Name(e)}" for n, e in seen.items())
        raise SparseAttentionError(f"{label}: float inputs must share one type T (the operator has one), got {detail}")
    return kinds.pop() if kinds else TensorProto.FLOAT


def _check_constant_layout(label: str, layout: tuple[str, str], graphs) -> None:
    arrays = {}
    for graph in graphs:
        arrays.update({init.name: init for init in graph.initializer})
        for node in graph.node:
            if node.op_type == "Constant" and node.output and node.output[0] in layout:
                arrays[node.output[0]] = next(a.t for a in node.attribute if a.name == "value")
    rows, cols = (numpy_helper.to_array(arrays[name]) for name in layout)
    try:
        if rows.ndim != 2 or cols.ndim != 2 or rows.shape[0] != cols.shape[0] or rows.shape[1] < 2:
            raise SparseAttentionError(f"layout shapes {rows.shape} and {cols.shape} are not (num_layout, max_blocks + 1) and (num_layout, max_nnz)")
        check_layout(rows, cols)
    except SparseAttentionError as error:
        raise SparseAttentionError(f"{label}: {error}") from None


#: The operator's layout inputs, by position.
LAYOUT_INPUTS = tuple(INPUT_NAMES.index(name) for name in ("block_row_indices", "block_col_indices"))


def load_constant_layouts(model: onnx.ModelProto, base_dir: str | os.PathLike) -> None:
    """Read into ``model`` (in place, stored inline from then on) the external data of every
    SparseAttention node's constant layout, for a model loaded without its external data:
    prepare_model checks those values, and they are small. Other weights stay in their files.

    The bytes are read here rather than by onnx's helper, which refuses a data file that is a
    symbolic link (as in a model hub's snapshot folder, where ORT itself reads them)."""
    visible: dict[str, onnx.TensorProto] = {}
    for graph in all_graphs(model.graph):
        # A subgraph sees its own initializers and those of the graphs around it.
        visible.update({init.name: init for init in graph.initializer})
        for node in graph.node:
            if not is_sparse_attention(node):
                continue
            for index in LAYOUT_INPUTS:
                tensor = visible.get(node.input[index]) if index < len(node.input) else None
                if tensor is not None and external_data_helper.uses_external_data(tensor):
                    _read_external(tensor, Path(base_dir))


def _read_external(tensor: onnx.TensorProto, base_dir: Path) -> None:
    """``tensor``'s external bytes, stored inline; a file outside ``base_dir``, or one too short,
    is named as the model's fault."""
    info = {entry.key: entry.value for entry in tensor.external_data}
    location = Path(info.get("location", ""))
    if not info.get("location") or location.is_absolute() or ".." in location.parts:
        raise SparseAttentionError(f"tensor '{tensor.name}': external data location {str(location)!r} must be a path inside the model's folder")
    offset, length = int(info.get("offset", 0)), info.get("length")
    try:
        with open(base_dir / location, "rb") as data:
            data.seek(offset)
            raw = data.read(int(length)) if length is not None else data.read()
    except OSError as error:
        raise SparseAttentionError(f"tensor '{tensor.name}': cannot read its external data {base_dir / location}: {error.strerror}") from None
    if length is not None and len(raw) != int(length):
        raise SparseAttentionError(f"tensor '{tensor.name}': {base_dir / location} holds {len(raw)} of its {length} bytes at offset {offset}")
    tensor.raw_data = raw
    tensor.data_location = onnx.TensorProto.DEFAULT
    del tensor.external_data[:]
