"""The plan of a call: everything a call works out from its shapes, buffers and settings.

A decode loop calls each node with the shapes, buffers and dispatches of its last call; only
the data changes (the new rows, the lengths, the probe rows). So the executor works out once
per node (and calling thread) what follows from them, as a :class:`StepPlan` kept on the
node's state, and every call like it runs that plan:

* the packed input layout: where each input lies in the call's one input buffer, and, for
  small inputs, a host array laid out as that buffer is, with a typed view per section (the
  inputs are written into the views, and the array goes up in one queue write);
* the launches: pipelines, bind groups and the uniform block of every dispatch;
* the read-back cut: one copy of every result into one mapped buffer, or chunks
  (buffers.Download) for results larger than a chunk;
* the host result arrays that receive the results (kept per calling thread).

The plan's :attr:`StepPlan.key` says what it was built for and that nothing it holds has
moved (WebGPUExecutor._plan_key: one place for every call). The general call
(WebGPUExecutor.run) brings the node's cache up to date first (the exact check, growth, the
layout), then runs the node's plan, built anew where its key changed. A replay
(WebGPUExecutor.replay) is a fast-check decode step that needs none of that: it writes the
inputs straight from the operator's tensors and runs the same plan, so the same launches run
on the same bytes and its results are bit-identical (tests/test_kv_check.py checks).

Why: a decode step's host time is mostly Python run with the CPU's caches cold
(docs/design.md section 3), and falls with what the step touches.
"""

from __future__ import annotations

import numpy as np
import wgpu

from sparse_attention_op.op.spec import CallShape
from sparse_attention_op.webgpu import host_threads
from sparse_attention_op.webgpu.buffers import BufferPool, Download, StepLayout, layout_chunks
from sparse_attention_op.webgpu.cache_record import gather_probes
from sparse_attention_op.webgpu.mapping import mapped
from sparse_attention_op.webgpu.programs import BufferRange

_F32, _U32 = np.dtype(np.float32), np.dtype(np.uint32)
READBACK_USAGE = wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST


