"""One SparseAttention node, rewritten as native ONNX Runtime nodes around the bridge's ops.

The PyOp bridge copies every input into Python and every output back, so a node that took
past_key/past_value in and gave the presents out would move four cache-sized tensors per
call whatever the work (docs/design.md, "The graph around the op"). The rewrite keeps them
native:

    Shape x9, total, key_totals --> SparseAttentionPlan --> probe rows, rotary window, layouts, history rows, ticket
    fast:  past --Reshape(rows)--> Gather(probe rows) --> SparseAttentionCacheCheck (ticket) --> history rows F
    exact, or fast under a session that reads the pasts in place: F = the plan's history rows
           (an exact node digests every history row; the GPU checks the probes, read in place)
    past --Slice[0:F]--> history  \\
    cos/sin --Gather[positions]-->  > SparseAttentionKernel (ticket) --> output, new keys, indices
    layout --Slice[0:layouts]-->   /    query, key, value -------^
    output --Reshape--> output
    past, indices, new keys --ScatterND--> present_key
    past, indices, value rows (Reshape, Transpose of the input) --ScatterND--> present_value

Where a session reads the caller's pasts in place (pasts.py), the plan op sets F = 0 and the
probe rows to none: nothing history-sized copied. prepare_model's graphs, for any session,
keep the fast check op; create_session's leave it out for the nodes whose pasts it can read.

Bound to one buffer with past (IO binding, as ORT GenAI runs it), ScatterND writes in place:
no cache-sized copy at all. With plain ``run`` ScatterND copies the past into a fresh present
once, as ORT's own kernel does. Float16 nodes cast only what crosses to float32 (the
bridge cannot carry float16); the presents stay float16 and are scattered into directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .bridge import (
    BRIDGE_DOMAIN, CHECK_OP, KERNEL_OP, KV_CHECK_ATTRIBUTE, LAYOUT_ATTRIBUTE, NODE_KEY_ATTRIBUTE, PLAN_OP, STORAGE_ATTRIBUTE,
)
from .spec import INPUT_NAMES, SHAPED_INPUTS, OpAttributes

#: Initializer that stands in for an absent optional input (key/value when packed,
#: cos/sin without rotary): the bridge reads a (0,)-shaped tensor as absent.
ABSENT_FLOAT = "sao_absent_float"
ZERO, AXIS0, AXIS2 = "sao_zero", "sao_axis0", "sao_axis2"


def shared_initializers() -> list[onnx.TensorProto]:
    """Constants every rewritten node uses (added to the graph once)."""
    return [
        numpy_helper.from_array(np.zeros((0,), np.float32), ABSENT_FLOAT),
        numpy_helper.from_array(np.array([0], np.int64), ZERO),
        numpy_helper.from_array(np.array([0], np.int64), AXIS0),
        numpy_helper.from_array(np.array([2], np.int64), AXIS2),
    ]


@dataclass
class NodePlan:
    """What prepare_model decided about one node."""

    node: onnx.NodeProto
    attributes: OpAttributes
    node_key: str
    kv_check: str
    float16: bool
    constant_layout: bool
    #: The node's pasts are graph inputs of a session that reads them in place (pasts.py):
    #: a fast check's probe rows are read there and compared on the GPU during the kernel
    #: op's call (webgpu/executor.py), so the graph needs no probe Gathers and no check op.
    pasts_in_place: bool


@dataclass
class _Builder:
    prefix: str
    nodes: list = field(default_factory=list)
    initializers: list = field(default_factory=list)
    memo: dict = field(default_factory=dict)  # outputs built once and shared

    def name(self, suffix: str) -> str:
        return f"{self.prefix}/{suffix}"

    def add(self, op_type: str, inputs: list[str], outputs: list[str] | str, domain: str = "", exact: bool = False, **attributes) -> list[str] | str:
        """A node; its outputs are named under this node's prefix, or as given with ``exact``."""
        names = [outputs] if isinstance(outputs, str) else outputs
        names = list(names) if exact else [self.name(n) for n in names]
        self.nodes.append(helper.make_node(op_type, inputs, names, name=self.name(f"{op_type}_{len(self.nodes)}"), domain=domain, **attributes))
        return names[0] if isinstance(outputs, str) else names

    def constant(self, suffix: str, values) -> str:
        name = self.name(suffix)
        self.initializers.append(numpy_helper.from_array(np.asarray(values, np.int64), name))
        return name

    def float32(self, name: str, float16: bool) -> str:
        """``name`` as float32 (a Cast when the node keeps float16 tensors)."""
        return self.add("Cast", [name], f"{name.split('/')[-1]}_f32_{len(self.nodes)}", to=TensorProto.FLOAT) if float16 else name


