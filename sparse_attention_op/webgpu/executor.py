"""Runs validated SparseAttention calls on the GPU.

One call is one submit. The queue first receives the call's uploads (the query and new
key/value rows, the cos/sin rows of its positions, the history rows the resident cache
lacks, the layout when it changed, the uniforms); then the dispatches the kernels module
plans run; then one read-back brings the output, and the rotated new key rows when rotary
is on. The presents are not built here: the bridge writes the new rows into them
(presents.py).

A call that asks for the fast check with the caller's past has its probe rows compared
with the cache on the GPU, in a first dispatch of the same submit; if any row differs, its
output is dropped and the call runs again after the exact check.

State lives per node and per calling thread (:class:`NodeState`): the resident KV cache
and the record of what it holds, the layout buffer, cached bind groups. Per thread,
because each thread that runs a session feeds its own past (one sequence per thread), and
ONNX Runtime runs a node on the thread that called ``run``. All GPU work of the process
goes through one lock: the device and queue are one resource.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import numpy as np
import wgpu

from sparse_attention_op.op.block_plan import BlockPlan, BlockPlanCache
from sparse_attention_op.webgpu.cache_record import gather_probes, model_itemsize, probe_rows
from sparse_attention_op.op.spec import CallShape, SparseAttentionCall, SparseAttentionError
from sparse_attention_op.webgpu import kernels
from sparse_attention_op.webgpu import recording
from sparse_attention_op.webgpu.buffers import STAGING_BYTES, STORAGE_IN, STORAGE_OUT, UNIFORM, BufferPool, Download, GpuBufferError, StepLayout, Upload, aligned, step_layout
from sparse_attention_op.settings import DEFAULT_SETTINGS, SessionSettings
from sparse_attention_op.webgpu.device import GpuContext, get_context
from sparse_attention_op.webgpu.kv_cache import ResidentCache
from sparse_attention_op.webgpu.process_wide import ProcessWide
from sparse_attention_op.webgpu.programs import BufferRange, PipelineCache
from sparse_attention_op.webgpu.steady import SteadyDecode
from sparse_attention_op.webgpu.tuning import Tuning, choose_tuning


class GpuExecutionError(RuntimeError):
    """The GPU failed a call (device lost, out of memory, driver error); the node is reset."""


@dataclass
class CallStats:
    """What one call did: for tests (what moved) and benchmarks (times)."""

    seconds: float = 0.0
    #: GPU time of each dispatch by label, when profiling (else empty).
    gpu_seconds: dict = field(default_factory=dict)
    upload_bytes: int = 0
    history_rows_compared: int = 0
    history_rows_uploaded: int = 0
    #: Host time of the call's phases (seconds), to see where a call's time goes: the
    #: executor's (sync, prepare, encode_submit, while_gpu_runs, wait_read, record)
    #: and, in a session, the bridge's before and after it (inputs: reading and checking
    #: them; outputs: writing what the call's results decide).
    phases: dict = field(default_factory=dict)
    #: The GPU's fast check found a probed row that differs from the cache, so the call ran
    #: again after the exact check (these stats are the second run's).
    probes_differed: bool = False
    #: The call ran as a replay of the node's last decode call (steady.py).
    replayed: bool = False

    @property
    def gpu_total(self) -> float | None:
        return sum(self.gpu_seconds.values()) if self.gpu_seconds else None


@dataclass
class CallResult:
    output: np.ndarray  # (batch, sequence, num_heads * head_size)
    new_key: np.ndarray | None  # rotated new key rows (batch, kv heads, sequence, head) when rotary is on
    stats: CallStats


@dataclass(frozen=True)
class Launch:
    """One dispatch, ready to record: what a decode step repeats from the last one."""

    label: str
    pipeline: object
    bind_group: object
    workgroups: tuple[int, int, int]


@dataclass(frozen=True, eq=False)
class DispatchFacts:
    """What a call's dispatch key (kernels.dispatch_key) decides before any GPU work."""

    key: tuple
    limits_ok: bool  # the grids fit the adapter
    scratch_bytes: dict  # GPU-only buffers the dispatches need, by name


