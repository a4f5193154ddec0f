"""A steady decode step, replayed: what a fast-check decode call repeats from the call before it.

A decode loop calls each node with the shapes, buffers and dispatches of its last call; only
the data changes (the new rows, the lengths, the probe rows). The executor's general call
(``WebGPUExecutor._execute``) works all of that out again every time: which inputs go where
in the input buffer, which buffers and launches serve them, how the read-back is cut, which
host arrays receive it. Once a fast-check decode call has run that way, the executor keeps a
:class:`SteadyDecode` for the node (per calling thread, on its ``NodeState``): the packed
input array with a typed view per section, the launches, the read-back buffer and where each
result lies in it. The node's next call runs through it if nothing it holds has moved
(:meth:`SteadyDecode.serves`): fill the views, one queue write, one compute pass, one copy,
one submit, one map, the record's append. Any other call (new shapes or split count, a grown
buffer, a cache that must grow, lengths the cache does not hold, a row starting afresh,
other settings) goes the general way, which leaves a new replay behind when it can.

Why: a decode step's host time is mostly Python run with the CPU's caches cold
(docs/design.md section 3), and falls with what the step touches: the replay runs a small
part of the general call's bytecodes and numpy calls. The GPU work is the general call's
(the same launches, the same bytes in the same places), so its results are bit-identical,
which the tests check against the general path.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from sparse_attention_op.webgpu.cache_record import gather_probes, probe_rows
from sparse_attention_op.op.spec import CallShape, ShapeFacts, new_rows
from sparse_attention_op.webgpu import kernels
from sparse_attention_op.webgpu import recording
from sparse_attention_op.webgpu.buffers import StepLayout
from sparse_attention_op.webgpu.mapping import mapped


class SteadyDecode:
    """The replay of one node's fast-check decode call (see the module doc). Built by the
    executor from a general call it has just run; every buffer, launch and host array here
    is that call's."""

    def __init__(self, *, facts: ShapeFacts, dispatch_key: tuple, settings, plan, validity: tuple, cache_rows: int,
                 layout: StepLayout, packed: np.ndarray, sections: dict[str, tuple[tuple, np.dtype]], launches: list,
                 inputs, results, readback, spin_seconds: float, host_results: dict[str, np.ndarray]):
        self.facts, self.dispatch_key, self.settings, self.plan = facts, dispatch_key, settings, plan
        #: What must not have moved since (WebGPUExecutor._steady_validity: the buffer pools'
        #: generations, the cache's buffers, the node's launches and uploaded layout).
        self.validity = validity
        self.cache_rows = cache_rows  # the cache's rows then: a call that needs more grows it the general way
        self.launches, self.inputs, self.results, self.readback = launches, inputs, results, readback
        self.spin_seconds = spin_seconds
        self.upload_bytes = sum(nbytes for _, _, nbytes in layout.inputs)  # (CallStats.upload_bytes)
        # The input buffer's bytes on the host, and a typed view of each section in them.
        self.packed = packed[: layout.input_bytes]
        views = {}
        for name, offset, nbytes in layout.inputs:
            shape, dtype = sections[name]  # as the general call's arrays were
            views[name] = self.packed[offset : offset + nbytes].view(dtype).reshape(shape)
        self.query, self.row_past = views["query"], views["row_past"]
        self.key_source, self.value_source = views.get("key_source"), views.get("value_source")
        self.cos_rows, self.sin_rows = views.get("cos_cache"), views.get("sin_cache")
        self.probe_slots, self.probe_key, self.probe_value = views["probe_slots"], views["probe_key"], views["probe_value"]
        # The results as the read-back buffer holds them: (name, offset, bytes), one copy for all.
        self.reads = tuple((name, offset, host_results[name].nbytes) for name, offset, _ in layout.results)
        _, last_offset, last_bytes = self.reads[-1]
        self.copy_bytes = last_offset + -(-last_bytes // 4) * 4  # copies move whole words
        self.map_bytes = layout.result_bytes
        #: The kept host arrays of the results (the executor's, per thread): the output (used
        #: where the caller passes no buffer of its own), new_key with rotary, probe_flags.
        self.host_results = host_results

    def serves(self, shape: CallShape, settings, plan, validity: tuple, tuning, record) -> bool:
        """Whether this call can be replayed: the same shapes, settings, layout and dispatches,
        nothing moved, and lengths the cache holds, every row with history (plain ints)."""
        return (shape.facts is self.facts and settings == self.settings and plan is self.plan and validity == self.validity
                and shape.rows_written <= self.cache_rows and kernels.same_dispatch_key(self.dispatch_key, shape, tuning)
                and min(shape.past_lengths) > 0 and record.holds_lengths(shape.past_lengths))

    def run(self, device, shape: CallShape, query, key, value, past_key, past_value, cos_table, sin_table, output: np.ndarray | None,
            while_gpu_runs: Callable[[], None] | None, record, phases: dict) -> tuple[np.ndarray, np.ndarray | None] | None:
        """One call: the output and the rotated new key rows (None without rotary), or None if
        a probed row differed from the cache: nothing is recorded then, ``while_gpu_runs`` has
        run and ``output`` holds the stale call's output (the executor runs the call again
        after the exact check). ``phases`` receives the host times."""
        tick = time.perf_counter()
        past = shape.past_lengths
        probes = probe_rows(past, shape.attributes.kv_num_heads, shape.total_sequence_length)
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
        phases["prepare"] = time.perf_counter() - tick

        tick = time.perf_counter()
        commands = recording.begin(device, False)
        try:
            commands.write_buffer(self.inputs, 0, self.packed)
            commands.compute_pass(self.launches)
            commands.copy_buffer_to_buffer(self.results, 0, self.readback, 0, self.copy_bytes)
            commands.submit()
        finally:
            commands.release()
        phases["encode_submit"] = time.perf_counter() - tick

        tick = time.perf_counter()
        if while_gpu_runs is not None:
            while_gpu_runs()
        phases["while_gpu_runs"] = time.perf_counter() - tick
        tick = time.perf_counter()
        host = self.host_results
        output = output if output is not None else host["output"]
        with mapped(device, self.readback, False, 0, self.map_bytes, self.spin_seconds) as memory:
            for name, offset, nbytes in self.reads:
                destination = output if name == "output" else host[name]
                destination.reshape(-1).view(np.uint8)[...] = memory[offset : offset + nbytes]
        phases["wait_read"] = time.perf_counter() - tick
        if host["probe_flags"].any():
            return None

        tick = time.perf_counter()
        new_key = host.get("new_key")
        keys = new_key if new_key is not None else new_rows(shape, query, key, value, "key")
        record.append(past, shape.key_totals, keys, new_rows(shape, query, key, value, "value"))
        phases["record"] = time.perf_counter() - tick
        return output, new_key
