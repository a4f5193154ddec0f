#!/usr/bin/env python3
"""Measure the platform facts the design rests on (docs/design.md sections 2 and 3).

    python scripts/measure_platform.py                 # everything, a few seconds
    python scripts/measure_platform.py --only wgpu     # one group: wgpu, cold, copies, bridge, digest, transfers
    python scripts/measure_platform.py --only transfers --transfer-mb 201 167 --chunks-mb 0 64 32 16 8

Every figure is a median over repeated calls after a warm-up, printed as a markdown table
with the machine and the command, so it can be pasted into the docs as it is.

- wgpu: host-side cost of the wgpu-py calls one SparseAttention call makes (encoder,
  small writes, mapping for write and for read, with and without wgpu-py's extra submit,
  waiting on the calling thread or on wgpu-py's poll thread).
- cold: the executor's own recording of a decode call (a 173 KB input write, four dispatches,
  a copy, one submit, a map for read), back to back and with 4 or 64 MB of other memory read
  between calls: inside a decode step the caches are cold, and every call pays for it.
- copies: a plain run's floor, ORT copying a cache (Identity) against the bridge's copy of a
  past into its present.
- bridge: one call of a custom op of custom_op.py that does nothing (ORT's call into Python
  and back), with one input and with eleven, against a session of one Identity node.
- digest: the per-chunk 64-bit digest of history rows the exact cache check computes.
- transfers: a prompt's two large transfers (the packed query up through staging, results
  back through read-back; Phi-3-small at 8192 tokens: 201 and 167 MB) through buffers.py's
  Upload and Download, moved whole and in chunks of each size (Tuning.transfer_chunk_bytes),
  in turn: the host's side up to the submit, then the wait and the read.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import numpy as np

from sparse_attention_op.cli.arguments import positive


def median_us(function, reps: int = 200) -> float:
    function()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def row(name: str, micros: float, note: str = "") -> None:
    print(f"| {name} | {micros:.1f} | {note} |", flush=True)


def measure_wgpu() -> None:
    import wgpu

    from sparse_attention_op.webgpu.device import get_context
    from sparse_attention_op.webgpu.mapping import mapped

    context = get_context()
    device = context.device
    print(f"\n### wgpu-py calls on {context.description}\n\n| call | us (median) | note |\n|---|---|---|")
    usage = wgpu.BufferUsage
    storage = device.create_buffer(size=1 << 20, usage=usage.STORAGE | usage.COPY_DST | usage.COPY_SRC)
    other = device.create_buffer(size=1 << 20, usage=usage.STORAGE | usage.COPY_DST | usage.COPY_SRC)
    small = np.ones(4096, np.float32)  # 16 KiB, a decode step's query at the Phi-3-small shape

    row("create_command_encoder + finish + submit (empty)", median_us(lambda: device.queue.submit([device.create_command_encoder().finish()])))
    row("queue.write_buffer 16 KiB", median_us(lambda: device.queue.write_buffer(storage, 0, small)))
    row("queue.write_buffer 256 B", median_us(lambda: device.queue.write_buffer(storage, 0, small[:64])))

    def encode_copies(n):
        encoder = device.create_command_encoder()
        for _ in range(n):
            encoder.copy_buffer_to_buffer(storage, 0, other, 0, 256)
        return encoder

    base = median_us(lambda: encode_copies(0).finish())
    row("copy_buffer_to_buffer (encode, each)", (median_us(lambda: encode_copies(20).finish()) - base) / 20)

    staging_w = device.create_buffer(size=1 << 20, usage=usage.MAP_WRITE | usage.COPY_SRC)

    def map_write():
        staging_w.map_sync(wgpu.MapMode.WRITE, 0, 1 << 16)
        staging_w.write_mapped(small, 0)
        staging_w.unmap()

    row("map_sync(WRITE) + write 16 KiB + unmap, idle buffer", median_us(map_write))

    module = device.create_shader_module(
        code="""
