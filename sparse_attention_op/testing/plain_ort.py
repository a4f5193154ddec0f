"""Plain ONNX Runtime on CPU, the baseline ``run --compare-ort`` measures the bridge against.

ORT's SparseAttention (and GroupQueryAttention, as GenAI runs it) CPU kernel insists that
each past and its present are one buffer, so every such pair whose past is a graph input
and whose present is a graph output is bound to one copy of the fed past (IO binding), the
way ORT GenAI runs decoders. The caller's arrays are never written.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
import onnxruntime as ort

from sparse_attention_op.ort.graph import is_group_query_attention, is_sparse_attention


def shared_pairs(model: onnx.ModelProto) -> dict[str, str]:
    """present output name -> past input name, for every attention node whose past is a graph
    input and whose present is a graph output (key and value alike)."""
    inputs = {i.name for i in model.graph.input}
    outputs = {o.name for o in model.graph.output}
    pairs = {}
    for node in model.graph.node:
        if not (is_sparse_attention(node) or is_group_query_attention(node)):
            continue
        for past_index, present_index in ((3, 1), (4, 2)):
            if past_index < len(node.input) and present_index < len(node.output):
                past, present = node.input[past_index], node.output[present_index]
                if past in inputs and present in outputs:
                    pairs[present] = past
    return pairs


def run_plain_ort(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], path=None) -> dict[str, np.ndarray]:
    """Every graph output by name, computed by plain ORT on CPU with the pasts bound in place.
    ``path``: the model's file, which ORT then reads with its external weights (``model`` may
    then be its graph alone)."""
    source = str(path) if path is not None else model.SerializeToString()
    session = ort.InferenceSession(source, providers=["CPUExecutionProvider"])
    pairs = shared_pairs(model)
    # OrtValues borrow these arrays' memory: they must outlive the run.
    buffers = {past: np.array(feeds[past], copy=True) for past in set(pairs.values())}
    values = {past: ort.OrtValue.ortvalue_from_numpy(array) for past, array in buffers.items()}
    binding = session.io_binding()
    for graph_input in session.get_inputs():
        if graph_input.name in values:
            binding.bind_ortvalue_input(graph_input.name, values[graph_input.name])
        else:
            binding.bind_cpu_input(graph_input.name, np.ascontiguousarray(feeds[graph_input.name]))
    names = [o.name for o in session.get_outputs()]
    for name in names:
        if name in pairs:
            binding.bind_ortvalue_output(name, values[pairs[name]])
        else:
            binding.bind_output(name)
    session.run_with_iobinding(binding)
    results = binding.copy_outputs_to_cpu()
    return dict(zip(names, results))
