"""Small ONNX graphs with SparseAttention nodes, built with onnx.helper.

Used by the tests, the demo and ``scripts/export_test_graph.py``. Every model written
sets ``ir_version`` explicitly: onnx 1.23 writes IR 14 by default, which onnxruntime 1.30
refuses (docs/design.md section 2).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from sparse_attention_op.op.spec import DOMAIN, INPUT_NAMES, OP_TYPE, OUTPUT_NAMES

IR_VERSION = 10
OPSET = 17

_ELEM_TYPES = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16, np.dtype(np.int32): TensorProto.INT32}


def _value_info(name: str, dtype, rank_or_shape) -> onnx.ValueInfoProto:
    elem = _ELEM_TYPES[np.dtype(dtype)]
    shape = [None] * rank_or_shape if isinstance(rank_or_shape, int) else list(rank_or_shape)
    return helper.make_tensor_value_info(name, elem, shape)


def sparse_attention_model(
    attributes: Mapping[str, object],
    example_inputs: Mapping[str, np.ndarray],
    *,
    constants: tuple[str, ...] = (),
    float_dtype=np.float32,
    node_name: str = "sparse_attention",
    declare_ranks: bool = True,
    shapes: Mapping[str, Sequence[int | str | None]] | None = None,
) -> onnx.ModelProto:
    """A one-node model: graph inputs for every present input, outputs output/present_*.

    ``example_inputs`` supplies each present input's dtype and rank (values only for the
    names in ``constants``, which become initializers, e.g. the layout). Absent optional
    inputs (key/value for packed QKV, cos/sin without rotary) are left out of the node.
    With ``declare_ranks=False`` graph inputs carry no shape, so ONNX Runtime hands any
    tensor to the op (the validation tests use this to reach the op's own checks).
    ``shapes`` declares the shapes of the graph inputs and outputs it names (sizes, symbolic
    names, None for an unnamed dim); the others declare their rank alone.
    """
    shapes = shapes or {}

    def declared(name: str, dtype, rank: int) -> onnx.ValueInfoProto:
        return _value_info(name, dtype, shapes.get(name, rank))

    inputs, initializers, node_inputs = [], [], []
    for name in INPUT_NAMES:
        array = example_inputs.get(name)
        if array is None:
            node_inputs.append("")
            continue
        node_inputs.append(name)
        array = np.asarray(array)
        dtype = array.dtype if array.dtype == np.int32 else float_dtype
        if name in constants:
            initializers.append(numpy_helper.from_array(array.astype(dtype), name))
        else:
            inputs.append(
                declared(name, dtype, array.ndim) if declare_ranks else helper.make_tensor_value_info(name, _ELEM_TYPES[np.dtype(dtype)], None)
            )
    while node_inputs and not node_inputs[-1]:
        node_inputs.pop()
    node = helper.make_node(OP_TYPE, node_inputs, list(OUTPUT_NAMES), name=node_name, domain=DOMAIN, **dict(attributes))
    outputs = [declared("output", float_dtype, 3), declared("present_key", float_dtype, 4), declared("present_value", float_dtype, 4)]
    graph = helper.make_graph([node], "sparse_attention", inputs, outputs, initializers)
    # The checker insists on shapes for graph inputs; ONNX Runtime does not.
    return finish_model(graph, check=declare_ranks)


def finish_model(graph: onnx.GraphProto, check: bool = True) -> onnx.ModelProto:
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, 1)],
        ir_version=IR_VERSION,
        producer_name="sparse_attention_op",
    )
    if check:
        onnx.checker.check_model(model)
    return model