@group(0) @binding(0) var<storage, read_write> data: array<f32>;
@compute @workgroup_size(64) fn main(@builtin(global_invocation_id) id: vec3<u32>) { data[id.x] = data[id.x] + 1.0; }
"""
    )
    layout = device.create_bind_group_layout(
        entries=[{"binding": 0, "visibility": wgpu.ShaderStage.COMPUTE, "buffer": {"type": wgpu.BufferBindingType.storage}}]
    )
    pipeline = device.create_compute_pipeline(
        layout=device.create_pipeline_layout(bind_group_layouts=[layout]), compute={"module": module, "entry_point": "main"}
    )
    group = device.create_bind_group(layout=layout, entries=[{"binding": 0, "resource": {"buffer": storage, "offset": 0, "size": 1 << 20}}])
    row(
        "create_bind_group (1 buffer)",
        median_us(
            lambda: device.create_bind_group(layout=layout, entries=[{"binding": 0, "resource": {"buffer": storage, "offset": 0, "size": 1 << 20}}])
        ),
    )

    def encode_dispatches(n):
        encoder = device.create_command_encoder()
        compute = encoder.begin_compute_pass()
        for _ in range(n):
            compute.set_pipeline(pipeline)
            compute.set_bind_group(0, group)
            compute.dispatch_workgroups(1, 1, 1)
        compute.end()
        return encoder

    base = median_us(lambda: encode_dispatches(0).finish())
    row("set_pipeline + set_bind_group + dispatch (encode, each)", (median_us(lambda: encode_dispatches(20).finish()) - base) / 20)
    row("begin_compute_pass + end (empty)", base)

    readback = device.create_buffer(size=1 << 16, usage=usage.MAP_READ | usage.COPY_DST)
    out = np.empty(4096, np.float32)

    def round_trip(mode: str):
        encoder = encode_dispatches(1)
        encoder.copy_buffer_to_buffer(storage, 0, readback, 0, out.nbytes)
        device.queue.submit([encoder.finish()])
        if mode == "mapping.py":
            with mapped(device, readback, False, 0, out.nbytes) as memory:
                np.copyto(out.view(np.uint8), memory)
            return
        if mode == "map_sync":
            readback.map_sync(wgpu.MapMode.READ, 0, out.nbytes)
        else:
            promise = readback.map_async("READ_NOSYNC", 0, out.nbytes)
            if mode == "nosync+own poll":
                device._poll_wait()
            promise.sync_wait()
        np.copyto(out.view(np.uint8), np.frombuffer(readback.read_mapped(0, out.nbytes, copy=False), np.uint8))
        readback.unmap()

    notes = {
        "map_sync": "wgpu-py's default: an extra empty submit before mapping",
        "nosync": "waits on wgpu-py's poll thread",
        "nosync+own poll": "wgpuDevicePoll(wait) on the calling thread, the poll thread woken too",
        "mapping.py": "the executor's maps: wgpu-native's map and a blocking poll on the calling thread only",
    }
    for _ in range(2):  # twice, interleaved: the host's timing drifts
        for mode in ("map_sync", "nosync", "nosync+own poll", "mapping.py"):
            row(f"dispatch + copy + map READ + read 16 KiB ({mode})", median_us(lambda: round_trip(mode), 300), notes[mode])

    big = np.ones(32 << 18, np.float32)  # 32 MiB
    big_buffer = device.create_buffer(size=big.nbytes, usage=usage.STORAGE | usage.COPY_DST | usage.COPY_SRC)
    big_staging = device.create_buffer(size=big.nbytes, usage=usage.MAP_WRITE | usage.COPY_SRC)

    def upload_big():
        big_staging.map_sync(wgpu.MapMode.WRITE, 0, big.nbytes)
        big_staging.write_mapped(big, 0)
        big_staging.unmap()
        encoder = device.create_command_encoder()
        encoder.copy_buffer_to_buffer(big_staging, 0, big_buffer, 0, big.nbytes)
        device.queue.submit([encoder.finish()])

    seconds = median_us(upload_big, 20) * 1e-6
    row("32 MiB upload via mapped staging", seconds * 1e6, f"{big.nbytes / seconds / 1e9:.1f} GB/s")
    seconds = median_us(lambda: (device.queue.write_buffer(big_buffer, 0, big), device.queue.submit([])), 20) * 1e-6
    row("32 MiB queue.write_buffer", seconds * 1e6, f"{big.nbytes / seconds / 1e9:.1f} GB/s")


def measure_cold(reps: int = 250) -> None:
    import wgpu

    from sparse_attention_op.webgpu import recording
    from sparse_attention_op.webgpu.executor import Launch, get_executor
    from sparse_attention_op.webgpu.mapping import mapped

    executor = get_executor()
    context, spin = executor.context, executor.tuning.map_spin_seconds  # the executor's device and its wait
    device, usage = context.device, wgpu.BufferUsage
    module = device.create_shader_module(
        code="""
