"""What a model holds and where it would run (the ``inspect`` command).

For each SparseAttention node: its attributes and the inputs as the model declares them
(dtype, shape with symbolic dims, and whether a graph input, a constant or computed). For
each layout: the density of every layout (selected causal blocks over all causal blocks,
read with ORT's CSR rules, reference.block_mask) when the CSR is constant, "per call"
when it is not. The placement: SparseAttention runs on WebGPU through the bridge's op;
every other node stays on ONNX Runtime's CPU kernels, counted by op type. And the
verdict: whether create_session loads the model, or the rule that makes it refuse.
"""

from __future__ import annotations

import collections
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import external_data_helper, numpy_helper

from sparse_attention_op.generation.model_files import ModelFiles
from sparse_attention_op.op.spec import INPUT_NAMES, OUTPUT_NAMES, SparseAttentionError
from sparse_attention_op.ort.graph import TensorInfo, all_nodes, constant_tensors, declared_tensors, is_sparse_attention, node_attributes
from sparse_attention_op.ort.model import load_constant_layouts, prepare_model

WEBGPU = "WebGPU (SparseAttention through this package's op)"
ORT_CPU = "ONNX Runtime CPU"
ORT_WEBGPU = "ONNX Runtime WebGPU EP"
#: The session's EP names as the report shows them.
_EP_LABELS = {"CPUExecutionProvider": ORT_CPU, "WebGpuExecutionProvider": ORT_WEBGPU}


@dataclass
class LayoutInfo:
    """One CSR layout (the pair of tensors), as shared by the nodes that read it."""

    block_row_indices: str
    block_col_indices: str
    constant: bool
    nodes: list[str]
    sparse_block_size: int
    num_layout: int | None = None
    max_blocks: int | None = None
    density: list[float] | None = None  # per layout: selected causal blocks / causal blocks

    @property
    def summary(self) -> str:
        if not self.constant:
            return "per call (the CSR is a graph input or computed: its density is known only when it runs)"
        if len(self.density) <= 8:
            densities = ", ".join(f"{d:.3f}" for d in self.density)
        else:  # Phi-3-small has 32: the spread says enough (--json lists each)
            densities = f"{min(self.density):.3f} to {max(self.density):.3f}, mean {np.mean(self.density):.3f}"
        return (
            f"{self.num_layout} layout(s) of {self.max_blocks} block rows x {self.sparse_block_size} tokens; "
            f"density (selected/causal blocks): {densities}"
        )


@dataclass
class NodeInfo:
    name: str
    attributes: dict
    inputs: list[TensorInfo]  # one per operator slot that is given, slot name first
    outputs: list[TensorInfo]
    layout: int | None  # index into ModelReport.layouts


@dataclass
class ModelReport:
    path: str
    ir_version: int
    opsets: dict[str, int]
    genai: dict | None
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    nodes: list[NodeInfo]
    layouts: list[LayoutInfo]
    placement: dict[str, dict[str, int]] = field(default_factory=dict)  # device -> op type -> count
    refused: str | None = None  # why create_session would refuse the model; None: it loads it

    def to_dict(self) -> dict:
        return asdict(self)


