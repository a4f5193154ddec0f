"""Runs validated SparseAttention calls on the GPU.

One call is one submit. The queue first receives the call's uploads (the query and new
key/value rows, the cos/sin rows of its positions, the history rows the resident cache
lacks, the layout when it changed, the uniforms); then the dispatches the kernels module
plans run; then one read-back brings the output, and the rotated new key rows when rotary
is on. The presents are not built here: the bridge writes the new rows into them
(presents.py).

What a call works out from its shapes, buffers and settings (the input layout, the
launches, the read-back, the host result arrays) is its node's step plan (step_plan.py),
kept between calls while its key holds. A call runs in two parts: the general call
(:meth:`WebGPUExecutor.run`) checks it and brings the node's cache up to date, then runs
the plan; a replay (:meth:`WebGPUExecutor.replay`) is a fast-check decode step that needs
no such work and runs the plan straight from the operator's tensors.

A call that asks for the fast check with the caller's past has its probe rows compared
with the cache on the GPU, in a first dispatch of the same submit; if any row differs, its
output is dropped and the call runs again after the exact check.

State lives per node and per calling thread (:class:`NodeState`): the resident KV cache
and the record of what it holds, the layout buffer, the step plan. Per thread, because
each thread that runs a session feeds its own past (one sequence per thread), and ONNX
Runtime runs a node on the thread that called ``run``. All GPU work of the process goes
through one lock: the device and queue are one resource.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import wgpu

from sparse_attention_op.op.block_plan import BlockPlan, BlockPlanCache
from sparse_attention_op.op.spec import CallShape, SparseAttentionCall, SparseAttentionError, new_rows
from sparse_attention_op.settings import DEFAULT_SETTINGS, SessionSettings
from sparse_attention_op.webgpu import buffers, host_threads, kernels, recording
from sparse_attention_op.webgpu.buffers import STORAGE_IN, STORAGE_OUT, UNIFORM, BufferPool, Download, Upload, aligned, step_layout
from sparse_attention_op.webgpu.cache_record import gather_probes, model_itemsize, probe_count, probe_rows
from sparse_attention_op.webgpu.device import GpuContext, get_context
from sparse_attention_op.webgpu.kv_cache import ResidentCache
from sparse_attention_op.webgpu.mapping import mapped
from sparse_attention_op.webgpu.process_wide import ProcessWide
from sparse_attention_op.webgpu.programs import BufferRange, Dispatch, PipelineCache
from sparse_attention_op.webgpu.step_plan import StepPlan, input_sections, nbytes_of, new_readback, result_sections
from sparse_attention_op.webgpu.tuning import Tuning, choose_tuning


class GpuExecutionError(RuntimeError):
    """The GPU failed a call (device lost, out of memory, a buffer or map the adapter refused,
    a driver error); the node is reset."""


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
    #: The call ran as a replay of its node's step plan (WebGPUExecutor.replay).
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
    """What a call's route (kernels.Route) decides before any GPU work."""

    route: kernels.Route
    limits_ok: bool  # the grids fit the adapter
    scratch_bytes: dict  # GPU-only buffers the dispatches need, by name