class BoundBuffers(NamedTuple):
    """The buffers a call's launches bind (a tuple: part of their cache key, compared by
    identity, so a grown buffer is a new key)."""

    inputs: object
    results: object
    block_plan: object
    key_cache: object
    value_cache: object
    scratch: tuple  # the dispatch's scratch buffers, in the order of DispatchFacts.scratch_bytes


@dataclass
class LaunchPlan:
    """The launches of a call, valid for every call with the same key: dispatches depend on
    shapes and bound buffers only (lengths are data), so a decode step reuses the last
    step's pipelines, bind groups and uniform block as they are."""

    key: tuple
    launches: list[Launch]


@dataclass
class NodeState:
    """GPU state of one SparseAttention node for one calling thread."""

    cache: ResidentCache
    buffers: BufferPool
    uploaded_plan: BlockPlan | None = None  # the plan the block_plan buffer holds now
    launch_plan: LaunchPlan | None = None
    steady: SteadyDecode | None = None  # the last fast-check decode call, to replay (steady.py)

    def release(self) -> None:
        self.launch_plan = self.steady = None
        self.buffers.release()
        self.cache.release()

    def gpu_bytes(self) -> int:
        return self.buffers.total_bytes() + self.cache.nbytes


class WebGPUExecutor:
    def __init__(self, context: GpuContext | None = None, tuning: Tuning | None = None):
        self.context = context or get_context()
        self.tuning = tuning or choose_tuning(self.context.limits, self.context.features, self.context.adapter_type)
        self.pipelines = PipelineCache(self.context.device, runtime_checks=self.tuning.shader_runtime_checks)
        self.plans = BlockPlanCache()
        self._states: dict[tuple[str, int], NodeState] = {}
        #: Layouts by node key, for nodes whose layout is a constant (sent once).
        self._layouts: dict[str, BlockPlan] = {}
        self._scratch = BufferPool(self.context.device, self.context.max_binding_bytes)
        self._host_arrays: dict[tuple[str, int], np.ndarray] = {}
        self._lock = threading.Lock()
        # Sessions are finalised by the garbage collector, which can run anywhere, also
        # inside a call holding the lock: finalisers only queue their prefix here (deque
        # appends are atomic) and the next locked operation frees the state.
        self._release_queue: collections.deque[str] = collections.deque()
        self._timestamps = None
        self._dispatch_facts_by_key: dict[tuple, DispatchFacts] = {}

    # -- public -----------------------------------------------------------------------
    def knows_layout(self, node_key: str) -> bool:
        return node_key in self._layouts

    def run(self, call: SparseAttentionCall, node_key: str = "default", settings: SessionSettings = DEFAULT_SETTINGS,
            *, reuse_host_arrays: bool = False, output: np.ndarray | None = None,
            while_gpu_runs: Callable[[], None] | None = None, replayable: bool = False) -> CallResult:
        """Execute one call: the output, and the rotated new key rows when rotary is on.

        Without history rows in the call, the node's cache on this thread must already hold
        every row's past (the fast check said so); with them, the cache compares them with
        what it holds and uploads only what differs. With ``reuse_host_arrays`` the results
        live in host arrays the executor reuses at its next call on this thread (for callers
        that copy them at once, as the bridge does: fresh large arrays are slow to fault in).
        ``output``, a writable C-contiguous float32 array of the output's shape, receives the
        output instead (the bridge passes ORT's own buffer for it: no host copy).
        ``while_gpu_runs`` is called once the call's work is submitted, before its results are
        waited for: host work that needs none of them overlaps the GPU's (the bridge writes
        the presents' rows it already has there). ``replayable``: the caller will offer the
        node's next decode calls to :meth:`replay`, so a fast-check decode call keeps what its
        replay needs (steady.py; a caller that never replays should not pay for that).
        """
        _check_output(output, call.shape)
        start = time.perf_counter()
        with self._lock:
            result = self._run_locked(call, node_key, settings, reuse_host_arrays, output, while_gpu_runs, replayable)
        result.stats.seconds = time.perf_counter() - start
        return result

    def _run_locked(self, call: SparseAttentionCall, node_key: str, settings: SessionSettings, reuse_host_arrays: bool,
                    output: np.ndarray | None, while_gpu_runs: Callable[[], None] | None, replayable: bool) -> CallResult:
        """run() under the executor's lock."""
        shape = call.shape
        plan = self._layout_plan(call, node_key)
        dtype = self._cache_dtype(call.float16_storage, settings)
        dispatch = self._dispatch_facts(shape)
        self._check_limits(shape, dtype, dispatch)
        self._drain_releases()
        state_key = (node_key, threading.get_ident())
        state = self._state(state_key, shape, dtype, call.float16_storage)
        with _DroppedOnFailure(self, state_key):
            result = self._execute(call, state, plan, dtype, settings, dispatch, reuse_host_arrays, output, while_gpu_runs, replayable)
        if call.block_row_indices is not None:
            self._layouts[node_key] = plan
        return result

    def replay(self, node_key: str, settings: SessionSettings, shape: CallShape, query: np.ndarray, key: np.ndarray | None,
               value: np.ndarray | None, past_key: np.ndarray, past_value: np.ndarray, cos_table: np.ndarray | None,
               sin_table: np.ndarray | None, make_call: Callable[[], SparseAttentionCall], *, output: np.ndarray | None = None,
               while_gpu_runs: Callable[[], None] | None = None) -> CallResult | None:
        """A fast-check decode call replayed from the node's last one (steady.py), or None
        where no replay serves it (nothing done): the caller then runs it (:meth:`run` with
        ``replayable``, which leaves a replay for the next call). The inputs are the call's
        tensors as the operator has them (``shape`` validated them): the query, key and value
        rows, the whole pasts and rotary tables. The result is the one :meth:`run` would give
        with ``reuse_host_arrays`` (same bits: the same launches run on the same bytes);
        ``output`` and ``while_gpu_runs`` as there. Where a probed row differs from the cache,
        the call runs again at once after the exact check, as run()'s does: ``make_call()``
        then gives the call (with its history: the caller's pasts), and its stats say
        ``probes_differed``."""
        _check_output(output, shape)
        start = time.perf_counter()
        state_key = (node_key, threading.get_ident())
        with self._lock:
            self._drain_releases()
            state = self._states.get(state_key)
            steady = None if state is None else state.steady
            if steady is None or not steady.serves(shape, settings, self._layouts.get(node_key), self._steady_validity(state), self.tuning,
                                                   state.cache.record):
                return None
            phases = {"sync": time.perf_counter() - start}
            with _DroppedOnFailure(self, state_key):
                ran = steady.run(self.context.device, shape, query, key, value, past_key, past_value, cos_table, sin_table, output,
                                 while_gpu_runs, state.cache.record, phases)
            if ran is None:
                # A probed row differed: this output used a stale cache. The call again, the
                # history compared in full (what ran while the GPU did is done).
                call = dataclasses.replace(make_call(), fast_check=False)
                result = self._run_locked(call, node_key, settings, True, output, None, False)
                result.stats.probes_differed = True
                result.stats.seconds = time.perf_counter() - start
                return result
        stats = CallStats(upload_bytes=steady.upload_bytes, phases=phases, replayed=True)
        stats.seconds = time.perf_counter() - start
        return CallResult(ran[0], ran[1], stats)

    def release_later(self, node_key_prefix: str) -> None:
        """Queue the GPU state of every node whose key starts with the prefix for freeing.

        Safe from a finaliser: it never blocks. The state goes at the next call, or at
        :meth:`release` or :meth:`node_keys`.
        """
        self._release_queue.append(node_key_prefix)

    def release(self, node_key_prefix: str) -> None:
        """Free the GPU state of every node whose key starts with the prefix (a session's) now."""
        self._release_queue.append(node_key_prefix)
        with self._lock:
            self._drain_releases()

    def node_keys(self) -> list[str]:
        """Keys of the nodes that hold GPU state (on any thread)."""
        with self._lock:
            self._drain_releases()
            return sorted({key for key, _ in self._states})

    def node_state(self, node_key: str) -> NodeState | None:
        """This thread's state of a node (tests look at its cache)."""
        return self._states.get((node_key, threading.get_ident()))

    def gpu_bytes(self) -> int:
        """Bytes of GPU memory held for all nodes and the shared buffers (soak benchmarks watch it)."""
        with self._lock:
            return sum(state.gpu_bytes() for state in self._states.values()) + self._scratch.total_bytes()

    # -- steps ------------------------------------------------------------------------
    def _drain_releases(self) -> None:
        while self._release_queue:
            prefix = self._release_queue.popleft()
            for key in [k for k in self._states if k[0].startswith(prefix)]:
                self._states.pop(key).release()
            for key in [k for k in self._layouts if k.startswith(prefix)]:
                del self._layouts[key]

    def _drop(self, state_key) -> None:
        state = self._states.pop(state_key, None)
        if state is not None:
            state.release()

    def _steady_validity(self, state: NodeState) -> tuple:
        """What a node's replay holds on to (SteadyDecode.validity): the buffer pools it binds
        and reads back through, the cache's buffers, the launches and the uploaded layout."""
        return (self._scratch.generation, state.buffers.generation, state.cache.key, state.launch_plan, state.uploaded_plan)

    def _cache_dtype(self, float16_storage: bool, settings: SessionSettings):
        f16 = settings.f16_cache and float16_storage and "shader-f16" in self.context.features
        return np.float16 if f16 else np.float32

    @staticmethod
    def _fits(state: NodeState, shape: CallShape, dtype) -> bool:
        cache = state.cache
        return (cache.batch, cache.kv_heads, cache.head_size, cache.max_rows, cache.dtype) == (
            shape.batch_size, shape.attributes.kv_num_heads, shape.head_size, shape.max_cache_len, np.dtype(dtype))

    def _state(self, state_key, shape: CallShape, dtype, float16_storage: bool) -> NodeState:
        state = self._states.get(state_key)
        if state is None or not self._fits(state, shape, dtype):
            # A new cache shape is a new cache: nothing of the old one carries over.
            if state is not None:
                state.release()
            device = self.context.device
            cache = ResidentCache(device, shape.batch_size, shape.attributes.kv_num_heads, shape.head_size, shape.max_cache_len, dtype,
                                  self.context.max_binding_bytes, record_itemsize=model_itemsize(float16_storage))
            state = self._states[state_key] = NodeState(cache, BufferPool(device, self.context.max_binding_bytes))
        return state

    def _layout_plan(self, call: SparseAttentionCall, node_key: str) -> BlockPlan:
        if call.block_row_indices is not None:
            return self.plans.get(call.block_row_indices, call.block_col_indices)
        plan = self._layouts.get(node_key)
        if plan is None:
            raise SparseAttentionError(f"SparseAttention node '{node_key}': the call carries no layout and none was passed before")
        return plan

    def _dispatch_facts(self, shape: CallShape) -> DispatchFacts:
        """What the call's dispatch key decides, worked out once per key (a decode step has
        the key of the step before it)."""
        key = kernels.dispatch_key(shape, self.tuning)
        facts = self._dispatch_facts_by_key.get(key)
        if facts is None:
            if len(self._dispatch_facts_by_key) > 256:
                self._dispatch_facts_by_key.clear()
            facts = DispatchFacts(key, kernels.dispatch_limits_ok(shape, self.tuning), kernels.scratch_bytes(shape, self.tuning))
            self._dispatch_facts_by_key[key] = facts
        return facts

    def _check_limits(self, shape: CallShape, dtype, dispatch: DispatchFacts) -> None:
        """Refuse, before any GPU work, a call whose buffers or dispatch the adapter cannot hold."""
        limit = self.context.max_binding_bytes
        rows = min(shape.max_cache_len, shape.rows_written)
        sizes = {  # plain ints: this runs every call
            "past_key": shape.batch_size * shape.attributes.kv_num_heads * rows * shape.head_size * (2 if dtype is np.float16 else 4),
            "query": shape.batch_size * shape.seq_len * shape.query_hidden * 4,
            "output": math.prod(shape.output_shape) * 4,
        }
        for name, nbytes in sizes.items():
            if nbytes > limit:
                raise SparseAttentionError(f"SparseAttention input '{name}': needs a {nbytes}-byte GPU buffer, more than this adapter binds ({limit} bytes)")
        if not dispatch.limits_ok:
            raise SparseAttentionError("SparseAttention input 'query': batch, heads or sequence exceed the GPU's dispatch limits")

    def _host_array(self, name: str, shape, reuse: bool, dtype=np.float32) -> np.ndarray:
        if not reuse:
            return np.empty(shape, dtype)
        key = (name, threading.get_ident())
        size = math.prod(shape)  # plain ints: np.prod costs a decode step microseconds
        array = self._host_arrays.get(key)
        if array is None or array.size < size:
            array = self._host_arrays[key] = np.empty(size, dtype)
        return array[:size].reshape(shape)

    def _packing(self, nbytes: int) -> np.ndarray:
        """The host array a call's small inputs are packed in before their one write, kept
        per thread and reused by every call (warm in the CPU's caches, unlike a fresh one)."""
        return self._host_array("packed_inputs", (nbytes,), True, np.uint8)

    def _execute(self, call: SparseAttentionCall, state: NodeState, plan: BlockPlan, dtype, settings: SessionSettings,
                 dispatch: DispatchFacts, reuse_host_arrays: bool = False, output: np.ndarray | None = None,
                 while_gpu_runs: Callable[[], None] | None = None, replayable: bool = False) -> CallResult:
        device, shape = self.context.device, call.shape
        phases = {}
        tick = time.perf_counter()
        cache, record = state.cache, state.cache.record
        stats = CallStats()
        state.steady = None  # a call the general way: what a replay held may move

        # 1. The resident cache: room for this call's rows, then what it lacks of the past.
        # A call with probes and lengths the cache holds checks its probes on the GPU first
        # (probe_compare.wgsl.jinja): it runs as if they agreed, and is run again after the
        # exact check below if they did not (step 4).
        cache.reserve(shape.rows_written)
        upload = Upload()
        probing = call.fast_check and record.holds_lengths(shape.past_lengths)
        if call.has_history and not probing:
            plans = record.sync(shape.past_lengths, call.history_key, call.history_value)
            cache.upload_spans(upload, plans, call.history_key, call.history_value)
            stats.history_rows_compared = 2 * shape.attributes.kv_num_heads * sum(shape.past_lengths)
            stats.history_rows_uploaded = plans["key"].rows + plans["value"].rows
        else:
            if not probing and not record.holds_lengths(shape.past_lengths):
                raise SparseAttentionError("SparseAttention: the call carries no history rows, but the resident cache does not hold its past")
            for b, past in enumerate(shape.past_lengths):  # plain ints: a decode step's path
                if past == 0:
                    record.valid[b] = 0  # a row starting afresh (a prompt)
        phases["sync"] = time.perf_counter() - tick

        # 2. The call's inputs, as sections of one buffer, and its results, as sections of
        # another laid out as in the read-back buffer (one copy back). With probes, the GPU
        # fast check's flags come last (kernels.probe_grid: one per workgroup).
        tick = time.perf_counter()
        names, arrays = ["query", "row_past"], [call.query, np.asarray(shape.past_lengths, np.uint32)]
        if not shape.packed_qkv:
            names += ["key_source", "value_source"]
            arrays += [call.key, call.value]
        if shape.attributes.do_rotary:
            names += ["cos_cache", "sin_cache"]
            arrays += [call.cos_rows, call.sin_rows]
        probe_flags = None
        if probing:
            probes = probe_rows(shape.past_lengths, shape.attributes.kv_num_heads, shape.total_sequence_length)
            names += ["probe_slots", "probe_key", "probe_value"]
            arrays += [probes.astype(np.uint32), *_gather_probes(call, probes)]
            grid = kernels.probe_grid(shape, probes.shape[1])
            probe_flags = self._host_array("probe_flags", (grid[0] * grid[1],), True, np.uint32)
        arrays = [np.ascontiguousarray(array) for array in arrays]
        if output is None:
            output = self._host_array("output", shape.output_shape, reuse_host_arrays)
        new_key = self._host_array("new_key", shape.new_rows_shape, reuse_host_arrays) if shape.attributes.do_rotary else None
        results = [("output", output)] + ([] if new_key is None else [("new_key", new_key)]) + ([] if probe_flags is None else [("probe_flags", probe_flags)])
        layout = step_layout(tuple(zip(names, (array.nbytes for array in arrays))), tuple((name, array.nbytes) for name, array in results))
        upload.sections(arrays, layout)
        inputs = self._scratch.get("inputs", layout.input_bytes, STORAGE_IN)
        results_buffer = self._scratch.get("results", layout.result_bytes, STORAGE_OUT)
        plan_buffer = state.buffers.get("block_plan", plan.nbytes, STORAGE_IN)
        if state.uploaded_plan is not plan:
            upload.write(plan.words, plan_buffer, 0)
            state.uploaded_plan = plan
        scratch = tuple(self._scratch.get(name, nbytes, wgpu.BufferUsage.STORAGE) for name, nbytes in dispatch.scratch_bytes.items())
        cache_format = kernels.CacheFormat(rows=cache.rows, f16=np.dtype(dtype) == np.float16, round_keys_to_f16=call.float16_storage)
        buffers = BoundBuffers(inputs, results_buffer, plan_buffer, cache.key, cache.value, scratch)
        launches = self._launches(state, shape, dispatch, cache_format, layout, buffers, probe_slots=probes.shape[1] if probing else 0)
        phases["prepare"] = time.perf_counter() - tick

        # 3. One command buffer: the uploads, every dispatch, then the read-back copies.
        tick = time.perf_counter()
        timed = settings.profiled and "timestamp-query" in self.context.features
        download = Download(self._scratch, device, self.tuning.map_spin_seconds, self.tuning.transfer_chunk_bytes)
        for (_, array), (_, offset, nbytes) in zip(results, layout.results):
            download.add(array, BufferRange(results_buffer, offset, nbytes))
        ticks = None
        commands = recording.begin(device, timed)
        try:
            upload.encode(device, commands, self._scratch, inputs, self.tuning.map_spin_seconds, self._packing, self.tuning.transfer_chunk_bytes)
            if timed:
                if settings.profile_whole_pass:
                    passes, labels = [launches], ["pass"]
                else:
                    passes, labels = [[launch] for launch in launches], [launch.label for launch in launches]
                query_set, resolved = self._timestamps_for(2 * len(passes))
                commands.timed_passes(passes, query_set)
                commands.resolve_query_set(query_set, 2 * len(passes), resolved)
                ticks = np.zeros(2 * len(passes), np.uint64)
                download.add(ticks, BufferRange(resolved))
            else:
                commands.compute_pass(launches)
            download.encode(commands)
            commands.submit()
        finally:
            try:
                commands.release()  # never raises: a failed recording's own error is on its way
            finally:
                self._scratch.release_temporaries()  # after the submit, or with the failed recording
        phases["encode_submit"] = time.perf_counter() - tick

        # Host work that needs no result overlaps the GPU's: the caller's, and the digests of
        # a multi-row call's value rows for the record (a prompt's: 8192 rows of 8 heads of 128
        # float32 take milliseconds).
        tick = time.perf_counter()
        if while_gpu_runs is not None:
            while_gpu_runs()
        value_terms = None if shape.seq_len == 1 else record.row_terms(shape.past_lengths, shape.key_totals, call.new_rows("value"))
        phases["while_gpu_runs"] = time.perf_counter() - tick
        tick = time.perf_counter()
        download.read()
        phases["wait_read"] = time.perf_counter() - tick
        if probe_flags is not None and np.count_nonzero(probe_flags):
            # A probed row differs from the cache: this output used a stale cache. The call
            # again, the history compared in full (its own rows land in the cache again).
            again = self._execute(dataclasses.replace(call, fast_check=False), state, plan, dtype, settings, dispatch, reuse_host_arrays,
                                  output, None, replayable)  # (what ran while the GPU did is done)
            again.stats.probes_differed = True
            return again

        # 4. The record learns the rows this call wrote.
        tick = time.perf_counter()
        keys = new_key if new_key is not None else call.new_rows("key")
        # After the call each row's history ends at its key total (a prompt's padding rows
        # reach the cache, but are not history).
        record.append(shape.past_lengths, shape.key_totals, keys, call.new_rows("value"), value_terms)
        phases["record"] = time.perf_counter() - tick

        stats.upload_bytes = upload.nbytes
        stats.phases = phases
        readback = download.single_buffer()
        if (replayable and probing and shape.seq_len == 1 and not timed and reuse_host_arrays and min(shape.past_lengths) > 0
                and layout.input_bytes <= STAGING_BYTES and readback is not None):
            # A fast-check decode step: the next ones replay it (steady.py). (Its inputs go
            # up in one write of their packed bytes, whatever their size: within the bytes
            # an upload moves without staging.)
            state.steady = SteadyDecode(
                facts=shape.facts, dispatch_key=dispatch.key, settings=settings, plan=plan,
                validity=self._steady_validity(state), cache_rows=cache.rows, layout=layout, packed=self._packing(layout.input_bytes),
                sections={name: (array.shape, array.dtype) for name, array in zip(names, arrays)}, launches=launches, inputs=inputs,
                results=results_buffer, readback=readback, spin_seconds=self.tuning.map_spin_seconds,
                host_results={"output": self._host_array("output", shape.output_shape, True),
                              **{name: array for name, array in results if name != "output"}})
        if ticks is not None:
            seconds = (ticks[1::2].astype(np.float64) - ticks[0::2]) * 1e-9  # WebGPU timestamps are ns
            stats.gpu_seconds = {label: float(s) for label, s in zip(labels, seconds)}
        return CallResult(output, new_key, stats)

    def _launches(self, state: NodeState, shape: CallShape, dispatch: DispatchFacts, cache_format, layout: StepLayout, buffers: BoundBuffers,
                  probe_slots: int = 0) -> list[Launch]:
        """The call's launches: the node's last ones when nothing they depend on changed (the
        dispatch key, the cache's format, the layout and the buffers). With ``probe_slots``
        the GPU's fast check (kernels.probe_compare) comes first."""
        key = (dispatch.key, cache_format, probe_slots, layout, buffers)
        if state.launch_plan is not None and state.launch_plan.key == key:
            return state.launch_plan.launches
        resources = {name: BufferRange(buffers.inputs, offset) for name, offset, _ in layout.inputs}
        if shape.packed_qkv:
            resources["key_source"] = resources["value_source"] = resources["query"]
        resources.update(block_plan=BufferRange(buffers.block_plan), key_cache=BufferRange(buffers.key_cache),
                         value_cache=BufferRange(buffers.value_cache))
        resources.update((name, BufferRange(buffers.results, offset, nbytes)) for name, offset, nbytes in layout.results)
        resources.update((name, BufferRange(buffer)) for name, buffer in zip(dispatch.scratch_bytes, buffers.scratch))
        dispatches = kernels.call_dispatches(shape, self.tuning, cache_format, resources)
        if probe_slots:
            dispatches = [kernels.probe_compare(shape, cache_format, resources, probe_slots)] + dispatches
        # Every dispatch's uniform block, one aligned slot each, in the node's own buffer
        # (written once per plan: uniforms hold shapes, never per-call data).
        blocks = [d.program.pack_uniforms(d.uniforms) for d in dispatches]
        slot = max(aligned(block.nbytes) for block in blocks)
        packed = np.zeros(slot * len(blocks) // 4, np.uint32)
        for index, block in enumerate(blocks):
            packed[index * slot // 4 : index * slot // 4 + block.size] = block
        uniforms = state.buffers.get("uniforms", packed.nbytes, UNIFORM)
        self.context.device.queue.write_buffer(uniforms, 0, packed)
        launches = []
        for index, planned in enumerate(dispatches):
            compiled = self.pipelines.get(planned.program)
            ranges = (BufferRange(uniforms, index * slot, slot),) + planned.bound()
            entries = [{"binding": i, "resource": {"buffer": r.buffer, "offset": r.offset, "size": r.nbytes}} for i, r in enumerate(ranges)]
            group = self.context.device.create_bind_group(layout=compiled.bind_group_layout, entries=entries)
            launches.append(Launch(planned.label, compiled.pipeline, group, planned.workgroups))
        state.launch_plan = LaunchPlan(key, launches)
        return launches

    def _timestamps_for(self, count: int):
        """A query set of at least ``count`` timestamps and the buffer they resolve into."""
        if self._timestamps is None or self._timestamps[0].count < count:
            device = self.context.device
            query_set = device.create_query_set(type=wgpu.QueryType.timestamp, count=max(count, 8))
            resolved = device.create_buffer(size=8 * max(count, 8), usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC)
            self._timestamps = (query_set, resolved)
        return self._timestamps


def _check_output(output: np.ndarray | None, shape: CallShape) -> None:
    """run()'s and replay()'s ``output``: None, or a writable C-contiguous float32 array of the output's shape."""
    if output is not None and (output.shape != shape.output_shape or output.dtype != np.float32
                               or not output.flags.c_contiguous or not output.flags.writeable):
        raise ValueError(f"output must be a writable C-contiguous float32 array of shape {shape.output_shape}")


class _DroppedOnFailure:
    """The context of a call of a node's state: any failure drops the state (what the GPU
    holds for the node is unknown then, so it starts afresh). The GPU's own failures are
    reported as GpuExecutionError; a host-side fault is reported as it is. (A class: a
    generator-based context costs a decode step several times the calls.)"""

    __slots__ = ("executor", "state_key")

    def __init__(self, executor: WebGPUExecutor, state_key):
        self.executor, self.state_key = executor, state_key

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        if kind is None:
            return False
        self.executor._drop(self.state_key)
        if issubclass(kind, wgpu.GPUError):
            raise GpuExecutionError(f"SparseAttention failed on {self.executor.context.description}: {error}") from error
        return False  # a host-side fault: reported as it is


_executor = ProcessWide(WebGPUExecutor)


def get_executor() -> WebGPUExecutor:
    """The process-wide executor on the process-wide device."""
    return _executor.get()


def _gather_probes(call: SparseAttentionCall, probes: np.ndarray) -> list[np.ndarray]:
    """The GPU fast check's rows of the caller's past key and value: (batch, probes, head) float32."""
    return [gather_probes(history, probes).astype(np.float32, copy=False) for history in (call.history_key, call.history_value)]
