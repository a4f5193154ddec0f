"""Runs validated SparseAttention calls on the GPU.

One call is one submit: a single mapped upload (the new tokens, the history rows the
resident cache lacks, changed layout or rotary rows, the uniforms), the KV-append pass,
the attention pass and a single mapped read-back of what the host needs (the output, plus
the rotated new key rows when rotary is on). ``present_key``/``present_value`` are built on
the host from the incoming past plus the new rows, never read back from the GPU whole.

State per node (keyed by the identity ``prepare_model`` stamps): its resident KV cache
(kv_cache.py) and its other buffers, reused across calls and freed with the session. All
GPU work of the process goes through one lock: the device and queue are one resource, and
wgpu objects are not meant to be driven from several threads at once.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import wgpu

from ..block_plan import BlockPlan, BlockPlanCache
from ..spec import SparseAttentionCall, SparseAttentionError
from .buffers import BufferSet, Download, Upload
from .device import GpuContext, get_context
from .kernels import MAX_WORKGROUPS_PER_DIM, Pass, attention_pass, choose_tiling, kv_append_pass, query_rotary_pass
from .kv_cache import ResidentCache, SyncStats
from .process_wide import ProcessWide
from .programs import PipelineCache

_STORAGE_IN = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_DST
_STORAGE_OUT = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC
_UNIFORM = wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST


class GpuExecutionError(RuntimeError):
    """The GPU failed a call (device lost, out of memory, driver error); the node is reset."""


@dataclass
class NodeRuntime:
    """GPU state of one SparseAttention node of one session."""

    buffers: BufferSet
    cache: ResidentCache | None = None
    uploaded_plan: BlockPlan | None = None  # the plan the block_plan buffer holds now
    plan_buffer: object = None  # ... and the buffer it was uploaded into
    # Bind groups by (program, bound buffer objects): the buffers are reused from call to
    # call, so a decode step binds what the last one did. Keys hold the buffer objects
    # themselves (identity), so a reallocated buffer can never hit a stale group.
    bind_groups: dict = field(default_factory=dict)

    def release(self) -> None:
        self.bind_groups.clear()
        self.buffers.release()
        if self.cache is not None:
            self.cache.release()
            self.cache = None

    def gpu_bytes(self) -> int:
        return self.buffers.total_bytes() + (self.cache.nbytes if self.cache is not None else 0)


@dataclass
class CallStats:
    """What the last call did: for tests (upload volume) and benchmarks (times)."""

    seconds: float = 0.0
    gpu_seconds: float | None = None
    upload_bytes: int = 0
    cache: SyncStats = field(default_factory=SyncStats)


def _new_rows(call: SparseAttentionCall, which: str) -> np.ndarray:
    """This call's new key or value rows from the inputs, as (batch, kv_heads, seq, head)."""
    attrs, h = call.attributes, call.head_size
    if call.packed_qkv:
        start = (attrs.num_heads + (attrs.kv_num_heads if which == "value" else 0)) * h
        source = call.tensors["query"][:, :, start : start + attrs.kv_num_heads * h]
    else:
        source = call.tensors[which]
    return source.reshape(call.batch_size, call.seq_len, attrs.kv_num_heads, h).transpose(0, 2, 1, 3)


