"""Feeds for one run of any model: random ones that the model accepts, or checked given ones.

Random feeds are of unit scale (tiny inputs make every softmax uniform and hide the faults a
run is for) and every row has one length: ORT's CPU kernel is wrong for rows of different
lengths (docs/design.md section 1), and ``run --compare-ort`` compares against it.

What each graph input gets:

* inputs read directly by a SparseAttention node: what the operator's contract asks, from
  the node's attributes and the declared shapes (inputs.py, layouts.py): lengths for a
  prompt of ``seq`` tokens after ``past`` history rows, a Phi-3-small style layout where the
  layout is a graph input, the usual RoPE tables for cos/sin;
* the ORT GenAI decoder convention: ``input_ids`` (ids below the vocabulary size),
  ``attention_mask`` (ones over past + seq), ``position_ids`` (past .. past + seq - 1);
  ``past_key_values.*`` and other float inputs: standard normal draws;
* GroupQueryAttention's ``seqlens_k`` / ``total_sequence_length`` when they are graph inputs;
* any other integer input: zeros (named in the notes, since zeros may not be what it wants).

Symbolic dimensions are sized by role first (batch, the query's sequence, a cache's rows),
then by name (``batch*``, ``total*``, ``past*``, ``seq*``), and ``dims`` overrides any by name.
A cache's rows default to past + seq, the fewest the attention ops accept.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from sparse_attention_op.op.layouts import mask_to_csr, phi3_small_mask
from sparse_attention_op.op.spec import INPUT_NAMES
from sparse_attention_op.ort.graph import declared_head_size, declared_tensors, is_group_query_attention, is_sparse_attention, node_attributes
from sparse_attention_op.testing.inputs import rotary_caches

#: GroupQueryAttention's input slots that matter here (ORT contrib schema).
_GQA_SLOTS = {3: "past_key", 4: "past_value", 5: "seqlens_k", 6: "total_sequence_length"}


class FeedError(ValueError):
    """Feeds cannot be made for, or do not fit, the model; the message says which input and why."""


@dataclass
class FeedSettings:
    batch: int = 1
    seq: int = 8  # new tokens per row
    past: int = 0  # history rows per row before them (0: a prompt)
    capacity: int | None = None  # rows of each KV cache input; None: past + seq
    head_size: int | None = None  # for SparseAttention inputs that declare no shape at all
    dims: dict[str, int] = field(default_factory=dict)  # symbolic dim name -> size, overriding the rest
    seed: int = 0

    def validate(self) -> None:
        for name in ("batch", "seq"):
            if getattr(self, name) < 1:
                raise FeedError(f"--{name} must be at least 1, got {getattr(self, name)}")
        if self.past < 0:
            raise FeedError(f"--past must be >= 0, got {self.past}")
        if self.capacity is not None and self.capacity < self.total:
            raise FeedError(f"--capacity {self.capacity} must hold past + seq = {self.total} rows")
        if self.head_size is not None and self.head_size < 1:
            raise FeedError(f"--head-size must be positive, got {self.head_size}")
        for name, size in self.dims.items():
            if size < 0:
                raise FeedError(f"--dim {name}={size}: sizes must be >= 0")

    @property
    def total(self) -> int:
        return self.past + self.seq

    @property
    def cache_rows(self) -> int:
        return self.capacity if self.capacity is not None else self.total


@dataclass(frozen=True)
class _Use:
    """One graph input read by an attention node: the node's attributes and facts, the slot."""

    attributes: dict
    slot: str
    packed: bool  # the node takes packed QKV (no key input)
    head_size: int | None  # from what the model declares or infers; None: unknown


def npz_path(path: Path) -> Path:
    """The file np.savez writes for ``path``: its own rule adds .npz where the name lacks it."""
    return Path(path) if str(path).endswith(".npz") else Path(f"{path}.npz")