def inspect_model(model: onnx.ModelProto, files: ModelFiles, ep: str = "cpu") -> ModelReport:
    """The report of ``model`` (loaded from ``files``; external weights need not be loaded).
    ``ep="webgpu"``: the placement is ORT's own, from a session with that EP, for a model
    create_session loads (one it refuses shows the static placement beside the reason)."""
    graph = model.graph
    refused = refusal(model, Path(files.onnx_path).parent)
    declared = declared_tensors(model)
    constants = constant_tensors(graph)
    graph_inputs = {i.name for i in graph.input} - set(constants)
    layouts: dict[tuple[str, str], LayoutInfo] = {}
    nodes = []
    for node in all_nodes(graph):
        if not is_sparse_attention(node):
            continue
        attributes = {name: _plain(value) for name, value in node_attributes(node).items()}
        named = dict(zip(INPUT_NAMES, node.input))
        inputs = []
        for slot, tensor in named.items():
            if tensor:
                info = declared.get(tensor, TensorInfo(tensor, "?", None))
                kind = "constant" if tensor in constants else "graph input" if tensor in graph_inputs else "computed"
                inputs.append(TensorInfo(_slot_label(slot, tensor), info.dtype, info.shape, kind))
        outputs = [
            TensorInfo(_slot_label(slot, tensor), *_dtype_shape(declared, tensor)) for slot, tensor in zip(OUTPUT_NAMES, node.output) if tensor
        ]
        layout_index = None
        pair = (named.get("block_row_indices", ""), named.get("block_col_indices", ""))
        if all(pair):
            if pair not in layouts:
                layouts[pair] = _layout(pair, constants, int(attributes.get("sparse_block_size", 0)), Path(files.onnx_path).parent)
            layouts[pair].nodes.append(node.name)
            layout_index = list(layouts).index(pair)
        nodes.append(NodeInfo(node.name, attributes, inputs, outputs, layout_index))
    return ModelReport(
        path=str(files.onnx_path),
        ir_version=model.ir_version,
        opsets={op.domain or "ai.onnx": op.version for op in model.opset_import},
        genai=_genai_summary(files),
        inputs=[declared.get(i.name, TensorInfo(i.name, "?", None)) for i in graph.input if i.name in graph_inputs],
        outputs=[declared.get(o.name, TensorInfo(o.name, "?", None)) for o in graph.output],
        nodes=nodes,
        layouts=list(layouts.values()),
        placement=placement(graph) if ep == "cpu" or refused else session_placement(files.onnx_path, ep),
        refused=refused,
    )


def refusal(model: onnx.ModelProto, base_dir: Path) -> str | None:
    """Why create_session would refuse ``model`` (the model-level rules prepare_model applies:
    attributes, input types, constant layouts), or None. Layouts kept in external files are
    read for it; other weights are not."""
    checked = onnx.ModelProto()
    checked.CopyFrom(model)
    load_constant_layouts(checked, base_dir)
    try:
        prepare_model(checked)
    except SparseAttentionError as error:
        return str(error)
    return None


def placement(graph: onnx.GraphProto) -> dict[str, dict[str, int]]:
    """Node counts by op type on each side: SparseAttention on WebGPU, the rest on ORT's CPU
    kernels (op types of other domains carry their domain, e.g. com.microsoft.GroupQueryAttention)."""
    sides = {WEBGPU: collections.Counter(), ORT_CPU: collections.Counter()}
    for node in all_nodes(graph):
        op = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"
        sides[WEBGPU if is_sparse_attention(node) else ORT_CPU][op] += 1
    return {side: dict(counts.most_common()) for side, counts in sides.items()}


def session_placement(model_path, ep: str) -> dict[str, dict[str, int]]:
    """Node counts by op type on each side, as a session with ``ep`` assigns them (ORT's own
    record of its partitioning; the copies ORT adds between devices are not nodes of it)."""
    import onnxruntime as ort

    from sparse_attention_op.ort.bridge import OP_TYPES
    from sparse_attention_op.ort.session import create_session

    options = ort.SessionOptions()
    options.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    session = create_session(model_path, options, ep=ep)
    ours = set(OP_TYPES.values())
    sides = {WEBGPU: collections.Counter()}
    for subgraph in session.get_provider_graph_assignment_info():
        for node in subgraph.get_nodes():
            if node.op_type in ours:
                sides[WEBGPU]["com.microsoft.SparseAttention"] += 1
                continue
            op = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"
            sides.setdefault(_EP_LABELS.get(subgraph.ep_name, subgraph.ep_name), collections.Counter())[op] += 1
    return {side: dict(counts.most_common()) for side, counts in sides.items()}


