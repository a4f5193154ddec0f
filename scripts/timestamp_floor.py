#!/usr/bin/env python3
"""What a timed compute pass costs with nothing in it: the floor under every pass time.

    python scripts/timestamp_floor.py

tune_kernels.py and the executor's profile time each dispatch in a compute pass of its own
(unless ``profile_whole_pass``), between the pass's start and end timestamps. This script times an empty dispatch (256
invocations a workgroup, 1 to 4096 workgroups) the same way, 64 passes in one submission
after a dispatch that keeps the GPU busy long enough for its clocks to rise, and prints the
median and least of the later 32. A call of two dispatches timed per dispatch counts this
floor twice; repeated back to back in one timed pass (tune_kernels.py --whole-pass), once
over all the repetitions.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import wgpu

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from sparse_attention_op.benchmarking.clocks import sm_clock  # noqa: E402
from sparse_attention_op.webgpu.device import get_context  # noqa: E402
from sparse_attention_op.webgpu.executor import Launch  # noqa: E402
from sparse_attention_op.webgpu.recording import WgpuPyRecording  # noqa: E402

PASSES = 64
EMPTY = """@group(0) @binding(0) var<storage, read_write> data: array<f32>;
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {
  if (id.x == 0xffffffffu) { data[0] = 1.0; }  // never true: the dispatch does nothing
}"""
#: An FMA chain per invocation: milliseconds on a GPU (tens of seconds on lavapipe).
WARMER = """@group(0) @binding(0) var<storage, read_write> data: array<f32>;
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {
  var x = f32(id.x);
  for (var i = 0u; i < 200000u; i = i + 1u) { x = x * 0.999 + 1.0; }
  data[id.x % 1000000u] = x;
}"""


def main() -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    context = get_context()
    if "timestamp-query" not in context.features:
        print("this adapter has no timestamp queries", file=sys.stderr)
        return 2
    device = context.device
    data = device.create_buffer(size=4 << 20, usage=wgpu.BufferUsage.STORAGE)
    pipelines = {}
    for name, code in (("empty", EMPTY), ("warmer", WARMER)):
        pipeline = device.create_compute_pipeline(layout="auto", compute={"module": device.create_shader_module(code=code), "entry_point": "main"})
        group = device.create_bind_group(layout=pipeline.get_bind_group_layout(0), entries=[{"binding": 0, "resource": {"buffer": data}}])
        pipelines[name] = (pipeline, group)
    query_set = device.create_query_set(type=wgpu.QueryType.timestamp, count=2 * (PASSES + 1))
    resolved = device.create_buffer(size=16 * (PASSES + 1), usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC)
    clock = sm_clock()
    print(f"# {context.description}\n\n| workgroups | median us | least us | SM MHz |\n|---|---|---|---|")
    for workgroups in (1, 32, 256, 4096):
        # The executor's own timed recording (one timed pass per list of launches); the
        # warmer's pass is timed too, and dropped.
        commands = WgpuPyRecording(device)
        warmer = Launch("warmer", *pipelines["warmer"], (4096, 1, 1))
        empty = Launch("empty", *pipelines["empty"], (workgroups, 1, 1))
        commands.timed_passes([[warmer]] + [[empty]] * PASSES, query_set)
        commands.resolve_query_set(query_set, 2 * (PASSES + 1), resolved)
        commands.submit()
        ticks = np.frombuffer(device.queue.read_buffer(resolved), np.uint64).astype(np.float64)
        micros = (ticks[3::2] - ticks[2::2])[PASSES // 2 :] * 1e-3  # timestamps are ns; pass 0 is the warmer
        mhz = clock.read()
        print(f"| {workgroups} | {np.median(micros):.2f} | {micros.min():.2f} | {'-' if mhz is None else mhz} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