def random_feeds(model: onnx.ModelProto, settings: FeedSettings, vocab_size: int | None = None) -> tuple[dict[str, np.ndarray], list[str]]:
    """(feeds by graph input name, notes on choices the caller should know about)."""
    settings.validate()
    rng = np.random.default_rng(settings.seed)
    graph = model.graph
    _check_dim_names(graph, settings)
    initializers = {init.name for init in graph.initializer}
    uses = _attention_uses(model)
    feeds, notes = {}, []
    for graph_input in graph.input:
        if graph_input.name in initializers:
            continue  # an initializer that may be overridden: its value is the model's
        tensor_type = graph_input.type.tensor_type
        if not graph_input.type.HasField("tensor_type"):
            raise FeedError(f"graph input '{graph_input.name}' is not a tensor; pass --feeds")
        dtype = helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
        use = uses.get(graph_input.name)
        shape = _shape(graph_input, use, settings, notes)
        feeds[graph_input.name] = _value(graph_input.name, dtype, shape, use, settings, rng, graph, vocab_size, notes)
    declared = sorted({use.head_size for use in uses.values() if use.head_size})
    if settings.head_size is not None and declared and declared != [settings.head_size]:
        notes.append(f"--head-size {settings.head_size} does not apply: the model declares head size {', '.join(map(str, declared))}")
    return feeds, notes


def _check_dim_names(graph: onnx.GraphProto, settings: FeedSettings) -> None:
    """A --dim the graph inputs never name would be ignored: a typo, most likely."""
    named = {
        dim.dim_param
        for graph_input in graph.input
        if graph_input.type.tensor_type.HasField("shape")
        for dim in graph_input.type.tensor_type.shape.dim
        if dim.dim_param
    }
    unknown = sorted(set(settings.dims) - named)
    if unknown:
        listed = ", ".join(sorted(named)) or "none"
        raise FeedError(f"--dim {unknown[0]}: no graph input has a dim of that name (the named dims: {listed})")


def check_feeds(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], source: str) -> dict[str, np.ndarray]:
    """``feeds`` (from ``source``, for messages) if they name exactly the graph's inputs, with
    the declared dtypes, ranks and fixed dims; raise :class:`FeedError` naming the first misfit."""
    initializers = {init.name for init in model.graph.initializer}
    declared = {i.name: i for i in model.graph.input}
    required = [name for name in declared if name not in initializers]
    missing = [name for name in required if name not in feeds]
    if missing:
        raise FeedError(f"{source} lacks graph input(s) {', '.join(map(repr, missing))}")
    unknown = [name for name in feeds if name not in declared]
    if unknown:
        raise FeedError(f"{source} holds {', '.join(map(repr, unknown))}, not graph input(s) of the model (it takes {', '.join(required)})")
    checked = {}
    for name, array in feeds.items():
        array = np.asarray(array)
        tensor_type = declared[name].type.tensor_type
        want = helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
        if array.dtype != want:
            raise FeedError(f"{source}: '{name}' is {array.dtype}, the model declares {want}")
        if tensor_type.HasField("shape"):
            dims = tensor_type.shape.dim
            if array.ndim != len(dims):
                raise FeedError(f"{source}: '{name}' has shape {array.shape}, the model declares rank {len(dims)}")
            for axis, dim in enumerate(dims):
                if dim.HasField("dim_value") and dim.dim_value != array.shape[axis]:
                    raise FeedError(f"{source}: '{name}' has shape {array.shape}, the model declares {dim.dim_value} at axis {axis}")
        checked[name] = array
    return checked


def history_lengths(feeds: Mapping[str, np.ndarray]) -> np.ndarray | None:
    """Rows of history each batch row holds after the run (past + new tokens): from the
    mask's sums or the key totals the feeds give; None when they give neither. Cache rows
    at and beyond these are junk by the operators' contract (docs/design.md section 1)."""
    for name, array in feeds.items():
        array = np.asarray(array)
        if name == "attention_mask" and array.ndim == 2:
            return array.sum(axis=1).astype(np.int64)
    for name, array in feeds.items():
        if name.endswith("key_total_sequence_lengths"):
            return np.asarray(array).reshape(-1).astype(np.int64)
    return None


def ragged_rows(feeds: Mapping[str, np.ndarray]) -> bool:
    """Whether the feeds give rows of different lengths (key totals or mask sums differ):
    ORT's CPU kernel gets those wrong, so a comparison against it is expected to differ."""
    for name, array in feeds.items():
        array = np.asarray(array)
        if name.endswith("key_total_sequence_lengths") and array.size > 1 and len(np.unique(array)) > 1:
            return True
        if name == "attention_mask" and array.ndim == 2 and len(np.unique(array.sum(axis=1))) > 1:
            return True
    return False


# -- roles ------------------------------------------------------------------------------


