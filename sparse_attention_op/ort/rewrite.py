"""One SparseAttention node, rewritten as the bridge's op.

The bridge's op (bridge.py) takes the operator's eleven inputs and gives its three outputs
as they are, so the rewrite changes only what names the node's implementation: the op type
and domain (``ai.onnx.contrib::SparseAttentionWebGPU``, or ``...Float16`` for a float16
node), and the attributes that say which GPU state the node owns (its identity) and how it
which settings its session chose. The graph around it, and its inputs and outputs, stay as the
model has them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from sparse_attention_op.op.spec import OpAttributes
from sparse_attention_op.ort.bridge import BRIDGE_DOMAIN, NODE_KEY_ATTRIBUTE, OP_TYPES, SETTINGS_ATTRIBUTE
from sparse_attention_op.settings import SessionSettings


@dataclass
class NodePlan:
    """What prepare_model decided about one node."""

    node: onnx.NodeProto
    attributes: OpAttributes
    node_key: str
    settings: SessionSettings
    float16: bool


def expand(plan: NodePlan) -> onnx.NodeProto:
    """The bridge's node that replaces ``plan.node``."""
    node = plan.node
    return helper.make_node(
        OP_TYPES[np.dtype(np.float16 if plan.float16 else np.float32)],
        list(node.input),
        list(node.output),
        name=node.name,
        domain=BRIDGE_DOMAIN,
        **plan.attributes.node_attributes(),
        **{NODE_KEY_ATTRIBUTE: plan.node_key, SETTINGS_ATTRIBUTE: plan.settings.to_attribute()},
    )