def input_sections(shape: CallShape, probes: int) -> tuple[tuple[str, tuple, np.dtype], ...]:
    """The call's inputs as (name, shape, dtype), in their order in the input buffer: the
    queries, each row's past, the key and value rows (unless packed in the queries), the
    rotary rows of its tokens, and with ``probes`` probe rows per batch row the GPU fast
    check's inputs (kernels.probe_compare)."""
    attrs, batch = shape.attributes, shape.batch_size
    sections = [("query", (batch, shape.seq_len, shape.query_hidden), _F32), ("row_past", (batch,), _U32)]
    if not shape.packed_qkv:
        rows = (batch, shape.seq_len, attrs.kv_num_heads * shape.head_size)
        sections += [("key_source", rows, _F32), ("value_source", rows, _F32)]
    if attrs.do_rotary:
        rows = (batch * shape.seq_len, shape.rotary_dim // 2)
        sections += [("cos_cache", rows, _F32), ("sin_cache", rows, _F32)]
    if probes:
        rows = (batch, probes, shape.head_size)
        sections += [("probe_slots", (batch, probes, 2), _U32), ("probe_key", rows, _F32), ("probe_value", rows, _F32)]
    return tuple(sections)


def result_sections(shape: CallShape, probe_flags: int) -> tuple[tuple[str, tuple, np.dtype], ...]:
    """The call's results as (name, shape, dtype), in their order in the results buffer: the
    output, the rotated new keys with rotary, and ``probe_flags`` flags of the GPU fast
    check (kernels.probe_grid: one per workgroup) last."""
    sections = [("output", shape.output_shape, _F32)]
    if shape.attributes.do_rotary:
        sections.append(("new_key", shape.new_rows_shape, _F32))
    if probe_flags:
        sections.append(("probe_flags", (probe_flags,), _U32))
    return tuple(sections)


def nbytes_of(sections) -> tuple[tuple[str, int], ...]:
    """(name, bytes) of each section, as buffers.step_layout takes them."""
    return tuple((name, int(np.prod(dims)) * dtype.itemsize) for name, dims, dtype in sections)


class Readback:
    """The read-back of a call whose results fit one chunk: one copy of the results buffer's
    used part into a mapped buffer, then each result out of it into its host array (offsets
    as in the results buffer, so the copy is one)."""

    __slots__ = ("buffer", "copy_bytes", "reads", "kept")

    def __init__(self, pool: BufferPool, layout: StepLayout, kept: list[np.ndarray]):
        _, last_offset, _ = layout.results[-1]
        self.copy_bytes = last_offset + -(-kept[-1].nbytes // 4) * 4  # copies move whole words
        self.buffer = pool.get("readback.0", self.copy_bytes, READBACK_USAGE)
        #: (offset, end, parallel) of each result: a large one is copied out by host threads.
        self.reads = tuple(
            (offset, offset + array.nbytes, array.nbytes >= host_threads.PARALLEL_BYTES) for (_, offset, _), array in zip(layout.results, kept)
        )
        #: The plan's kept result arrays, with the bytes of each (what the copies write).
        self.kept = tuple((array, array.reshape(-1).view(np.uint8)) for array in kept)

    def read(self, device, arrays: list[np.ndarray], spin_seconds: float) -> None:
        """Wait for the call's submit, then copy each result into its array of ``arrays``
        (StepPlan.result_arrays: the kept ones, or the caller's)."""
        with mapped(device, self.buffer, False, 0, self.copy_bytes, spin_seconds) as memory:
            for array, (own, own_bytes), (offset, end, parallel) in zip(arrays, self.kept, self.reads):
                destination = own_bytes if array is own else array.reshape(-1).view(np.uint8)
                if parallel:
                    host_threads.copy(destination, memory[offset:end])
                else:
                    destination[...] = memory[offset:end]


class StepPlan:
    """What every call of one node with the same key runs (see the module doc). Built by the
    executor (WebGPUExecutor._build_plan); every buffer, launch and host array here is the
    node's or the executor's, kept while the key holds."""

    __slots__ = (
        "key",
        "route",
        "layout",
        "sections",
        "launches",
        "inputs",
        "results",
        "readback",
        "host_results",
        "probes",
        "rotary",
        "replayable",
        "upload_bytes",
        "packed",
        "views",
        "query",
        "row_past",
        "key_source",
        "value_source",
        "cos_rows",
        "sin_rows",
        "probe_slots",
        "probe_key",
        "probe_value",
    )

    def __init__(
        self,
        *,
        key: tuple,
        route,
        layout: StepLayout,
        sections: tuple,
        launches: list,
        inputs,
        results,
        readback: Readback | None,
        host_results: list[np.ndarray],
        rotary: bool,
        probes: int,
        packed: np.ndarray | None,
        replayable: bool,
    ):
        self.key, self.route, self.layout, self.sections = key, route, layout, sections
        self.launches, self.inputs, self.results, self.readback = launches, inputs, results, readback
        #: The kept result arrays, in the results buffer's order (result_sections).
        self.host_results = host_results
        self.rotary = rotary  # the second result is the rotated new keys
        self.probes = probes  # probe rows per batch row (0: the call does not probe)
        #: A fast-check decode step whose inputs are packed and results read back in one copy:
        #: WebGPUExecutor.replay may run it from the operator's tensors.
        self.replayable = replayable
        self.upload_bytes = sum(nbytes for _, _, nbytes in layout.inputs)  # the sections' (CallStats.upload_bytes)
        # The padding between sections is never written here, so it holds whatever the
        # array held (the kernels never read it). Sections hold 4-byte elements (spec.py):
        # no section ends inside a word of padding.
        self.packed = None if packed is None else packed[: layout.input_bytes]
        self.views = () if packed is None else tuple(self._view(name, dims, dtype) for name, dims, dtype in sections)
        named = dict(zip((name for name, _, _ in sections), self.views))
        self.query, self.row_past = named.get("query"), named.get("row_past")
        self.key_source, self.value_source = named.get("key_source"), named.get("value_source")
        self.cos_rows, self.sin_rows = named.get("cos_cache"), named.get("sin_cache")
        self.probe_slots, self.probe_key, self.probe_value = named.get("probe_slots"), named.get("probe_key"), named.get("probe_value")

    def _view(self, name: str, dims: tuple, dtype: np.dtype) -> np.ndarray:
        """The typed view of one section in the packed host array."""
        offset, nbytes = next((offset, nbytes) for section, offset, nbytes in self.layout.inputs if section == name)
        return self.packed[offset : offset + nbytes].view(dtype).reshape(dims)

    # -- the inputs ---------------------------------------------------------------------
    def write_inputs(self, arrays: list[np.ndarray], upload) -> None:
        """A call's inputs (``arrays`` in input_sections' order): into the packed views, or,
        for inputs too large to pack, as sections of the call's ``upload`` (buffers.Upload)."""
        if self.packed is not None:
            for view, array in zip(self.views, arrays):
                view[...] = array
        else:
            upload.sections([np.ascontiguousarray(array, dtype) for array, (_, _, dtype) in zip(arrays, self.sections)], self.layout)

    def write_decode_inputs(self, shape: CallShape, query, key, value, past_key, past_value, cos_table, sin_table, probes) -> None:
        """A replayed decode step's inputs, straight from the operator's tensors (one token per
        batch row): the query, key and value rows, the whole pasts and rotary tables, and
        the probes (cache_record.probe_rows) whose rows the pasts hold."""
        past = shape.past_lengths
        self.query[...] = query
        self.row_past[...] = past
        if self.key_source is not None:
            self.key_source[...] = key
            self.value_source[...] = value
        if self.cos_rows is not None:
            for b, position in enumerate(past):  # one token per batch row, at its past length
                self.cos_rows[b] = cos_table[position]
                self.sin_rows[b] = sin_table[position]
        self.probe_slots[...] = probes
        self.probe_key[...] = gather_probes(past_key, probes)
        self.probe_value[...] = gather_probes(past_value, probes)

    # -- the results --------------------------------------------------------------------
    def result_arrays(self, output: np.ndarray | None, reuse: bool) -> list[np.ndarray]:
        """The host arrays a call's results go to, in the results buffer's order: the kept
        ones, with the caller's ``output`` in place of the first; without ``reuse`` the
        output and new keys go to fresh arrays (the probe flags stay the plan's)."""
        kept = self.host_results
        if not reuse:
            fresh = [np.empty_like(array) for array in kept[: 1 + self.rotary]]
            kept = fresh + kept[len(fresh) :]
        return kept if output is None else [output, *kept[1:]]

    def download(self, arrays: list[np.ndarray], pool: BufferPool, device, spin_seconds: float, chunk_bytes: int) -> Download:
        """The read-back of results larger than a chunk, in chunks (buffers.Download)."""
        download = Download(pool, device, spin_seconds, chunk_bytes)
        for array, (_, offset, nbytes) in zip(arrays, self.layout.results):
            download.add(array, BufferRange(self.results, offset, nbytes))
        return download


def new_readback(pool: BufferPool, layout: StepLayout, kept: list[np.ndarray], chunk_bytes: int) -> Readback | None:
    """The one-copy read-back into these kept result arrays, or None where the results take
    more than a chunk (buffers.layout_chunks; then each call reads back through
    buffers.Download)."""
    if len(layout_chunks([array.nbytes for array in kept], chunk_bytes)) != 1:
        return None
    return Readback(pool, layout, kept)