def _attention_uses(model: onnx.ModelProto) -> dict[str, _Use]:
    """Graph inputs read directly by a SparseAttention or GroupQueryAttention node, by name."""
    declared = declared_tensors(model)
    uses = {}
    for node in model.graph.node:
        if is_sparse_attention(node):
            slots = dict(enumerate(INPUT_NAMES))
        elif is_group_query_attention(node):
            slots = _GQA_SLOTS
        else:
            continue
        attributes = node_attributes(node)
        packed = len(node.input) < 2 or not node.input[1]
        head_size = declared_head_size(node, declared)
        for index, tensor in enumerate(node.input):
            if tensor and index in slots:
                uses.setdefault(tensor, _Use(attributes, slots[index], packed, head_size))
    return uses


def _shape(graph_input: onnx.ValueInfoProto, use: _Use | None, settings: FeedSettings, notes: list[str]) -> tuple[int, ...]:
    tensor_type = graph_input.type.tensor_type
    if tensor_type.HasField("shape"):
        dims = list(tensor_type.shape.dim)
    elif use is not None:
        dims = [None] * _SLOT_RANKS.get(use.slot, 0)
    else:
        raise FeedError(f"graph input '{graph_input.name}' declares no shape; pass --feeds")
    role_sizes = _role_sizes(graph_input, use, len(dims), settings)
    shape = []
    for axis, dim in enumerate(dims):
        if dim is not None and dim.HasField("dim_value"):
            shape.append(dim.dim_value)
            cache_rows_axis = use is not None and use.slot in ("past_key", "past_value") and axis == 2
            if cache_rows_axis and settings.capacity not in (None, dim.dim_value):  # None: --capacity not given
                notes.append(
                    f"--capacity {settings.capacity} does not apply to '{graph_input.name}': the model fixes its axis {axis} at {dim.dim_value} rows"
                )
            continue
        name = dim.dim_param if dim is not None else ""
        if name in settings.dims:
            shape.append(settings.dims[name])
            if role_sizes.get(axis) not in (None, settings.dims[name]):
                notes.append(
                    f"--dim {name}={settings.dims[name]} sizes axis {axis} of '{graph_input.name}', where the other "
                    f"options would give {role_sizes[axis]}"
                )
        elif role_sizes.get(axis) is not None:
            shape.append(role_sizes[axis])
        elif _by_name(name, settings) is not None:
            shape.append(_by_name(name, settings))
        else:
            label = f"dim '{name}'" if name else "an unnamed dim"
            hint = f"pass --dim {name}=N" if name else "pass --feeds"
            if use is not None and use.slot in ("query", "key", "value", "past_key", "past_value", "cos_cache", "sin_cache"):
                hint += ", or --head-size N (the model does not say its head size)"
            raise FeedError(f"cannot size {label} (axis {axis}) of graph input '{graph_input.name}': {hint}")
    return tuple(shape)


_SLOT_RANKS = {
    "query": 3,
    "key": 3,
    "value": 3,
    "past_key": 4,
    "past_value": 4,
    "block_row_indices": 2,
    "block_col_indices": 2,
    "total_sequence_length": 1,
    "key_total_sequence_lengths": 1,
    "cos_cache": 2,
    "sin_cache": 2,
    "seqlens_k": 1,
}


def _by_name(name: str, settings: FeedSettings) -> int | None:
    lowered = name.lower()
    if "batch" in lowered:
        return settings.batch
    if "total" in lowered:
        return settings.total
    if "past" in lowered or "max" in lowered or "cache" in lowered:
        return settings.cache_rows
    if "seq" in lowered:
        return settings.seq
    return None