class WebGPUExecutor:
    def __init__(self, context: GpuContext | None = None):
        self.context = context or get_context()
        self.pipelines = PipelineCache(self.context.device)
        self.plans = BlockPlanCache()
        self._nodes: dict[str, NodeRuntime] = {}
        self._lock = threading.Lock()
        # Sessions are finalised by the garbage collector, which can run anywhere, also
        # inside a call holding the lock: finalisers only queue their prefix here (deque
        # appends are atomic) and the next locked operation frees the state.
        self._release_queue: collections.deque[str] = collections.deque()
        #: Benchmarks set this to time the compute work of each call with GPU timestamps
        #: (where the adapter has them); the result lands in ``last_stats.gpu_seconds``.
        self.profile = False
        #: Rotate queries inside the attention pass (default) or in a pass of their own.
        self.fuse_query_rotary = True
        #: Keep float16-storage nodes' caches as f16 on adapters with shader-f16 (measured
        #: faster, BENCHMARKS.md); lossless there, since every cached value is an f16 value.
        self.f16_cache = True
        self.last_stats = CallStats()
        self._timestamps = None

    # -- public -----------------------------------------------------------------------
    def run(
        self,
        call: SparseAttentionCall,
        node_key: str = "default",
        present_out: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Execute one call; returns (output, present_key, present_value) as float32.

        ``present_out`` may hold two writable arrays that already contain past_key and
        past_value and that nobody else will write (the bridge passes its own fresh copies):
        the new rows are written into them in place, they are returned, and the node keeps
        them as its record of what the GPU cache holds. Without it the executor allocates
        the presents and keeps private copies for that record.
        """
        self._check_limits(call)
        passes = self._passes(call)
        plan = self.plans.get(call.tensors["block_row_indices"], call.tensors["block_col_indices"])
        start = time.perf_counter()
        with self._lock:
            self._drain_releases()
            try:
                node = self._node(node_key, call)
                output, new_key, stats = self._execute(call, node, plan, passes)
                presents = self._presents(call, new_key, present_out)
                record = presents if present_out is not None else tuple(p.copy() for p in presents)
                node.cache.commit(call, *record)
            except Exception as error:
                # Whatever the GPU holds for this node is unknown now: start it afresh.
                failed = self._nodes.pop(node_key, None)
                if failed is not None:
                    failed.release()
                raise GpuExecutionError(f"SparseAttention failed on {self.context.description}: {error}") from error
        stats.seconds = time.perf_counter() - start
        self.last_stats = stats
        return (output,) + presents

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
        with self._lock:
            self._drain_releases()
            return list(self._nodes)

    def gpu_bytes(self) -> int:
        """Bytes of GPU memory held for all nodes (the soak benchmark watches it stay flat)."""
        with self._lock:
            return sum(node.gpu_bytes() for node in self._nodes.values())

    # -- steps ------------------------------------------------------------------------
    def _drain_releases(self) -> None:
        while self._release_queue:
            prefix = self._release_queue.popleft()
            for key in [k for k in self._nodes if k.startswith(prefix)]:
                self._nodes.pop(key).release()

    def _node(self, node_key: str, call: SparseAttentionCall) -> NodeRuntime:
        node = self._nodes.get(node_key)
        if node is None:
            node = NodeRuntime(BufferSet(self.context.device, self.context.max_binding_bytes))
            self._nodes[node_key] = node
        dtype = np.float16 if self._f16_cache(call) else np.float32
        if node.cache is None or node.cache.shape != call.cache_shape or node.cache.dtype != dtype:
            # A new cache shape is a new cache: nothing of the old one carries over.
            if node.cache is not None:
                node.cache.release()
            node.cache = ResidentCache(self.context.device, call.cache_shape, dtype)
        return node

    def _f16_cache(self, call: SparseAttentionCall) -> bool:
        return self.f16_cache and call.float16_storage and "shader-f16" in self.context.features

    def _passes(self, call: SparseAttentionCall) -> list[Pass]:
        tiling = choose_tiling(call, self.context.workgroup_storage_bytes, self.fuse_query_rotary)
        f16_cache = self._f16_cache(call)
        passes = [kv_append_pass(call, f16_cache)]
        if call.attributes.do_rotary and not tiling.fuse_query_rotary:
            passes.append(query_rotary_pass(call))
        return passes + [attention_pass(call, tiling, f16_cache)]

    def _check_limits(self, call: SparseAttentionCall) -> None:
        """Refuse, before any GPU work, a call whose buffers or dispatch the adapter cannot hold."""
        limit = self.context.max_binding_bytes
        attrs = call.attributes
        sizes = {
            "past_key": int(np.prod(call.cache_shape)) * (2 if self._f16_cache(call) else 4),
            "query": call.tensors["query"].nbytes,
            "output": int(np.prod(call.output_shape)) * 4,
        }
        for name, nbytes in sizes.items():
            if nbytes > limit:
                raise SparseAttentionError(
                    f"SparseAttention input '{name}': needs a {nbytes}-byte GPU buffer, more than this adapter binds ({limit} bytes)"
                )
        if -(-call.seq_len // 4) > MAX_WORKGROUPS_PER_DIM or attrs.num_heads > MAX_WORKGROUPS_PER_DIM or call.batch_size > MAX_WORKGROUPS_PER_DIM:
            raise SparseAttentionError("SparseAttention input 'query': batch, heads or sequence exceed the GPU's dispatch limits")

    def _execute(self, call: SparseAttentionCall, node: NodeRuntime, plan: BlockPlan, passes):
        device, t = self.context.device, call.tensors
        buffers = node.buffers
        attrs = call.attributes
        output = np.empty(call.output_shape, dtype=np.float32)
        new_key = None

        upload = Upload(buffers)
        cache_stats = node.cache.sync(call, upload)
        bound = {
            "query": buffers.get("query", t["query"].nbytes, _STORAGE_IN),
            "key_cache": node.cache.key,
            "value_cache": node.cache.value,
            "row_past": buffers.get("row_past", call.batch_size * 4, _STORAGE_IN),
            "block_plan": buffers.get("block_plan", plan.nbytes, _STORAGE_IN),
            "output": buffers.get("output", output.nbytes, _STORAGE_OUT),
        }
        upload.add(t["query"], bound["query"])
        if call.packed_qkv:
            bound["key_source"] = bound["value_source"] = bound["query"]
        else:
            for name in ("key", "value"):
                bound[f"{name}_source"] = buffers.get(name, t[name].nbytes, _STORAGE_IN)
                upload.add(t[name], bound[f"{name}_source"])
        upload.add(np.asarray(call.past_lengths, dtype=np.uint32), bound["row_past"])
        # Layouts rarely change: the plan cache hands back the same object for the same
        # layout, so identity says whether the GPU copy is current.
        if node.uploaded_plan is not plan or node.plan_buffer is not bound["block_plan"]:
            upload.add(plan.words, bound["block_plan"])
            node.uploaded_plan, node.plan_buffer = plan, bound["block_plan"]
        if attrs.do_rotary:
            self._upload_rotary_rows(call, buffers, upload, bound)
            new_key = np.empty((call.batch_size, attrs.kv_num_heads, call.seq_len, call.head_size), dtype=np.float32)
            bound["new_key"] = buffers.get("new_key", new_key.nbytes, _STORAGE_OUT)
        if any(binding.name == "q_rotated" for gpu_pass in passes for binding in gpu_pass.program.bindings):
            bound["q_rotated"] = buffers.get("q_rotated", int(np.prod(call.output_shape)) * 4, wgpu.BufferUsage.STORAGE)
        for gpu_pass in passes:
            words = gpu_pass.program.pack_uniforms(gpu_pass.uniforms)
            bound[f"uniforms:{gpu_pass.program.template}"] = uniform = buffers.get(f"uniforms:{gpu_pass.program.template}", words.nbytes, _UNIFORM)
            upload.add(words, uniform)

        encoder = device.create_command_encoder()
        upload.encode(encoder)
        timing = self._timestamp_writes()
        compute = encoder.begin_compute_pass(timestamp_writes=timing)
        for gpu_pass in passes:
            self._dispatch(compute, gpu_pass, bound, node.bind_groups)
        compute.end()
        download = Download(buffers)
        download.add("output", bound["output"], output.nbytes)
        if new_key is not None:
            download.add("new_key", bound["new_key"], new_key.nbytes)
        ticks = None
        if timing is not None:
            query_set, resolved = self._timestamps
            encoder.resolve_query_set(query_set, 0, 2, resolved, 0)
            ticks = np.zeros(2, dtype=np.uint64)
            download.add("timestamps", resolved, ticks.nbytes)
        download.encode(encoder)
        device.queue.submit([encoder.finish()])
        download.read_into({"output": output, "new_key": new_key, "timestamps": ticks})
        stats = CallStats(
            gpu_seconds=None if ticks is None else float(ticks[1] - ticks[0]) * 1e-9,  # WebGPU timestamps are ns
            upload_bytes=upload.nbytes,
            cache=cache_stats,
        )
        return output, new_key, stats

    def _upload_rotary_rows(self, call: SparseAttentionCall, buffers: BufferSet, upload: Upload, bound: dict) -> None:
        """Only the cos/sin rows of this call's positions: the kernels read no others."""
        first = min(call.past_lengths)
        end = max(call.past_lengths) + call.seq_len
        for name in ("cos_cache", "sin_cache"):
            table = call.tensors[name]
            bound[name] = buffers.get(name, table.nbytes, _STORAGE_IN)
            upload.add(table[first:end], bound[name], first * table.shape[1] * 4)

    def _timestamp_writes(self):
        if not self.profile or "timestamp-query" not in self.context.features:
            return None
        if self._timestamps is None:
            device = self.context.device
            query_set = device.create_query_set(type=wgpu.QueryType.timestamp, count=2)
            resolved = device.create_buffer(size=16, usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC)
            self._timestamps = (query_set, resolved)
        return {"query_set": self._timestamps[0], "beginning_of_pass_write_index": 0, "end_of_pass_write_index": 1}

    def _dispatch(self, compute, gpu_pass: Pass, bound: dict, bind_groups: dict) -> None:
        compiled = self.pipelines.get(gpu_pass.program)
        program = gpu_pass.program
        resources = (bound[f"uniforms:{program.template}"],) + tuple(bound[b.name] for b in program.bindings)
        key = (program.cache_key, resources)
        bind_group = bind_groups.get(key)
        if bind_group is None:
            if len(bind_groups) > 32:  # shapes keep changing: start over rather than grow
                bind_groups.clear()
            entries = [{"binding": index, "resource": {"buffer": buffer, "offset": 0}} for index, buffer in enumerate(resources)]
            bind_group = bind_groups[key] = self.context.device.create_bind_group(layout=compiled.bind_group_layout, entries=entries)
        compute.set_pipeline(compiled.pipeline)
        compute.set_bind_group(0, bind_group)
        compute.dispatch_workgroups(*gpu_pass.workgroups)

    def _presents(self, call: SparseAttentionCall, new_key: np.ndarray | None, present_out) -> tuple[np.ndarray, np.ndarray]:
        if present_out is None:
            present_key = np.array(call.tensors["past_key"], dtype=np.float32, copy=True)
            present_value = np.array(call.tensors["past_value"], dtype=np.float32, copy=True)
        else:
            present_key, present_value = present_out
        keys = new_key if new_key is not None else _new_rows(call, "key")
        values = _new_rows(call, "value")
        for b, past in enumerate(call.past_lengths):
            present_key[b, :, past : past + call.seq_len] = keys[b]
            present_value[b, :, past : past + call.seq_len] = values[b]
        return present_key, present_value


_executor = ProcessWide(WebGPUExecutor)


def get_executor() -> WebGPUExecutor:
    """The process-wide executor on the process-wide device."""
    return _executor.get()
