"""Logits at the positions a generation samples from, not at every position of a prompt.

A decoder in the ORT GenAI convention computes ``logits`` (batch, sequence, vocab) for every
token it is fed. Generation reads one row per sequence: the last token's. For a prompt of 8k
tokens and Phi-3-small's vocabulary of 100352 that is 1.6 GB of float16 logits to compute
and, with the model on a GPU EP, to copy to the host, for 200 KB used.
:func:`trim_logits` rewrites the model so that the logits head sees only the chosen
positions: a ``Gather`` along the sequence, fed by one more graph input
(:data:`LOGITS_POSITIONS`, int64 (n,): positions within the call's tokens), in front of the
head's matrix product. The output becomes (batch, n, vocab), every row at every listed
position. A caller whose rows all end at one position (every decode step, a batch of equal
prompts) lists it once (n = 1); rows that end apart (a ragged batch's prompt) list one
position per row and read row ``b``'s logits at ``[b, b]``.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

#: The added input: per batch row, the position (within the call's tokens) whose logits to compute.
LOGITS_POSITIONS = "sao_logits_positions"
LOGITS = "logits"
_PASS_THROUGH = ("Cast", "Identity")
_HEADS = ("MatMul", "MatMulNBits")


def logits_head(model: onnx.ModelProto) -> int | None:
    """Index of the node that makes ``logits`` (a MatMul or MatMulNBits, through casts), or None."""
    graph = model.graph
    if LOGITS not in {o.name for o in graph.output} or any(i.name == LOGITS_POSITIONS for i in graph.input):
        return None
    producers = {output: index for index, node in enumerate(graph.node) for output in node.output}
    index = producers.get(LOGITS)
    while index is not None and graph.node[index].op_type in _PASS_THROUGH:
        index = producers.get(graph.node[index].input[0])
    return index if index is not None and graph.node[index].op_type in _HEADS else None


def trim_logits(model: onnx.ModelProto) -> None:
    """Rewrite ``model`` (in place) to compute its logits at :data:`LOGITS_POSITIONS` only.
    Raises ValueError where :func:`logits_head` finds no head (or the model is trimmed)."""
    index = logits_head(model)
    if index is None:
        raise ValueError(
            f"last_logits: the model has no output '{LOGITS}' made by a MatMul or MatMulNBits (through casts), or takes '{LOGITS_POSITIONS}' already"
        )
    graph = model.graph
    head = graph.node[index]
    rows = f"{head.name or 'logits_head'}/sao_positions"
    gather = helper.make_node("Gather", [head.input[0], LOGITS_POSITIONS], [rows], name=f"{head.name}/SaoGatherPositions", axis=1)
    head.input[0] = rows
    graph.node.insert(index, gather)
    graph.input.append(helper.make_tensor_value_info(LOGITS_POSITIONS, TensorProto.INT64, ["logits_positions"]))
    for output in graph.output:
        if output.name == LOGITS and len(output.type.tensor_type.shape.dim) == 3:
            output.type.tensor_type.shape.dim[1].dim_param = "logits_positions"