@dataclass
class NodeState:
    """GPU state of one SparseAttention node for one calling thread."""

    cache: ResidentCache
    buffers: BufferPool
    float16_storage: bool  # the node's tensors are float16 (its rotated keys are rounded to them)
    uploaded_layout: BlockPlan | None = None  # the layout the block_plan buffer holds now
    step_plan: StepPlan | None = None

    def release(self) -> None:
        self.step_plan = None
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
        self._lock = threading.Lock()
        # Sessions are finalised by the garbage collector, which can run anywhere, also
        # inside a call holding the lock: finalisers only queue their prefix here (deque
        # appends are atomic) and the next locked operation frees the state.
        self._release_queue: collections.deque[str] = collections.deque()
        self._timestamps: _Timestamps | None = None
        self._dispatch_facts_by_key: dict[tuple, DispatchFacts] = {}

    # -- public -----------------------------------------------------------------------
    def knows_layout(self, node_key: str) -> bool:
        return node_key in self._layouts

    def run(
        self,
        call: SparseAttentionCall,
        node_key: str = "default",
        settings: SessionSettings = DEFAULT_SETTINGS,
        *,
        reuse_host_arrays: bool = False,
        output: np.ndarray | None = None,
        while_gpu_runs: Callable[[], None] | None = None,
    ) -> CallResult:
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
        the presents' rows it already has there). The node's step plan stays for its next
        calls, which :meth:`replay` may then run.
        """
        _check_output(output, call.shape)
        start = time.perf_counter()
        with self._lock:
            result = self._run_call(call, node_key, settings, reuse_host_arrays, output, while_gpu_runs)
        result.stats.seconds = time.perf_counter() - start
        return result

    def replay(
        self,
        node_key: str,
        settings: SessionSettings,
        shape: CallShape,
        query: np.ndarray,
        key: np.ndarray | None,
        value: np.ndarray | None,
        past_key: np.ndarray,
        past_value: np.ndarray,
        cos_table: np.ndarray | None,
        sin_table: np.ndarray | None,
        make_call: Callable[[], SparseAttentionCall],
        *,
        output: np.ndarray | None = None,
        while_gpu_runs: Callable[[], None] | None = None,
    ) -> CallResult | None:
        """A fast-check decode call run by its node's step plan straight from the operator's
        tensors, or None where the plan does not serve it (nothing done): the caller then
        runs it (:meth:`run`, which leaves the plan for the next call). The inputs are the
        call's tensors as the operator has them (``shape`` validated them): the query, key
        and value rows, the whole pasts and rotary tables. The result is the one :meth:`run`
        would give with ``reuse_host_arrays`` (same bits: the same launches run on the same
        bytes); ``output`` and ``while_gpu_runs`` as there. Where a probed row differs from
        the cache, the call runs again at once after the exact check, as run()'s does:
        ``make_call()`` then gives the call (with its history: the caller's pasts), and its
        stats say ``probes_differed``."""
        _check_output(output, shape)
        start = time.perf_counter()
        state_key = (node_key, threading.get_ident())
        with self._lock:
            self._drain_releases()
            state = self._states.get(state_key)
            plan = None if state is None else self._replay_plan(state, node_key, shape, settings)
            if plan is None:
                return None
            tick = time.perf_counter()
            phases = {"sync": tick - start}
            with _DroppedOnFailure(self, state_key):
                probes = probe_rows(shape.past_lengths, shape.attributes.kv_num_heads, shape.total_sequence_length)
                plan.write_decode_inputs(shape, query, key, value, past_key, past_value, cos_table, sin_table, probes)
                phases["prepare"] = time.perf_counter() - tick
                result = self._run_plan(state, plan, shape, query, key, value, None, output, True, while_gpu_runs, None, phases)
            if result is None:
                result = self._again_with_exact_check(make_call(), node_key, settings, True, output)
            else:
                result.stats.replayed = True
        result.stats.seconds = time.perf_counter() - start
        return result

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

    # -- state ------------------------------------------------------------------------
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

    def _cache_dtype(self, float16_storage: bool, settings: SessionSettings):
        f16 = settings.f16_cache and float16_storage and "shader-f16" in self.context.features
        return np.float16 if f16 else np.float32

    @staticmethod
    def _fits(state: NodeState, shape: CallShape, dtype, float16_storage: bool) -> bool:
        cache = state.cache
        return (cache.batch, cache.kv_heads, cache.head_size, cache.max_rows, cache.dtype, state.float16_storage) == (
            shape.batch_size,
            shape.attributes.kv_num_heads,
            shape.head_size,
            shape.max_cache_len,
            np.dtype(dtype),
            float16_storage,
        )

    def _state(self, state_key, shape: CallShape, dtype, float16_storage: bool) -> NodeState:
        state = self._states.get(state_key)
        if state is None or not self._fits(state, shape, dtype, float16_storage):
            # A new cache shape is a new cache: nothing of the old one carries over.
            if state is not None:
                state.release()
            device = self.context.device
            cache = ResidentCache(
                device,
                shape.batch_size,
                shape.attributes.kv_num_heads,
                shape.head_size,
                shape.max_cache_len,
                dtype,
                self.context.max_binding_bytes,
                record_itemsize=model_itemsize(float16_storage),
            )
            state = self._states[state_key] = NodeState(cache, BufferPool(device, self.context.max_binding_bytes), float16_storage)
        return state

    def _layout_plan(self, call: SparseAttentionCall, node_key: str) -> BlockPlan:
        if call.block_row_indices is not None:
            return self.plans.get(call.block_row_indices, call.block_col_indices)
        plan = self._layouts.get(node_key)
        if plan is None:
            raise SparseAttentionError(f"SparseAttention node '{node_key}': the call carries no layout and none was passed before")
        return plan

    def _dispatch_facts(self, shape: CallShape) -> DispatchFacts:
        """The call's route and what it decides, worked out once per shapes and slice count
        (a decode step has those of the step before it)."""
        attention = self.tuning.attention_route(shape)
        key = (shape.facts, kernels.slice_count(shape, self.tuning, attention))
        facts = self._dispatch_facts_by_key.get(key)
        if facts is None or facts.route.tuning is not self.tuning:
            if len(self._dispatch_facts_by_key) > 256:
                self._dispatch_facts_by_key.clear()
            route = kernels.route(shape, self.tuning, attention)
            facts = DispatchFacts(route, kernels.dispatch_limits_ok(shape, route), kernels.scratch_bytes(shape, route))
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
                raise SparseAttentionError(
                    f"SparseAttention input '{name}': needs a {nbytes}-byte GPU buffer, more than this adapter binds ({limit} bytes)"
                )
        if not dispatch.limits_ok:
            raise SparseAttentionError("SparseAttention input 'query': batch, heads or sequence exceed the GPU's dispatch limits")

    def _packing(self, nbytes: int) -> np.ndarray:
        """The host array a call's small inputs are packed in before their one write, kept
        per thread and shared by every node's plan (warm in the CPU's caches, unlike one
        array per node). The padding between sections is never read, so it may hold any
        bytes (a test lends an array of all-ones bytes to prove it)."""
        return host_threads.reused("packed_inputs", (nbytes,), np.uint8)

    def _timed(self, settings: SessionSettings) -> bool:
        return settings.profiled and "timestamp-query" in self.context.features

    # -- the step plan ----------------------------------------------------------------
    def _plan_key(self, state: NodeState, shape: CallShape, settings: SessionSettings, splits: int, probing: bool) -> tuple:
        """What a node's step plan serves, for every call, replays too: the call's shapes,
        split-K's slice count, whether it probes, its settings and the tuning; and that
        nothing the plan holds has moved: the cache's buffers (a grown cache has new ones),
        the executor's shared buffers and the node's own (their pools' generations)."""
        return (shape.facts, splits, probing, settings, self.tuning, state.cache.key, self._scratch.generation, state.buffers.generation)

    def _replay_plan(self, state: NodeState, node_key: str, shape: CallShape, settings: SessionSettings) -> StepPlan | None:
        """The node's step plan if it serves this fast-check decode call as it stands: its key
        holds, and the call needs none of the general call's work before the plan (every row
        continues a history the cache holds, with room for its new row, and the GPU holds the
        node's layout)."""
        plan = state.step_plan
        if plan is None or not plan.replayable:
            return None
        if plan.key != self._plan_key(state, shape, settings, kernels.slice_count(shape, self.tuning, plan.route.attention), True):
            return None
        past, cache = shape.past_lengths, state.cache
        layout = self._layouts.get(node_key)
        return (
            plan
            if (
                layout is not None
                and state.uploaded_layout is layout
                and min(past) > 0
                and shape.rows_written <= cache.rows
                and cache.record.holds_lengths(past)
            )
            else None
        )

    def _step_plan(
        self, state: NodeState, shape: CallShape, settings: SessionSettings, dispatch: DispatchFacts, probing: bool, layout_buffer
    ) -> StepPlan:
        """The node's step plan for this call: the one it holds while its key holds, else a new one."""
        plan = state.step_plan
        if plan is None or plan.key != self._plan_key(state, shape, settings, dispatch.route.splits, probing):
            state.step_plan = None  # (a build that fails leaves none)
            plan = state.step_plan = self._build_plan(state, shape, settings, dispatch, probing, layout_buffer)
        return plan

    def _build_plan(
        self, state: NodeState, shape: CallShape, settings: SessionSettings, dispatch: DispatchFacts, probing: bool, layout_buffer
    ) -> StepPlan:
        """Everything a call of this key works out: its input and result sections in their
        buffers, the launches on them (with the GPU's fast check first when it probes), the
        read-back and the host arrays that receive it. The key is taken last, after every
        buffer the plan holds was made."""
        route = dispatch.route
        probes = probe_count(shape.attributes.kv_num_heads) if probing else 0
        flags = kernels.probe_grid(shape, probes) if probing else (0, 0, 0)
        sections, results = input_sections(shape, probes), result_sections(shape, flags[0] * flags[1])
        layout = step_layout(nbytes_of(sections), nbytes_of(results))
        pool = self._scratch
        inputs = pool.get("inputs", layout.input_bytes, STORAGE_IN)
        results_buffer = pool.get("results", layout.result_bytes, STORAGE_OUT)
        resources = {name: BufferRange(inputs, offset) for name, offset, _ in layout.inputs}
        if shape.packed_qkv:
            resources["key_source"] = resources["value_source"] = resources["query"]
        cache = state.cache
        resources.update(block_plan=BufferRange(layout_buffer), key_cache=BufferRange(cache.key), value_cache=BufferRange(cache.value))
        resources.update((name, BufferRange(results_buffer, offset, nbytes)) for name, offset, nbytes in layout.results)
        resources.update((name, BufferRange(pool.get(name, nbytes, wgpu.BufferUsage.STORAGE))) for name, nbytes in dispatch.scratch_bytes.items())
        cache_format = kernels.CacheFormat(rows=cache.rows, f16=cache.dtype == np.float16, round_keys_to_f16=state.float16_storage)
        dispatches = kernels.call_dispatches(shape, route, cache_format, resources)
        if probing:
            dispatches = [kernels.probe_compare(shape, cache_format, resources, probes)] + dispatches
        host_results = [host_threads.reused(name, dims, dtype) for name, dims, dtype in results]
        readback = new_readback(pool, layout, host_results, self.tuning.transfer_chunk_bytes)
        # Inputs within the bytes one write moves without staging are packed on the host.
        packed = self._packing(layout.input_bytes) if layout.input_bytes <= min(buffers.PACK_BYTES, buffers.STAGING_BYTES) else None
        launches = self._launches(state, dispatches)
        replayable = probing and shape.seq_len == 1 and packed is not None and readback is not None and not self._timed(settings)
        return StepPlan(
            key=self._plan_key(state, shape, settings, route.splits, probing),
            route=route,
            layout=layout,
            sections=sections,
            launches=launches,
            inputs=inputs,
            results=results_buffer,
            readback=readback,
            host_results=host_results,
            rotary=shape.attributes.do_rotary,
            probes=probes,
            packed=packed,
            replayable=replayable,
        )

    def _launches(self, state: NodeState, dispatches: list[Dispatch]) -> list[Launch]:
        """The dispatches ready to record: their pipelines, and bind groups over their buffers
        and their slot of the node's uniform buffer (written here: uniforms hold shapes,
        never per-call data)."""
        blocks = [d.program.pack_uniforms(d.uniforms) for d in dispatches]
        slot = max(aligned(block.nbytes) for block in blocks)
        packed = np.zeros(slot * len(blocks) // 4, np.uint32)
        for index, block in enumerate(blocks):
            packed[index * slot // 4 : index * slot // 4 + block.size] = block
        uniforms = state.buffers.get("uniforms", packed.nbytes, UNIFORM)
        device = self.context.device
        device.queue.write_buffer(uniforms, 0, packed)
        launches = []
        for index, planned in enumerate(dispatches):
            compiled = self.pipelines.get(planned.program)
            ranges = (BufferRange(uniforms, index * slot, slot),) + planned.bound()
            entries = [{"binding": i, "resource": {"buffer": r.buffer, "offset": r.offset, "size": r.nbytes}} for i, r in enumerate(ranges)]
            group = device.create_bind_group(layout=compiled.bind_group_layout, entries=entries)
            launches.append(Launch(planned.label, compiled.pipeline, group, planned.workgroups))
        return launches

    # -- the general call -------------------------------------------------------------
    def _run_call(
        self,
        call: SparseAttentionCall,
        node_key: str,
        settings: SessionSettings,
        reuse_host_arrays: bool,
        output: np.ndarray | None,
        while_gpu_runs: Callable[[], None] | None,
    ) -> CallResult:
        """run() under the executor's lock."""
        shape = call.shape
        layout = self._layout_plan(call, node_key)
        dtype = self._cache_dtype(call.float16_storage, settings)
        dispatch = self._dispatch_facts(shape)
        self._check_limits(shape, dtype, dispatch)
        self._drain_releases()
        state_key = (node_key, threading.get_ident())
        state = self._state(state_key, shape, dtype, call.float16_storage)
        with _DroppedOnFailure(self, state_key):
            result = self._execute(call, state, layout, settings, dispatch, reuse_host_arrays, output, while_gpu_runs)
        if call.block_row_indices is not None:
            self._layouts[node_key] = layout
        if result is None:
            return self._again_with_exact_check(call, node_key, settings, reuse_host_arrays, output)
        return result

    def _again_with_exact_check(
        self, call: SparseAttentionCall, node_key: str, settings: SessionSettings, reuse_host_arrays: bool, output: np.ndarray | None
    ) -> CallResult:
        """A call whose probed row differed from the cache (the GPU's fast check, in a general
        call or a replay): its output used a stale cache, so it runs again with the history
        compared in full. Its own rows land in the cache again; the caller's host work that
        ran while the GPU did is done."""
        result = self._run_call(dataclasses.replace(call, fast_check=False), node_key, settings, reuse_host_arrays, output, None)
        result.stats.probes_differed = True
        return result

    def _execute(
        self,
        call: SparseAttentionCall,
        state: NodeState,
        layout: BlockPlan,
        settings: SessionSettings,
        dispatch: DispatchFacts,
        reuse_host_arrays: bool,
        output: np.ndarray | None,
        while_gpu_runs: Callable[[], None] | None,
    ) -> CallResult | None:
        """One call the general way: the cache brought up to date, the node's plan (built anew
        where its key changed) run with the call's tensors. None where a probed row differed."""
        shape = call.shape
        phases = {}
        tick = time.perf_counter()
        upload = Upload()
        probing, compared, uploaded = self._sync_cache(call, state, upload)
        layout_buffer = self._upload_layout(state, layout, upload)
        phases["sync"] = time.perf_counter() - tick

        tick = time.perf_counter()
        plan = self._step_plan(state, shape, settings, dispatch, probing, layout_buffer)
        plan.write_inputs(_call_inputs(call, plan.probes), upload)
        phases["prepare"] = time.perf_counter() - tick
        result = self._run_plan(
            state, plan, shape, call.query, call.key, call.value, upload, output, reuse_host_arrays, while_gpu_runs, settings, phases
        )
        if result is not None:
            result.stats.history_rows_compared, result.stats.history_rows_uploaded = compared, uploaded
        return result

    def _sync_cache(self, call: SparseAttentionCall, state: NodeState, upload: Upload) -> tuple[bool, int, int]:
        """The resident cache made ready for the call: room for its rows, then what it lacks of
        the past into ``upload``. A call with probes and lengths the cache holds checks its
        probes on the GPU instead (probe_compare.wgsl.jinja): it runs as if they agreed, and
        runs again after the exact check if they did not. Returns (whether the call probes,
        history rows compared, history rows uploaded)."""
        shape, cache = call.shape, state.cache
        record = cache.record
        cache.reserve(shape.rows_written)
        probing = call.fast_check and record.holds_lengths(shape.past_lengths)
        if call.has_history and not probing:
            plans = record.sync(shape.past_lengths, call.history_key, call.history_value)
            cache.upload_spans(upload, plans, call.history_key, call.history_value)
            return False, 2 * shape.attributes.kv_num_heads * sum(shape.past_lengths), plans["key"].rows + plans["value"].rows
        if not probing and not record.holds_lengths(shape.past_lengths):
            raise SparseAttentionError("SparseAttention: the call carries no history rows, but the resident cache does not hold its past")
        for b, past in enumerate(shape.past_lengths):  # plain ints: a decode step's path
            if past == 0:
                record.valid[b] = 0  # a row starting afresh (a prompt)
        return probing, 0, 0

    @staticmethod
    def _upload_layout(state: NodeState, layout: BlockPlan, upload: Upload):
        """The node's layout buffer, with the call's layout written into it where it holds another."""
        buffer = state.buffers.get("block_plan", layout.nbytes, STORAGE_IN)
        if state.uploaded_layout is not layout:
            upload.write(layout.words, buffer, 0)
            state.uploaded_layout = layout
        return buffer

    # -- running a plan ---------------------------------------------------------------
    def _run_plan(
        self,
        state: NodeState,
        plan: StepPlan,
        shape: CallShape,
        query,
        key,
        value,
        upload: Upload | None,
        output: np.ndarray | None,
        reuse_host_arrays: bool,
        while_gpu_runs: Callable[[], None] | None,
        settings: SessionSettings | None,
        phases: dict,
    ) -> CallResult | None:
        """One call by its plan, its inputs written (``query``, ``key``, ``value``: its tensors,
        whose new rows the record learns): one submit, the caller's host work while the GPU
        runs, the wait and the results, then the record. ``settings`` (None: never profiled)
        say whether the launches are timed. Returns None, recording nothing, where the GPU's
        fast check found a probed row that differs from the cache."""
        tick = time.perf_counter()
        arrays = plan.result_arrays(output, reuse_host_arrays)
        timer = self._timer(len(plan.launches)) if settings is not None and self._timed(settings) else None
        download = self._submit(plan, upload, arrays, timer, settings)
        phases["encode_submit"] = time.perf_counter() - tick

        # Host work that needs no result overlaps the GPU's: the caller's, and the digests of
        # a multi-row call's value rows for the record (a prompt's: 8192 rows of 8 heads of 128
        # float32 take milliseconds).
        tick = time.perf_counter()
        if while_gpu_runs is not None:
            while_gpu_runs()
        record = state.cache.record
        value_terms = None
        if shape.seq_len > 1:
            value_terms = record.row_terms(shape.past_lengths, shape.key_totals, new_rows(shape, query, key, value, "value"))
        phases["while_gpu_runs"] = time.perf_counter() - tick

        tick = time.perf_counter()
        if download is None:
            plan.readback.read(self.context.device, arrays, self.tuning.map_spin_seconds)
        else:
            download.read()
        gpu_seconds = {} if timer is None else timer.read(self.context.device)
        phases["wait_read"] = time.perf_counter() - tick
        if plan.probes and arrays[-1].any():
            return None

        tick = time.perf_counter()
        new_key = arrays[1] if plan.rotary else None
        keys = new_key if new_key is not None else new_rows(shape, query, key, value, "key")
        # After the call each row's history ends at its key total (a prompt's padding rows
        # reach the cache, but are not history).
        record.append(shape.past_lengths, shape.key_totals, keys, new_rows(shape, query, key, value, "value"), value_terms)
        phases["record"] = time.perf_counter() - tick
        upload_bytes = (plan.upload_bytes if plan.packed is not None else 0) + (upload.nbytes if upload is not None else 0)
        return CallResult(arrays[0], new_key, CallStats(gpu_seconds=gpu_seconds, upload_bytes=upload_bytes, phases=phases))

    def _submit(
        self, plan: StepPlan, upload: Upload | None, arrays: list[np.ndarray], timer: _Timestamps | None, settings: SessionSettings | None
    ) -> Download | None:
        """The call's one command buffer, submitted: the ``upload``, the packed inputs, every
        launch (timed by ``timer``), the read-back copy. Returns the chunked read-back of
        results larger than a chunk (None: the plan's one copy)."""
        device, spin, chunk_bytes = self.context.device, self.tuning.map_spin_seconds, self.tuning.transfer_chunk_bytes
        download = None
        commands = recording.begin(device, timer is not None)
        try:
            if upload is not None:
                upload.encode(device, commands, self._scratch, plan.inputs, spin, chunk_bytes)
            if plan.packed is not None:
                commands.write_buffer(plan.inputs, 0, plan.packed)
            if timer is None:
                commands.compute_pass(plan.launches)
            else:
                timer.record(commands, plan.launches, settings.profile_whole_pass)
            if plan.readback is not None:
                commands.copy_buffer_to_buffer(plan.results, 0, plan.readback.buffer, 0, plan.readback.copy_bytes)
            else:
                download = plan.download(arrays, self._scratch, device, spin, chunk_bytes)
                download.encode(commands)
            commands.submit()
        finally:
            try:
                commands.release()  # never raises: a failed recording's own error is on its way
            finally:
                if upload is not None:  # (its staging buffers are the only temporaries)
                    self._scratch.release_temporaries()  # after the submit, or with the failed recording
        return download

    def _timer(self, launches: int) -> _Timestamps:
        """Timestamps for a profiled call of up to ``launches`` timed passes."""
        if self._timestamps is None or self._timestamps.count < 2 * launches:
            self._timestamps = _Timestamps(self.context.device, 2 * launches)
        return self._timestamps


class _Timestamps:
    """A profiled call's timestamps: a query set, the buffer it resolves into and a read-back
    buffer of their own (a timed call reads its results as any call does)."""

    def __init__(self, device, count: int):
        self.count = max(count, 8)
        self.query_set = device.create_query_set(type=wgpu.QueryType.timestamp, count=self.count)
        self._resolved = device.create_buffer(size=8 * self.count, usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC)
        self._readback = device.create_buffer(size=8 * self.count, usage=wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST)
        self._labels: list[str] = []

    def record(self, commands, launches: list[Launch], whole_pass: bool) -> None:
        """The launches in timed passes (one per launch, or one for all with ``whole_pass``),
        their timestamps resolved and copied for reading (WgpuPyRecording only)."""
        if whole_pass:
            passes, self._labels = [launches], ["pass"]
        else:
            passes, self._labels = [[launch] for launch in launches], [launch.label for launch in launches]
        count = 2 * len(passes)
        commands.timed_passes(passes, self.query_set)
        commands.resolve_query_set(self.query_set, count, self._resolved)
        commands.copy_buffer_to_buffer(self._resolved, 0, self._readback, 0, 8 * count)

    def read(self, device) -> dict[str, float]:
        """GPU seconds of each timed pass of the call just submitted, by label."""
        count = 2 * len(self._labels)
        with mapped(device, self._readback, False, 0, 8 * count) as memory:
            ticks = memory.view(np.uint64).copy()
        seconds = (ticks[1::2].astype(np.float64) - ticks[0::2]) * 1e-9  # WebGPU timestamps are ns
        return {label: float(s) for label, s in zip(self._labels, seconds)}


def _check_output(output: np.ndarray | None, shape: CallShape) -> None:
    """run()'s and replay()'s ``output``: None, or a writable C-contiguous float32 array of the output's shape."""
    if output is not None and (
        output.shape != shape.output_shape or output.dtype != np.float32 or not output.flags.c_contiguous or not output.flags.writeable
    ):
        raise ValueError(f"output must be a writable C-contiguous float32 array of shape {shape.output_shape}")


def _call_inputs(call: SparseAttentionCall, probes: int) -> list[np.ndarray]:
    """A general call's inputs in step_plan.input_sections' order (``probes``: probe rows per
    batch row, 0 when the call does not probe)."""
    shape = call.shape
    arrays = [call.query, np.asarray(shape.past_lengths, np.uint32)]
    if not shape.packed_qkv:
        arrays += [call.key, call.value]
    if shape.attributes.do_rotary:
        arrays += [call.cos_rows, call.sin_rows]
    if probes:
        slots = probe_rows(shape.past_lengths, shape.attributes.kv_num_heads, shape.total_sequence_length)
        arrays += [slots, gather_probes(call.history_key, slots), gather_probes(call.history_value, slots)]
    return arrays


class _DroppedOnFailure:
    """The context of a call of a node's state: any failure drops the state (what the GPU
    holds for the node is unknown then, so it starts afresh). The GPU's own failures (wgpu's
    errors, and this package's buffers and maps the adapter refused, which subclass them)
    are reported as GpuExecutionError; a host-side fault is reported as it is. (A class: a
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
            raise GpuExecutionError(
                f"SparseAttention node '{self.state_key[0]}' failed on {self.executor.context.description}: {kind.__name__}: {error}"
            ) from error
        return False  # a host-side fault: reported as it is


_executor = ProcessWide(WebGPUExecutor)


def get_executor() -> WebGPUExecutor:
    """The process-wide executor on the process-wide device."""
    return _executor.get()