@group(0) @binding(0) var<storage, read> source: array<f32>;
@group(0) @binding(1) var<storage, read_write> result: array<f32>;
@compute @workgroup_size(64) fn main(@builtin(global_invocation_id) id: vec3<u32>) { if (id.x == 0u) { result[0] = source[0]; } }
"""
    )
    pipeline = device.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": "main"})
    inputs = device.create_buffer(size=1 << 20, usage=usage.STORAGE | usage.COPY_DST)
    results = device.create_buffer(size=1 << 16, usage=usage.STORAGE | usage.COPY_SRC)
    readback = device.create_buffer(size=1 << 16, usage=usage.MAP_READ | usage.COPY_DST)
    group = device.create_bind_group(
        layout=pipeline.get_bind_group_layout(0),
        entries=[{"binding": 0, "resource": {"buffer": inputs}}, {"binding": 1, "resource": {"buffer": results}}],
    )
    launches = [Launch("dispatch", pipeline, group, (1, 1, 1))] * 4
    packed = np.zeros(173056, np.uint8)  # a fast decode step's inputs at the Phi-3-small shape, probe rows included
    print(f"\n### A decode call's recording on {context.description}, warm and cold (us, median of {reps})\n")
    print("| between calls | record | finish + submit | wait + read |\n|---|---|---|---|")
    for evict_mb in (0, 4, 64):
        other = np.ones(max(evict_mb, 1) << 20, np.uint8)
        spans = []
        for _ in range(reps + 20):
            if evict_mb:
                other.sum()  # what a decode step's other work does to the CPU's caches
            start = time.perf_counter()
            commands = recording.begin(device, False)
            commands.write_buffer(inputs, 0, packed)
            commands.compute_pass(launches)
            commands.copy_buffer_to_buffer(results, 0, readback, 0, 16384)
            recorded = time.perf_counter()
            commands.submit()
            commands.release()
            submitted = time.perf_counter()
            with mapped(device, readback, False, 0, 16384, spin):
                pass
            spans.append((recorded - start, submitted - recorded, time.perf_counter() - submitted))
        medians = [statistics.median(s[i] for s in spans[20:]) * 1e6 for i in range(3)]
        print(f"| {f'{evict_mb} MB read' if evict_mb else 'nothing'} | {medians[0]:.1f} | {medians[1]:.1f} | {medians[2]:.1f} |", flush=True)


def _session(nodes, inputs, outputs, initializers=()):
    import onnxruntime as ort
    from onnx import helper

    graph = helper.make_graph(nodes, "probe", inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def measure_copies(capacities) -> None:
    """A plain run's floor: ORT copying a cache (Identity to a graph output) against the
    bridge's copy of a past into its present (presents.copy_past, over the host's threads)."""
    from onnx import TensorProto, helper

    from sparse_attention_op.ort.presents import copy_past

    print("\n### A cache (1, 8, capacity, 128) float32 copied\n\n| copy | us (median) | note |\n|---|---|---|")
    f32 = TensorProto.FLOAT
    for capacity in capacities:
        shape = [1, 8, capacity, 128]
        past = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
        present = np.empty_like(past)
        identity = _session(
            [helper.make_node("Identity", ["past"], ["present"])],
            [helper.make_tensor_value_info("past", f32, shape)],
            [helper.make_tensor_value_info("present", f32, shape)],
        )
        seconds = median_us(lambda: identity.run(None, {"past": past}), 20) * 1e-6
        row(f"ORT Identity, plain run, capacity {capacity}", seconds * 1e6, f"{past.nbytes / seconds / 1e9:.1f} GB/s")
        seconds = median_us(lambda: copy_past(present, past), 20) * 1e-6
        row(f"presents.copy_past, capacity {capacity}", seconds * 1e6, f"{past.nbytes / seconds / 1e9:.1f} GB/s")


def measure_bridge() -> None:
    """A custom op of custom_op.py (the bridge's mechanism) doing nothing, against a session
    of one Identity node: ORT's call into Python and back, and locating inputs."""

    from onnx import TensorProto, helper

    from sparse_attention_op.ort import custom_op
    from sparse_attention_op.ort import extensions as _ortx_compat
    from sparse_attention_op.ort.session import session_options

    for count in (1, 11):
        name = f"SaoMeasureBridge{count}"

        def compute(kernel, context, count=count):
            for index in range(count):
                context.input(index)
            context.output(0, (2,))[...] = 0

        declaration = custom_op.OpDeclaration(
            name, tuple(custom_op.Slot(custom_op.FLOAT) for _ in range(count)), (custom_op.Slot(custom_op.FLOAT),), ()
        )
        custom_op.define(declaration, lambda attributes, constants: None, compute, _ortx_compat.library())
    inputs = [helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, None) for i in range(11)]
    feeds = {f"x{i}": np.zeros((1, 1, 4096) if i == 0 else (1, 4), np.float32) for i in range(11)}
    print("\n### The bridge's custom op (ctypes callbacks through onnxruntime-extensions)\n\n| call | us (median) | note |\n|---|---|---|")
    for count, op in ((1, "SaoMeasureBridge1"), (11, "SaoMeasureBridge11"), (1, "Identity")):
        node = helper.make_node(op, [f"x{i}" for i in range(count)], ["y"], domain="" if op == "Identity" else "ai.onnx.contrib")
        graph = helper.make_graph([node], "bridge", inputs[:count], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.contrib", 1)], ir_version=10)
        import onnxruntime as ort

        session = ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
        call = {f"x{i}": feeds[f"x{i}"] for i in range(count)}
        row(
            f"session.run of {op} with {count} input(s)",
            median_us(lambda: session.run(None, call), 500),
            "the op reads every input's location" if op != "Identity" else "ORT alone",
        )


def measure_digest() -> None:
    print("\n### numpy digest of history rows (uint64 words x odd multipliers, summed mod 2^64)\n\n| rows | us (median) | note |\n|---|---|---|")
    rng = np.random.default_rng(0)
    for rows in (1000, 8152):
        history = rng.standard_normal((1, 8, rows, 128), dtype=np.float32)
        multipliers = rng.integers(0, 2**63, 128, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        words = history.view(np.uint64).reshape(1, 8, rows // 2, 128)
        seconds = median_us(lambda: words @ multipliers, 30) * 1e-6
        row(f"(1, 8, {rows}, 128) float32, 2-row chunks", seconds * 1e6, f"{history.nbytes / seconds / 1e9:.1f} GB/s")


def measure_transfers(megabytes: tuple[int, int], chunks_mb: list[int], spin: float | None = None, rounds: int = 6) -> None:
    import wgpu

    from sparse_attention_op.webgpu import get_executor, recording
    from sparse_attention_op.webgpu.buffers import BufferPool, Download, Upload
    from sparse_attention_op.webgpu.programs import BufferRange

    context = get_executor().context
    device = context.device
    spin = get_executor().tuning.map_spin_seconds if spin is None else spin
    up, down = (mb << 20 for mb in megabytes)
    print(
        f"\n### {megabytes[0]} MB up through staging, {megabytes[1]} MB back, {context.description} (ms, median of "
        f"{rounds - 1} rounds; maps spin {spin * 1e3:g} ms)\n\n| chunk | upload and submit | wait and read | total |\n|---|---|---|---|"
    )
    host_in = np.random.default_rng(0).standard_normal(up // 4, dtype=np.float32)
    host_out = np.empty(down // 4, np.float32)
    middle = device.create_buffer(size=max(up, down), usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_DST | wgpu.BufferUsage.COPY_SRC)
    pool = BufferPool(device, 1 << 40)  # staging and read-back buffers are never bound
    times = {chunk: [] for chunk in chunks_mb}
    for round_index in range(rounds):  # chunk sizes in turn, the first round a warm-up
        for chunk in chunks_mb:
            start = time.perf_counter()
            upload = Upload()
            upload.section(host_in)
            commands = recording.begin(device, False)
            upload.encode(device, commands, pool, middle, spin, chunk_bytes=chunk << 20)
            download = Download(pool, device, spin, chunk_bytes=chunk << 20)
            download.add(host_out, BufferRange(middle, 0, down))
            download.encode(commands)
            commands.submit()
            submitted = time.perf_counter()
            download.read()
            if round_index:
                times[chunk].append((submitted - start, time.perf_counter() - submitted))
        if not np.array_equal(host_out, host_in[: host_out.size]):
            raise AssertionError("a transfer lost bytes")
    for chunk in chunks_mb:
        sent, read = (statistics.median(t[i] for t in times[chunk]) * 1e3 for i in (0, 1))
        print(f"| {'whole' if chunk == 0 else f'{chunk} MiB'} | {sent:.2f} | {read:.2f} | {sent + read:.2f} |", flush=True)
    pool.release()
    middle.destroy()


GROUPS = ["wgpu", "cold", "copies", "bridge", "digest", "transfers"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=GROUPS, nargs="*")
    parser.add_argument("--capacities", type=positive, nargs="*", default=[8192, 131072])
    parser.add_argument(
        "--transfer-mb",
        type=positive,
        nargs=2,
        default=[201, 167],
        metavar=("UP", "DOWN"),
        help="transfers: MB up and back (default: a prompt of 8192 tokens; lavapipe binds at most 128 MiB)",
    )
    parser.add_argument("--chunks-mb", type=int, nargs="*", default=[0, 64, 32, 16, 8, 2], help="transfers: chunk sizes, 0 for whole")
    parser.add_argument(
        "--spin-seconds", type=float, default=None, help="transfers: how long maps spin before they block (default: the adapter's tuning)"
    )
    args = parser.parse_args()
    groups = args.only or GROUPS
    print(f"# {' '.join(sys.argv)}\n# {platform.node()} ({os.cpu_count()} CPUs), numpy {np.__version__}")
    if "wgpu" in groups:
        measure_wgpu()
    if "cold" in groups:
        measure_cold()
    if "copies" in groups:
        measure_copies(args.capacities)
    if "bridge" in groups:
        measure_bridge()
    if "digest" in groups:
        measure_digest()
    if "transfers" in groups:
        measure_transfers(tuple(args.transfer_mb), args.chunks_mb, args.spin_seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