def _role_sizes(graph_input, use: _Use | None, rank: int, settings: FeedSettings) -> dict[int, int | None]:
    """Sizes the input's role fixes, by axis (None where the role does not say)."""
    name = graph_input.name
    if use is None:
        if name in ("input_ids", "position_ids") and rank == 2:
            return {0: settings.batch, 1: settings.seq}
        if name == "attention_mask" and rank == 2:
            return {0: settings.batch, 1: settings.total}
        return {}
    attributes, slot = use.attributes, use.slot
    heads, kv_heads = int(attributes.get("num_heads", 0)), int(attributes.get("kv_num_heads", 0))
    head_size = _head_size(use, settings)
    if slot == "query":
        width = None if head_size is None else head_size * (heads + (2 * kv_heads if use.packed else 0))
        return {0: settings.batch, 1: settings.seq, 2: width}
    if slot in ("key", "value"):
        return {0: settings.batch, 1: settings.seq, 2: None if head_size is None else head_size * kv_heads}
    if slot in ("past_key", "past_value"):
        return {0: settings.batch, 1: kv_heads, 2: settings.cache_rows, 3: head_size}
    if slot in ("key_total_sequence_lengths", "seqlens_k"):
        return {0: settings.batch}
    if slot == "total_sequence_length":
        return {0: 1}
    if slot in ("cos_cache", "sin_cache"):
        return {0: settings.cache_rows, 1: None if head_size is None else head_size // 2}
    if slot in ("block_row_indices", "block_col_indices"):
        blocks = _layout_blocks(use, settings)
        if slot == "block_row_indices":
            return {0: _layout_count(heads), 1: blocks + 1}
        return {0: _layout_count(heads), 1: _layout_csr(_layout_count(heads), blocks)[1].shape[1]}
    return {}


def _head_size(use: _Use, settings: FeedSettings) -> int | None:
    """The node's head size as the model declares it, else ``settings.head_size``."""
    return use.head_size or settings.head_size


def _layout_count(heads: int) -> int:
    """Layouts for a layout that is a graph input: two where the heads split evenly (so that
    heads see different layouts), else one."""
    return 2 if heads % 2 == 0 else 1


def _value(name, dtype, shape, use, settings, rng, graph, vocab_size, notes) -> np.ndarray:
    slot = use.slot if use is not None else None
    total = settings.total
    if slot == "total_sequence_length":
        return np.full(shape, total, dtype)
    if slot == "key_total_sequence_lengths":
        return np.full(shape, total, dtype)
    if slot == "seqlens_k":
        return np.full(shape, total - 1, dtype)
    if slot == "block_row_indices":
        return _layout_csr(shape[0], shape[1] - 1)[0].astype(dtype)
    if slot == "block_col_indices":
        # The same layout as the rows input's (sized the same way); a declared width that
        # differs would need another layout.
        cols = _layout_csr(shape[0], _layout_blocks(use, settings))[1]
        if cols.shape != tuple(shape):
            raise FeedError(f"graph input '{name}' declares shape {list(shape)}, the generated layout needs {list(cols.shape)}: pass --feeds")
        return cols.astype(dtype)
    if slot in ("cos_cache", "sin_cache"):
        cos, sin = rotary_caches(shape[0], 2 * shape[1])
        return (cos if slot == "cos_cache" else sin).astype(dtype)
    if name == "input_ids":
        vocab = vocab_size or _embedding_rows(graph, name)
        if vocab is None:
            raise FeedError("cannot tell the vocabulary size for 'input_ids' (no genai_config.json, no embedding Gather): pass --feeds")
        return rng.integers(0, vocab, size=shape).astype(dtype)
    if name == "attention_mask":
        return np.ones(shape, dtype)
    if name == "position_ids":
        return np.broadcast_to(np.arange(settings.past, settings.past + shape[-1]), shape).astype(dtype)
    if np.issubdtype(dtype, np.floating):
        return rng.standard_normal(shape).astype(dtype)
    if dtype == np.bool_:
        notes.append(f"'{name}' (bool) is all true")
        return np.ones(shape, dtype)
    notes.append(f"'{name}' ({np.dtype(dtype)}) is all zeros: pass --feeds if it needs other values")
    return np.zeros(shape, dtype)


def _layout_blocks(use: _Use, settings: FeedSettings) -> int:
    """Block rows of a generated layout: enough to cover the cache."""
    return -(-settings.cache_rows // int(use.attributes.get("sparse_block_size", 1)))


def _layout_csr(num_layout: int, blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """A Phi-3-small style layout (2 local blocks, vertical stride 2): real sparsity even for short caches."""
    return mask_to_csr(phi3_small_mask(blocks, num_layout, local_blocks=2, vert_stride=2))


def _embedding_rows(graph: onnx.GraphProto, ids_name: str) -> int | None:
    """Rows of the initializer a Gather looks ``ids_name`` up in: the vocabulary size."""
    initializers = {init.name: init for init in graph.initializer}
    for node in graph.node:
        if node.op_type == "Gather" and len(node.input) > 1 and node.input[1] == ids_name and node.input[0] in initializers:
            return int(initializers[node.input[0]].dims[0])
    return None