def expand(plan: NodePlan) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """The native nodes and private initializers that replace ``plan.node``."""
    node, attrs = plan.node, plan.attributes
    inputs = dict(zip(INPUT_NAMES, list(node.input) + [""] * (len(INPUT_NAMES) - len(node.input))))
    packed = not inputs["key"]
    for name in ("key", "value", "cos_cache", "sin_cache"):
        inputs[name] = inputs[name] or ABSENT_FLOAT
    outputs = list(node.output) + [""] * (3 - len(node.output))
    b = _Builder(prefix=f"sao/{plan.node_key.split('/', 1)[1]}")
    op_attributes = dict(
        num_heads=attrs.num_heads, kv_num_heads=attrs.kv_num_heads, sparse_block_size=attrs.sparse_block_size, scale=float(attrs.scale),
        do_rotary=int(attrs.do_rotary), rotary_interleaved=int(attrs.rotary_interleaved),
        **{NODE_KEY_ATTRIBUTE: plan.node_key, STORAGE_ATTRIBUTE: "float16" if plan.float16 else "float32",
           KV_CHECK_ATTRIBUTE: plan.kv_check, LAYOUT_ATTRIBUTE: "constant" if plan.constant_layout else "per_call"},
    )
    f16 = plan.float16
    lengths = [inputs["total_sequence_length"], inputs["key_total_sequence_lengths"]]

    shapes = [b.add("Shape", [inputs[name]], f"shape_{name}") for name in SHAPED_INPUTS]
    # The ticket hands the plan's validated call shape to the later ops (bridge.tickets).
    probe_rows, positions, layouts, past_rows_shape, split_shape, output_shape, all_history, ticket = b.add(
        PLAN_OP, shapes + lengths,
        ["probe_rows", "positions", "layouts", "past_rows_shape", "split_shape", "output_shape", "all_history_rows", "ticket"],
        domain=BRIDGE_DOMAIN, **op_attributes)

    if plan.kv_check == "fast" and not plan.pasts_in_place:
        probes = []
        for name in ("past_key", "past_value"):
            flat = b.add("Reshape", [inputs[name], past_rows_shape], f"{name}_rows")
            probes.append(b.float32(b.add("Gather", [flat, probe_rows], f"{name}_probes", axis=0), f16))
        history_rows = b.add(CHECK_OP, probes + [ticket], "history_rows", domain=BRIDGE_DOMAIN, **op_attributes)
    else:
        # The exact check digests every history row, and where a session reads the pasts in
        # place the GPU checks a fast node's probes during the kernel op's call: one PyOp
        # and four native nodes fewer per call. Where that session cannot read a call's
        # pasts in place after all (pasts.py says when), the whole history crosses and is
        # checked exactly.
        history_rows = all_history
    history = [b.float32(b.add("Slice", [inputs[name], ZERO, history_rows, AXIS2], f"{name}_history"), f16) for name in ("past_key", "past_value")]

    if attrs.do_rotary:
        rotary = [b.float32(b.add("Gather", [inputs[name], positions], f"{name}_rows", axis=0), f16) for name in ("cos_cache", "sin_cache")]
    else:
        rotary = [ABSENT_FLOAT, ABSENT_FLOAT]
    layout = [b.add("Slice", [inputs[name], ZERO, layouts, AXIS0], f"{name}_sent") for name in ("block_row_indices", "block_col_indices")]
    query, key, value = (b.float32(inputs[name], f16 and inputs[name] != ABSENT_FLOAT) for name in ("query", "key", "value"))
    attention, rotated_keys, indices = b.add(
        KERNEL_OP, [query, key, value] + history + layout + rotary + [ticket], ["attention", "rotated_keys", "scatter_indices"],
        domain=BRIDGE_DOMAIN, **op_attributes)

    # The output through a native Reshape to its full size: a refused call's short output
    # fails here, and a wrongly bound output is a native node's error, not an abort.
    if outputs[0]:
        if f16:
            b.add("Cast", [b.add("Reshape", [attention, output_shape], "output_f32")], outputs[0], exact=True, to=TensorProto.FLOAT16)
        else:
            b.add("Reshape", [attention, output_shape], outputs[0], exact=True)

    new_values = _new_rows(b, inputs, attrs, packed, "value", split_shape)
    new_keys = b.add("Cast", [rotated_keys], "rotated_keys_f16", to=TensorProto.FLOAT16) if attrs.do_rotary and f16 else rotated_keys
    if not attrs.do_rotary:
        new_keys = _new_rows(b, inputs, attrs, packed, "key", split_shape)
    for index, (past, rows) in enumerate(((inputs["past_key"], new_keys), (inputs["past_value"], new_values)), start=1):
        if outputs[index]:
            b.add("ScatterND", [past, indices, rows], outputs[index], exact=True)
    return b.nodes, b.initializers


def _new_rows(b: _Builder, inputs: dict, attrs: OpAttributes, packed: bool, which: str, split_shape: str) -> str:
    """This call's key or value rows as (batch, kv heads, sequence, head), in the input's dtype.

    ``split_shape`` (from the plan op) is (batch, sequence, heads in the input, head size)."""
    if packed:
        if "qkv_heads" not in b.memo:
            b.memo["qkv_heads"] = b.add("Reshape", [inputs["query"], split_shape], "qkv_heads")
        heads = b.memo["qkv_heads"]
        first = attrs.num_heads + (attrs.kv_num_heads if which == "value" else 0)
        rows = b.add("Slice", [heads, b.constant(f"{which}_first", [first]), b.constant(f"{which}_end", [first + attrs.kv_num_heads]),
                               AXIS2], f"{which}_heads")
    else:
        rows = b.add("Reshape", [inputs[which], split_shape], f"{which}_heads")
    return b.add("Transpose", [rows], f"new_{which}", perm=[0, 2, 1, 3])
