"""Caches the op holds itself: SparseAttention nodes whose past and present are not graph tensors.

A runtime that keeps every cache on one device makes ONNX Runtime copy a host-side node's
cache to the host and back on every step (ORT GenAI under the WebGPU EP: it allocates each
layer's past/present buffer on the EP's device, and this package's op reads and writes its
pasts in host memory). :func:`hold_sparse_caches` takes those layers' caches out of the
graph: their nodes lose ``past_key``/``past_value`` and ``present_key``/``present_value``,
and the graph the inputs and outputs that fed them. Such a node then keeps its sequence's
cache itself, per calling thread (:class:`HeldCache`): a host buffer of the node's capacity
that each call reads as its past and writes its new rows into, exactly as it would a
shared past/present buffer that ORT GenAI bound; the GPU keeps its resident copy as ever.

What the caller gives up: the cache is no longer the caller's to edit. **A node holds one
sequence (set of batch rows) per thread**: every session and GenAI model opened on one
prepared folder shares its nodes, so two sequences that take turns on one thread read each
other's cache, silently wherever the lengths allow it. Run one sequence at a time per
thread. A sequence starts with its prompt and goes on step by step; a call that continues
one further than the node holds it raises (naming ``key_total_sequence_lengths``). Going
back (a rewind) is allowed: the call's lengths say where the sequence ends. Beam search,
which reorders caches between steps, cannot be run on such a model. The buffers live until
the session that owns the nodes is closed (``create_session``'s; a GenAI folder's stay for
the process, reused by every later load of the folder).
"""

from __future__ import annotations

import threading

import numpy as np
import onnx

from sparse_attention_op.op.spec import CallShape, SparseAttentionInputError

_PAST_SLOTS, _PRESENT_SLOTS = (3, 4), (1, 2)


class HeldCache:
    """One node's cache for one thread: key and value buffers (batch, kv heads, capacity,
    head) and how many rows of each batch row's sequence they hold."""

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype):
        self.key = np.zeros(shape, dtype)
        self.value = np.zeros(shape, dtype)
        self.rows = [0] * shape[0]

    def check(self, shape: CallShape) -> None:
        """Raise unless every batch row's history is what this cache holds; then count only
        that history as held, until :meth:`advance`: the call writes its rows after it, and a
        call that fails midway must not leave them counted."""
        for b, past in enumerate(shape.past_lengths):
            if past > self.rows[b]:
                raise SparseAttentionInputError(
                    "key_total_sequence_lengths",
                    f"entry {b} continues a sequence after {past} tokens, but this node holds {self.rows[b]} of them: a node "
                    "without past_key/past_value holds its cache itself, so a sequence starts with its prompt and runs step "
                    "by step on one thread",
                )
        self.rows = [min(held, past) for held, past in zip(self.rows, shape.past_lengths)]

    def advance(self, shape: CallShape) -> None:
        """Record a finished call: each batch row's sequence now ends at its key total."""
        self.rows = list(shape.key_totals)


class HeldCaches:
    """Every held cache of the process, by (node identity, thread)."""

    def __init__(self):
        self._caches: dict[tuple[str, int], HeldCache] = {}
        self._lock = threading.Lock()

    def for_call(self, node_key: str, shape: tuple[int, ...], dtype: np.dtype) -> HeldCache:
        """The calling thread's cache of this node, of ``shape`` (spec.held_cache_shape of the
        call). A new one, holding nothing, when the call's batch or capacity differs from the
        one held (only a prompt can then run); it replaces the held one only once a call on
        it succeeds (:meth:`advance`)."""
        with self._lock:
            cache = self._caches.get((node_key, threading.get_ident()))
        if cache is None or cache.key.shape != shape or cache.key.dtype != dtype:
            cache = HeldCache(shape, dtype)
        return cache

    def advance(self, node_key: str, cache: HeldCache, shape: CallShape) -> None:
        """Record a call that succeeded on ``cache``, which the node now holds."""
        cache.advance(shape)
        with self._lock:
            self._caches[(node_key, threading.get_ident())] = cache

    def forget(self, token: str) -> None:
        """Drop the caches of a closed session's nodes."""
        with self._lock:
            for key in [key for key in self._caches if key[0].split("/", 1)[0] == token]:
                del self._caches[key]


held_caches = HeldCaches()


def hold_sparse_caches(model: onnx.ModelProto, is_held_node) -> list[str]:
    """Take the caches of the main graph's nodes that ``is_held_node`` picks out of the graph
    (in place): each such node whose past_key/past_value are graph inputs read by it alone,
    and whose present_key/present_value are graph outputs (or unused), loses all four, and
    the graph those inputs and outputs. Returns the removed inputs' names; a node whose
    cache tensors are shared with anything else keeps them."""
    graph = model.graph
    inputs = {i.name for i in graph.input}
    outputs = {o.name for o in graph.output}
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    for output in outputs:
        readers[output] = readers.get(output, 0) + 1
    removed_inputs, removed_outputs = [], []
    for node in graph.node:
        if not is_held_node(node) or len(node.input) < 5:
            continue
        pasts = [node.input[i] for i in _PAST_SLOTS]
        presents = [node.output[i] if i < len(node.output) else "" for i in _PRESENT_SLOTS]
        if not all(past in inputs and readers[past] == 1 for past in pasts):
            continue
        # A present may be a graph output; nothing else may read it.
        if not all(present == "" or readers.get(present, 0) <= (present in outputs) for present in presents):
            continue
        for slot in _PAST_SLOTS:
            node.input[slot] = ""
        for slot in _PRESENT_SLOTS:
            if slot < len(node.output):
                node.output[slot] = ""
        while node.output and node.output[-1] == "":
            node.output.pop()
        removed_inputs += pasts
        removed_outputs += [present for present in presents if present]
    for field, names in ((graph.input, set(removed_inputs)), (graph.output, set(removed_outputs))):
        kept = [value for value in field if value.name not in names]
        del field[:]
        field.extend(kept)
    return removed_inputs