def format_report(report: ModelReport) -> str:
    """The report as text: header, graph inputs/outputs, nodes, layouts, placement."""
    from sparse_attention_op.cli.tables import format_table

    opsets = ", ".join(f"{domain} {version}" for domain, version in report.opsets.items())
    lines = [f"model: {report.path} (IR {report.ir_version}; opsets {opsets})"]
    if report.genai:
        lines.append("genai_config.json: " + ", ".join(f"{k} {v}" for k, v in report.genai.items()))
    lines += ["", "graph inputs:", format_table(["name", "dtype", "shape"], [[t.name, t.dtype, t.shape_text] for t in report.inputs], "  ")]
    lines += ["", "graph outputs:", format_table(["name", "dtype", "shape"], [[t.name, t.dtype, t.shape_text] for t in report.outputs], "  ")]
    lines += ["", f"SparseAttention nodes: {len(report.nodes)}"]
    shown = None  # the last node printed in full; a decoder's layers mostly repeat it
    for node in report.nodes:
        attributes = " ".join(f"{k}={v}" for k, v in node.attributes.items())
        if shown is not None and _same_signature(node, shown):
            lines.append(f"  {node.name or '(unnamed)'}: as {shown.name or '(unnamed)'} (same attributes, input types and layout)")
            continue
        shown = node
        lines += ["", f"  {node.name or '(unnamed)'}: {attributes}"]
        rows = [[t.name, t.dtype, t.shape_text, t.kind] for t in node.inputs] + [[t.name, t.dtype, t.shape_text, "output"] for t in node.outputs]
        lines.append(format_table(["slot: tensor", "dtype", "shape", "source"], rows, "    "))
        if node.layout is not None:
            lines.append(f"    layout: {node.layout} (below)")
    if report.layouts:
        lines += ["", "layouts:"]
        for index, layout in enumerate(report.layouts):
            lines.append(f"  {index}: {layout.block_row_indices} / {layout.block_col_indices}, read by {len(layout.nodes)} node(s): {layout.summary}")
    lines += ["", "what runs where:"]
    for side, counts in report.placement.items():
        total = sum(counts.values())
        detail = ", ".join(f"{op} {n}" for op, n in counts.items())
        lines.append(f"  {side}: {total} node(s)" + (f": {detail}" if detail else ""))
    verdict = "loads this model" if report.refused is None else f"refuses this model: {report.refused}"
    lines += ["", f"create_session {verdict}"]
    return "\n".join(lines)


# -- helpers ----------------------------------------------------------------------------


def _same_signature(node: NodeInfo, other: NodeInfo) -> bool:
    """Same attributes, slots, dtypes, shapes, sources and layout: only tensor names differ."""

    def signature(n: NodeInfo):
        # Shape inference stops at the first contrib op, so computed tensors of later layers
        # lose their shapes: only what the graph itself fixes is compared.
        slots = [(t.name.split(":")[0], t.dtype, t.shape_text if t.kind in ("graph input", "constant") else "", t.kind) for t in n.inputs]
        return n.attributes, slots, n.layout

    return signature(node) == signature(other)


def _slot_label(slot: str, tensor: str) -> str:
    """``slot: tensor``, or the slot alone where the tensor carries the slot's own name."""
    return slot if slot == tensor else f"{slot}: {tensor}"


def _plain(value):
    """An attribute value as JSON can hold it."""
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (int, float, str)):
        return value
    return repr(value)


def _dtype_shape(declared: dict, name: str) -> tuple[str, list | None]:
    info = declared.get(name)
    return (info.dtype, info.shape) if info else ("?", None)


def _layout(pair: tuple[str, str], constants: dict, block_size: int, base_dir: Path) -> LayoutInfo:
    from sparse_attention_op.op.reference import block_mask

    info = LayoutInfo(pair[0], pair[1], all(name in constants for name in pair), [], block_size)
    if not info.constant:
        return info
    arrays = []
    for name in pair:
        tensor = constants[name]
        if external_data_helper.uses_external_data(tensor) and not tensor.HasField("raw_data"):
            tensor = onnx.TensorProto.FromString(tensor.SerializeToString())  # the model itself stays unchanged
            external_data_helper.load_external_data_for_tensor(tensor, str(base_dir))
        arrays.append(numpy_helper.to_array(tensor))
    rows, cols = arrays
    mask = block_mask(rows, cols)
    blocks = mask.shape[1]
    causal = np.tril(np.ones((blocks, blocks), dtype=bool))
    info.num_layout, info.max_blocks = int(mask.shape[0]), int(blocks)
    info.density = [float((m & causal).sum() / causal.sum()) for m in mask]
    return info


def _genai_summary(files: ModelFiles) -> dict | None:
    """What a GenAI folder's config says about the decoder (the keys that exist)."""
    if files.genai_config is None:
        return None
    model = files.genai_config.get("model") or {}
    decoder = files.decoder_config
    summary = {"decoder": decoder.get("filename")}
    for key in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_size", "hidden_size"):
        if key in decoder:
            summary[key] = decoder[key]
    for key in ("vocab_size", "context_length", "eos_token_id", "pad_token_id"):
        if key in model:
            summary[key] = model[key]
    search = files.genai_config.get("search") or {}
    if "past_present_share_buffer" in search:
        summary["past_present_share_buffer"] = search["past_present_share_buffer"]
    return summary
