"""Tunables per adapter, in one place: every code-shaping choice the kernels make, and why.

A :class:`Tuning` is chosen once per device from its limits and features
(:func:`choose_tuning`); the kernels module reads it and nothing else decides tile sizes.
Shape-dependent choices that follow from a tuning (which attention pass serves a call, how
many queries a tile holds, how many splits a decode query gets) are methods here too, so
the reasoning stays next to the numbers.

Four attention passes exist (kernels.py builds them; :meth:`Tuning.attention_route` picks):

* ``tiled``: the throughput prefill pass of GPUs (prefill_tiled.wgsl.jinja). A workgroup
  owns a tile of queries inside one block row and walks that row's selected keys in tiles
  staged in workgroup memory, with register-blocked Q.K^T and P.V products and an online
  softmax. Tails and chunks that start mid-tile are tiles with idle rows.
* ``split``: split-K decode (decode_split.wgsl.jinja) for one query or a short chunk
  (S <= decode_max_queries): each query's selected keys are cut into slices of equal key
  count, one workgroup each, and the last slice of each query to finish combines the
  partial softmaxes (merge_slices.wgsl.jinja; decode_merge.wgsl.jinja runs it as a pass
  of its own on CPU adapters, with decode_split_merges off, and where the adapter lacks
  coherent storage or binds too few buffers: decode_merges_in_split).
* ``rows``: the prefill pass of CPU adapters (prefill_rows.wgsl.jinja): one subgroup per
  query tile, keys shared by subgroup broadcasts, no workgroup memory, no barriers.
* ``simple``: the original pass (attention.wgsl.jinja), one key per invocation. It stays
  where nothing else runs: blocks smaller than 2 * prefill_query_regs (blocks of 4 or
  less at the defaults), workgroup memory too small for any tile, adapters that cannot
  hold the split pass's workgroup, and calls with more than decode_max_queries but fewer
  than prefill_min_queries queries (none at the defaults). Measured on the H200 it lost
  everywhere the others run: 7.7x slower than the tiled pass at prompts of 1024 to 8192
  tokens, 25x slower than split-K at decode (scripts/tune_kernels.py, "simple pass");
  prompts of 17 to 64 tokens were not measured there.

Measurements quoted below: H200 through Vulkan, scripts/tune_kernels.py at the Phi-3-small
shape (GPU time per dispatch, clocks warmed, see the script), 2026-12-01; lavapipe on this
project's 2-core machine (--quick and --lavapipe-check).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from sparse_attention_op.op.spec import CallShape
from sparse_attention_op.settings import environment_flag, environment_int

SIMPLE, TILED, SPLIT, ROWS = "simple", "tiled", "split", "rows"


@dataclass(frozen=True)
class PrefillTiling:
    """The code shape of one tiled prefill pipeline (all constants of the template)."""

    query_tile: int  # queries of a workgroup (TQ), all in one block row
    key_tile: int  # keys per online-softmax step (TK)
    query_regs: int  # queries per invocation in the register block (QR)
    key_regs: int  # keys per invocation in the score block (KR)
    depth_chunk: int  # vec4s of the head staged per Q.K^T step (DCV)
    value_chunk: int  # keys of V staged per P.V step (KC)
    head_vec: int  # head_size / 4
    prefetch: bool = True  # software-pipelined staging (loads a step ahead, in registers)
    fma_scores: bool = True  # scores as chains of fma(), not dot() then an add
    resident_query: bool = True  # Q loaded, rotated and scaled once into registers (no query_prep pass)

    @property
    def query_threads(self) -> int:
        return self.query_tile // self.query_regs

    @property
    def key_threads(self) -> int:
        return self.key_tile // self.key_regs

    @property
    def workgroup(self) -> int:
        return self.query_threads * self.key_threads

    @property
    def value_cols(self) -> int:
        """Output vec4 columns per invocation in the P.V product (the head padded to fit)."""
        return -(-self.head_vec // self.key_threads)

    @property
    def stage_vec4(self) -> int:
        """One Q/K staging buffer: a Q and a K chunk, rows padded by one vec4 so that the
        score loop's strided row reads spread over the banks."""
        return (self.query_tile + self.key_tile) * (self.depth_chunk + 1)

    @property
    def smem_vec4(self) -> int:
        """The pass's workgroup array: two staging buffers (step 1), or the probability tile
        and a V chunk (steps 2 and 3), whichever is larger."""
        v = self.value_chunk * self.value_cols * self.key_threads
        return max(2 * self.stage_vec4, self.query_tile * self.probs_row_vec4 + v)

    @property
    def probs_row_vec4(self) -> int:
        """Row stride of the probability tile in vec4s: one spare vec4 so that the P.V
        step's reads of a warp's two rows land on distinct banks."""
        return self.key_tile // 4 + 1

    @property
    def depth_steps(self) -> int:
        """Q/K staging steps per key tile (the template's D_CHUNKS)."""
        return -(-self.head_vec // self.depth_chunk)

    @property
    def resident_query_vec4(self) -> int:
        """Registers (in vec4s) each invocation holds the tile's queries in with
        resident_query: the Q vec4s it stages per depth chunk, for every chunk."""
        return -(-self.query_tile * self.depth_chunk // self.workgroup) * self.depth_steps

    def barriers_per_key(self) -> float:
        """Barriers per key tile (one per staging step and one before the first, two for the
        softmax, two per further V chunk), per key."""
        return (self.depth_steps + 1 + 2 + 2 * (self.key_tile // self.value_chunk - 1)) / self.key_tile

    def workgroup_bytes(self) -> int:
        row_parts = self.query_tile * self.key_threads * 4
        return self.smem_vec4 * 16 + row_parts

    def valid(self) -> bool:
        return (
            self.query_tile % self.query_regs == 0
            and self.key_tile % self.key_regs == 0
            and self.key_tile % 4 == 0
            and self.key_threads % 4 == 0  # the row maxima and sums are read as vec4s
            and self.key_tile % self.value_chunk == 0
            and self.value_chunk % 4 == 0
        )


@dataclass(frozen=True)
class DecodeSplit:
    """The code shape of the split-K decode pipeline (constants of decode_split)."""

    workgroup: int
    lanes_per_key: int  # invocations sharing one key's dot product (their loads coalesce)
    keys_per_group: int  # keys each lane group scores per tile (loads in flight)
    head_vec: int
    shared_query: bool  # the query rotated once per workgroup, in workgroup memory

    @property
    def groups(self) -> int:
        return self.workgroup // self.lanes_per_key

    @property
    def tile_keys(self) -> int:
        return self.groups * self.keys_per_group

    @property
    def parts(self) -> int:
        """Key parts in the value step: invocations per output vec4 column."""
        return self.workgroup // self.head_vec

    def workgroup_bytes(self) -> int:
        """The workgroup arrays of decode_split.wgsl.jinja: lane sums, scores, each part's
        max, sum and accumulator, the shared query, and (merging) each part's fold of the
        slices and the last-slice flag."""
        vec4 = 16
        shared = self.tile_keys * self.lanes_per_key * 4 + self.tile_keys * 4 + 2 * self.parts * 4 + self.parts * self.head_vec * vec4
        return shared + (self.head_vec * vec4 if self.shared_query else 0) + self.parts * 8 + 4


@dataclass(frozen=True)
class Tuning:
    # -- the simple pass (attention.wgsl.jinja) ------------------------------------------
    #: Invocations of the attention pass's workgroup: one key per invocation per tile.
    attention_workgroup: int = 64
    #: Queries sharing each K/V load in prefill. They span at most two block rows for
    #: blocks >= 4, and the workgroup memory they need grows with the head size.
    attention_query_tile: int = 4
    #: Invocations of the KV-append pass's workgroup (one per vec4 of a new row).
    append_workgroup: int = 256
    #: Workgroup memory the adapter offers (bytes).
    workgroup_storage_bytes: int = 16384
    #: Largest storage binding (bytes): scratch buffers must fit in one.
    max_binding_bytes: int = 128 << 20
    #: Most invocations a workgroup may have (WebGPU guarantees 256).
    max_invocations: int = 256
    #: Storage buffers one pass may bind (WebGPU guarantees 8).
    max_storage_buffers: int = 8
    #: Whether storage buffers can be declared ``@coherent`` (the device feature
    #: memory-decoration-coherent): what a split pass that merges needs (decode_split_merges).
    coherent_storage: bool = False

    # -- the tiled prefill pass ----------------------------------------------------------
    #: Queries per workgroup. 64 = one Phi-3 block row: the K/V tile staged in workgroup
    #: memory is shared by 64 queries (the arithmetic intensity of a 64x64 GEMM tile).
    #: Smaller blocks shrink it to the block size (a tile never spans two block rows).
    prefill_query_tile: int = 64
    #: Keys per online-softmax step. 64 keeps the score tile (TQ x TK floats) at 16 KiB;
    #: 32 was 30% slower on the H200 (the softmax's barriers are per tile).
    prefill_key_tile: int = 64
    #: Register block of the score product: each invocation owns QR x KR scores, so one
    #: vec4 of Q and one of K feed QR*KR dot products. 4 x 4 is the plain GEMM blocking
    #: (256 invocations for a 64 x 64 tile). H200: 8 x 4 was 6-9% slower, 4 x 8 10-13%,
    #: 8 x 8 2x (registers), 32-query tiles with 2 x 4 blocks 1.4x. H100 (2026-12-06): 512
    #: invocations per 64 x 64 tile, as 2 x 4 or 4 x 2 blocks (fewer registers each), 3.64 and
    #: 3.82 ms at 4096 tokens against 3.51 (3-10% slower at 1024 and 8192 too). The 16 x 16
    #: invocations numbered so that a warp covers 4 x 8 or 8 x 4 of them (rows x key columns)
    #: instead of 2 x 16, so that its K and V reads of workgroup memory touch 8 or 4 distinct
    #: vec4s, not 16: 3% slower with Naga's runtime checks, 1% without (3.044 against 3.021
    #: ms at 4096). Without the checks (shader_runtime_checks), at 4096: register blocks of
    #: 8 x 4 3.66, 4 x 8 3.56, depth chunks of 16 3.14, V chunks of 64 3.18 ms against 3.02
    #: (the attention pass).
    prefill_query_regs: int = 4
    prefill_key_regs: int = 4
    #: Head vec4s per Q/K staging step: (TQ + TK) x 8 vec4 = 18 KiB with padding, two
    #: buffers of it (the probability tile and V's chunk reuse the same memory later).
    #: H200: 4 and 16 within 1-2% (fewer barriers against more workgroups per SM).
    prefill_depth_chunk: int = 8
    #: Keys of V per staging step: 32 x 128 floats = 16 KiB at head size 128. H200: 16
    #: and 64 (with depth 4) within 2%. Adapters with less workgroup memory get smaller
    #: chunks, then smaller tiles (prefill_tiling).
    prefill_value_chunk: int = 32
    #: Issue each staging step's global loads one step ahead (into registers), so their
    #: latency hides behind the current step's arithmetic instead of stalling between
    #: barriers. Costs a few registers per invocation (one vec4 per staged vec4). H200:
    #: 8-10% faster at 4096 and 8192 tokens; lavapipe: 4-27% slower (it has no latency
    #: to hide), but lavapipe takes the rows pass.
    prefill_prefetch: bool = True
    #: Accumulate each score as a chain of fma() over the vec4 step instead of adding a
    #: dot(): four instructions per four multiply-adds instead of five (the driver does
    #: not fuse the add into the dot, which would round differently). H200 (2026-12-02,
    #: three sweeps): the tiled pass 5-6% faster, 0.514 / 3.85 / 9.96 ms against 0.543 /
    #: 4.06 / 10.53 at 1024 / 4096 / 8192 tokens. The P.V update, written as a multiply and
    #: an add, timed the same as explicit fma() there: the driver already fuses it.
    prefill_fma_scores: bool = True
    #: Each invocation loads the query vec4s it stages once, rotates and scales them and
    #: keeps them in registers across the key tiles (8 vec4s at the defaults), instead of a
    #: query_prep pass writing prepared queries that every key tile re-reads: one pass and
    #: a 128 MB round trip less at 8192 tokens, a third less staging traffic per tile.
    #: Only where the queries take at most prefill_resident_query_vec4 registers (larger
    #: heads or smaller workgroups keep query_prep). H200 (2026-12-02, two sweeps): the
    #: whole call 0.488 / 3.597 / 9.233 ms at 1024 / 4096 / 8192 tokens against 0.540 /
    #: 3.899 / 10.055 with query_prep; the tiled pass alone 7-8% faster (9.18 against 9.93
    #: ms at 8192). The other candidates stayed slower with resident queries too.
    #: Since then (same day) the softmax runs in registers and the staging buffers are
    #: double-buffered (prefill_tiled.wgsl.jinja): 0.477 / 3.505 / 8.997 ms against 0.489 /
    #: 3.600 / 9.242 for the same candidates in the same process.
    prefill_resident_query: bool = True
    prefill_resident_query_vec4: int = 16
    #: Calls of fewer queries (and more than decode_max_queries) use the simple pass: at
    #: the defaults there are none, every call of 17 queries or more is a prefill.
    prefill_min_queries: int = 17

    #: The prefill pass: TILED on GPUs; ROWS (prefill_rows.wgsl.jinja) on CPU adapters,
    #: where per-invocation addresses cost a gather each and barriers are slow.
    prefill_pass: str = TILED
    #: Rows pass: lanes of a workgroup, which must be one whole subgroup for its fast path
    #: (lavapipe's subgroup is its SIMD width: 8 lanes of f32 on 256-bit AVX2).
    rows_lanes: int = 8
    #: Rows pass: queries per lane; each broadcast K or V vec4 feeds this many of them.
    #: (CPU_PREFILL_FIELDS sets the measured choice for CPU adapters.)
    rows_query_regs: int = 2

    # -- split-K decode ------------------------------------------------------------------
    #: Calls of at most this many queries use split-K (decode, short chunks): a tile of
    #: queries would be mostly empty, and each query's keys alone fill the GPU when split.
    #: (A reasoned bound: chunks of 2 to 64 tokens were not measured against the tiled pass.)
    decode_max_queries: int = 16
    #: Invocations of a split workgroup. The H200 decode figures here and below are from
    #: sweeps whose GPU clock drifted down across candidates (the KV-append pass, the same
    #: in all, took 6 to 12 us), so they rank more than they measure: 128 and 64 were
    #: slower in every sweep (fewer loads in flight per workgroup).
    decode_workgroup: int = 256
    #: 8 lanes per key: a lane group reads 128 contiguous bytes of a key row per load.
    #: H200: 4 and 16 lanes slower in every sweep.
    decode_lanes_per_key: int = 8
    #: Each lane group scores 1 key per tile (32-key tiles). H200 (with Naga's runtime
    #: checks, 2026-12-02): 1 and 4 keys slower than 2 in every sweep (4: a 128-key tile
    #: outgrows the slices). H100 without the checks (2026-12-06, shader_runtime_checks; two
    #: sweeps, per dispatch ms, 2 keys against 1): at history 8191 0.026-0.027 against 0.023
    #: (f32 cache), 0.020 against 0.018 (f16), the same 0.017 / 0.015 in one pass; at 131000
    #: 0.191 against 0.187 (f32), 0.108 against 0.111 (f16). The shorter tile's registers
    #: count for more than its loads in flight. CPU adapters keep 2 (CPU_DECODE_FIELDS).
    #: Tried and not kept (2026-12-02): lane groups that own their keys whole (subgroup
    #: shuffles for the dot products, a softmax per group, no barrier in the key loop) timed
    #: the same as these two-barrier tiles (split pass 0.022 ms at history 8191, 0.138 at
    #: 131000), so the barriers are not what bounds the pass.
    decode_keys_per_group: int = 1
    #: The query loaded, rotated and scaled once per workgroup into workgroup memory, not
    #: once per lane group (32 of them at the defaults, each reading it and its cos/sin
    #: rows). H200 (2026-12-03, per dispatch / one pass, ms): decode at 8191 0.022 / 0.018
    #: (f32 cache) and 0.022 / 0.019 (f16) against 0.025 / 0.020 and 0.024 / 0.020; at
    #: 131000 0.133 and 0.093 against 0.137 and 0.102. lavapipe (decode at 1023): split pass
    #: 14.7 against 18.4 ms (f32), 28.2 against 27.1 (f16, within its spread).
    decode_shared_query: bool = True
    #: Workgroups to aim for across the call (splits = this / (batch*heads*queries)).
    #: H200, decode at history 8191 (32 heads): 256 (8 slices of ~240 keys, two
    #: workgroups per multiprocessor) beat 64, 512, 1024 and 2048 for both f32 and f16
    #: caches in two sweeps (f32: 26 us against 35 at 512 and 39 at 64); more slices
    #: mean more partials to write and merge for the same bytes. Rerun with the split pass
    #: merging (2026-12-03, per dispatch, f32 / f16 cache): 256 0.024 / 0.024 ms, 512
    #: 0.030 / 0.029, 1024 0.040 / 0.041, 1024 with 128 invocations 0.031 / 0.030, 2048
    #: 0.065 / 0.063: the time grows with the invocations launched, not the tiles walked.
    #: Also tried then and not kept: the next tile's K/V loads issued before the current
    #: tile's arithmetic (a second register set): 0.041 / 0.039 ms at 8191 and 0.187 /
    #: 0.171 at 131000 against 0.025 / 0.024 and 0.137 / 0.102 (register pressure).
    #: H100 (2026-12-05, clocks at 1980 MHz, decode at 8191, per dispatch ms, f32 / f16
    #: cache): this default 0.027 / 0.023; 192 0.027 / 0.024; 128 0.031 / 0.026; 128 with 4
    #: keys per lane group 0.036 / 0.029; 4 lanes per key 0.040 / 0.037.
    #: H100 (2026-12-06, two sweeps, per dispatch and one pass, f32 / f16 cache): this default
    #: 0.027 and 0.019 / 0.023 and 0.019 ms. Shorter chains per slice all lost, whether by more
    #: workgroups or by wider ones: 512 0.030 / 0.027; one key per lane group (fewer
    #: registers, so more workgroups resident) at 256 0.026 and 0.021 / 0.023 and 0.019, at
    #: 512 0.031 / 0.027, at 1024 0.035 / 0.030; the same with 128 invocations at 1024 and 2048
    #: 0.032-0.039 / 0.027-0.035; 512 invocations (128-key tiles, or 64-key tiles with half
    #: the loads per invocation) 0.036-0.038 / 0.033-0.035, over 128 workgroups 0.028 / 0.025;
    #: 1024 invocations 0.041 / 0.039; 16 lanes per key, one key each, at 512 0.028 / 0.025.
    decode_target_workgroups: int = 256
    #: No split gets fewer keys than this (a split re-reads q and writes a partial).
    decode_min_keys_per_split: int = 64
    decode_max_splits: int = 64
    #: The merge pass: invocations per query (at least one per output vec4); the spare
    #: ones read disjoint slices in parallel. H200: 64 slower in every sweep.
    merge_workgroup: int = 256
    #: Decode writes its new rows into the cache where it merges (the merge pass, or the
    #: split pass's last slices), and the split pass reads them from the inputs (only in the
    #: tiles that reach a query's last t + 1 slots: decode_split.wgsl.jinja), instead of
    #: a KV-append pass before them: one dispatch (and its host calls) less per step. Needs
    #: 11 storage buffers per pass with rotary (a split pass that also merges: 14).
    decode_fused_append: bool = True
    #: No merge pass: each query's last slice to finish merges the slices (a count per
    #: query in an atomic, storage barriers around it: decode_split.wgsl.jinja), so a decode
    #: step is one dispatch and the GPU never drains between two. H200 (2026-12-02, calls
    #: repeated in one timed pass): decode at history 8191 0.020 ms against 0.023 (f32
    #: cache) and 0.022 (f16); at 131000 0.132 against 0.138 (f32), 0.096 against 0.097
    #: (f16). The merge pass alone took 0.008 ms. With the partials @coherent (needed):
    #: 0.021 (f32) and 0.020 (f16) at 8191.
    decode_split_merges: bool = True

    # -- compiling -----------------------------------------------------------------------
    #: Keep Naga's runtime checks in the kernels: a clamp on every dynamic index into a
    #: workgroup or function array, and a 64-bit iteration counter on every loop
    #: (native.create_unchecked_shader_module says what they cost). Off: this package's
    #: templates index their workgroup arrays through constants and invocation ids bounded
    #: by the workgroup size, and loop over constant counts or over key and chunk counts
    #: bounded by the call's uniforms, so the checks can never act; every route is tested
    #: with them off against the reference, and against the checked shaders to float32
    #: rounding (bit for bit on lavapipe; NVIDIA's driver contracts multiply-adds differently
    #: from one build to the next: tests/test_kernels.py). Storage buffers stay guarded by
    #: Vulkan's robustBufferAccess.
    #: The checks stay where wgpu-native lacks the unchecked path; SAO_SHADER_CHECKS=1 keeps them.
    #: H100 (2026-12-06, one sweep, GPU ms, checked / unchecked): prefill 1024 / 4096 / 8192
    #: 0.478 / 0.414, 3.511 / 3.056, 9.011 / 7.906 (19.9 -> 22.7 TFLOP/s of selected work);
    #: decode at 8191 0.027 / 0.027 (f32 cache), 0.023 / 0.020 (f16).
    #: H200 (2026-12-06, same sweep): prefill 0.478 / 0.414, 3.502 / 3.046, 8.994 / 7.889;
    #: decode at 8191 0.024 / 0.020 (f32), 0.022 / 0.017 (f16); at 131000 0.139 / 0.132, 0.120 / 0.093.
    shader_runtime_checks: bool = False

    # -- the host's waits ----------------------------------------------------------------
    #: A map waits this long on non-blocking polls before it sleeps in a blocking one
    #: (mapping._wait): a decode step's GPU work is shorter than the wake-up of a sleeping
    #: thread. CPU adapters: 0 (choose_tuning), a spinning thread takes a core from lavapipe.
    map_spin_seconds: float = 0.002
    #: Uploads and read-backs larger than this move in chunks of it, through two buffers in
    #: turn, each chunk's copy submitted as soon as it can run (buffers.layout_chunks; 0:
    #: every transfer whole). 256 MiB: a prompt's transfers move whole (201 MB in, 167 MB out
    #: at 8192 tokens of Phi-3-small), since smaller chunks measured slower, and larger ones
    #: (a long history fetched at once) keep the two kept buffers per direction bounded.
    #: (201 MB up through staging and 167 MB back, ms) H100 host, 2026-12-05, a probe of
    #: what scripts/measure_platform.py --only transfers measures: whole 17.6; chunks of
    #: 64 MiB 18.2, 32 MiB 20.5, 16 MiB 27.4, 8 MiB 41.2 (the host's copy there is the
    #: transfer, and each chunk adds a map and a submit); prefill 8192 run minus GPU 25.5
    #: whole against 24.6 / 28.2 / 36.9 in chunks of 32 / 16 / 8 MiB. lavapipe (120 MB up,
    #: 100 MB back): 30.7 whole, 31.3 and 33.8 in chunks of 8 and 2 MiB with its waits
    #: (mapping._wait: a blocking poll waits for every submission, the chunks after the one
    #: mapped too); 31.2 whole, 26.3 and 22.1 with waits that spin (its driver copies on a
    #: core of its own), which would take a core from its compute. Capped at the binding
    #: limit (choose_tuning): the pool refuses buffers beyond it.
    #: SAO_TRANSFER_CHUNK_BYTES overrides, for measuring.
    transfer_chunk_bytes: int = 256 << 20

    # -- shape-dependent choices -----------------------------------------------------------
    def attention_queries(self, shape: CallShape) -> int:
        """Decode has one query per head, so a tile would only idle; prefill shares each
        K/V load between up to attention_query_tile queries, as many as fit."""
        tile = 1 if shape.seq_len == 1 else min(self.attention_query_tile, shape.seq_len)
        while tile > 1 and attention_workgroup_bytes(self.attention_workgroup, tile, shape.head_size) > self.workgroup_storage_bytes:
            tile //= 2
        return tile

    def attention_route(self, shape: CallShape) -> str:
        """Which attention pass serves this call (module docstring)."""
        if shape.seq_len <= self.decode_max_queries and self.decode_split(shape) is not None:
            return SPLIT
        if shape.seq_len >= self.prefill_min_queries:
            if self.prefill_pass == ROWS:
                return ROWS
            if self.prefill_tiling(shape) is not None:
                return TILED
        return SIMPLE

    def rows_shape(self, shape: CallShape) -> tuple[int, int]:
        """The rows pass's (lanes, queries per lane): a tile of lanes * queries inside one
        block row (fewer queries per lane for small blocks, then fewer lanes)."""
        block = shape.attributes.sparse_block_size
        lanes = min(self.rows_lanes, block)
        return lanes, max(1, min(self.rows_query_regs, block // lanes))

    def prefill_tiling(self, shape: CallShape) -> PrefillTiling | None:
        """The tiled pass's shape for this call, shrunk until it fits workgroup memory;
        None where no tile fits or the blocks are smaller than the smallest tile."""
        query_tile = min(self.prefill_query_tile, shape.attributes.sparse_block_size)
        query_regs = min(self.prefill_query_regs, query_tile)
        if query_tile < 2 * query_regs:  # 8-token blocks: too few queries to share loads
            return None
        head_vec = shape.head_size // 4
        tiling = PrefillTiling(
            query_tile,
            self.prefill_key_tile,
            query_regs,
            self.prefill_key_regs,
            min(self.prefill_depth_chunk, head_vec),
            self.prefill_value_chunk,
            head_vec,
            self.prefill_prefetch,
            self.prefill_fma_scores,
        )
        if tiling.workgroup > self.max_invocations:
            return None
        if not (tiling.valid() and tiling.workgroup_bytes() <= self.workgroup_storage_bytes):
            # Too big for this adapter: of the smaller tiles and chunks that fit, the one with
            # the most reuse (Q.K^T flops per staged Q or K element: TQ*TK / (TQ+TK)), then the
            # fewest barriers per key (barriers_per_key).
            fitting = [t for t in _halvings(tiling) if t.valid() and t.workgroup_bytes() <= self.workgroup_storage_bytes]
            if not fitting:
                return None
            tiling = max(fitting, key=lambda t: (t.query_tile * t.key_tile / (t.query_tile + t.key_tile), -t.barriers_per_key()))
        resident = self.prefill_resident_query and tiling.resident_query_vec4 <= self.prefill_resident_query_vec4
        return dataclasses.replace(tiling, resident_query=resident)

    def merge_workgroup_for(self, head_vec: int) -> int:
        """The merge pass's workgroup: merge_workgroup, and at least one invocation per output vec4."""
        return max(self.merge_workgroup, _pow2_at_least(head_vec))

    def decode_split(self, shape: CallShape) -> DecodeSplit | None:
        head_vec = shape.head_size // 4
        if head_vec > self.decode_workgroup or self.decode_workgroup > self.max_invocations:
            return None
        split = DecodeSplit(
            self.decode_workgroup,
            min(self.decode_lanes_per_key, _pow2_at_least(head_vec)),
            self.decode_keys_per_group,
            head_vec,
            self.decode_shared_query,
        )
        if split.workgroup_bytes() > self.workgroup_storage_bytes:
            return None  # the simple pass serves it (about 9 KiB at the defaults: any adapter holds that)
        return split

    def decode_fuses_append(self, shape: CallShape) -> bool:
        """Whether a split-K call's passes write its new rows themselves (decode_fused_append),
        where the adapter binds enough storage buffers: split and merge bind 9 each, with
        rotary's cos/sin 11."""
        return self.decode_fused_append and self.max_storage_buffers >= 9 + 2 * shape.attributes.do_rotary

    def decode_merges_in_split(self, shape: CallShape) -> bool:
        """Whether the split pass merges (decode_split_merges), where the adapter has coherent
        storage (the merging slice reads partials other workgroups wrote in the same
        dispatch; WGSL alone promises that only inside a workgroup) and binds what that pass
        needs: the split pass's own buffers (7, fused 9, with rotary 2 more) and the output,
        the slice counts and (fused, rotary) the rotated keys."""
        fused = self.decode_fuses_append(shape)
        rotary = shape.attributes.do_rotary
        needed = 7 + 2 * fused + 2 * rotary + 2 + (fused and rotary)
        return self.decode_split_merges and self.coherent_storage and self.max_storage_buffers >= needed

    def decode_splits(self, shape: CallShape) -> int:
        """Slices per query: enough workgroups for the GPU, never slices thinner than
        decode_min_keys_per_split keys, and partials that fit one storage binding."""
        queries = shape.batch_size * shape.attributes.num_heads * shape.seq_len
        longest = max(shape.past_lengths) + shape.seq_len  # no query sees more keys
        splits = min(-(-self.decode_target_workgroups // queries), -(-longest // self.decode_min_keys_per_split), self.decode_max_splits)
        per_split_bytes = queries * shape.head_size * 4  # the partial accumulators of one slice
        return max(1, min(splits, self.max_binding_bytes // per_split_bytes))


def _halvings(tiling: PrefillTiling):
    """Every tiling with the query tile, key tile and staging chunks halved any number of
    times (down to what the register blocks need)."""

    def halves(value, floor):
        while value >= floor:
            yield value
            value //= 2

    for query_tile in halves(tiling.query_tile, 2 * tiling.query_regs):
        for key_tile in halves(tiling.key_tile, max(4, 4 * tiling.key_regs)):
            for depth in halves(tiling.depth_chunk, 1):
                for value in halves(min(tiling.value_chunk, key_tile), 4):
                    yield dataclasses.replace(tiling, query_tile=query_tile, key_tile=key_tile, depth_chunk=depth, value_chunk=value)


def _pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def value_parts(workgroup: int, head_size: int) -> int:
    """Lanes per output vec4 in the attention pass's value update (spare lanes split the keys)."""
    return max(1, workgroup // (head_size // 4))


def attention_workgroup_bytes(workgroup: int, query_tile: int, head_size: int) -> int:
    head_vec = head_size // 4
    parts = value_parts(workgroup, head_size)
    shared = 2 * query_tile * head_vec * 16 + 3 * query_tile * workgroup * 4 + workgroup * 4
    return shared + (query_tile * parts * head_vec * 16 if parts > 1 else 0)


def looks_like_cpu(limits: dict) -> bool:
    """Whether limits alone suggest Mesa's software Vulkan (lavapipe): a 128 MiB storage
    binding with 32 KiB of workgroup memory and 1024 invocations per workgroup. A guess
    (some mobile GPUs share those numbers); :func:`choose_tuning` prefers the adapter type."""
    return (
        int(limits.get("max-storage-buffer-binding-size", 0)) <= 128 << 20
        and int(limits.get("max-compute-workgroup-storage-size", 0)) <= 32768
        and int(limits.get("max-compute-invocations-per-workgroup", 0)) >= 1024
    )


def choose_tuning(limits: dict, features: frozenset, adapter_type: str | None = None) -> Tuning:
    """The tuning for an adapter with these limits and features.

    GPUs (measured: NVIDIA H200 through Vulkan, scripts/tune_kernels.py) take the class
    defaults: tiled prefill, split-K decode over ~256 workgroups. CPU adapters (lavapipe,
    measured on 2 cores) take the rows pass for prompts, since there gathers and barriers
    dominate and subgroup shuffles are nearly free: sparse prefill of 2048 tokens 5x
    faster than the tiled pass. It needs the ``subgroup`` feature; without it they keep
    the tiled pass. Their decode fields (CPU_DECODE_FIELDS) apply either way. The adapter
    type comes from the caller where it knows it, else from :func:`looks_like_cpu`.
    """
    workgroup_bytes = int(limits.get("max-compute-workgroup-storage-size", 16384))
    binding_bytes = int(limits.get("max-storage-buffer-binding-size", 128 << 20))
    invocations = int(limits.get("max-compute-invocations-per-workgroup", 256))
    storage_buffers = int(limits.get("max-storage-buffers-per-shader-stage", 8))
    tuning = Tuning(
        workgroup_storage_bytes=workgroup_bytes,
        max_binding_bytes=binding_bytes,
        max_invocations=invocations,
        max_storage_buffers=storage_buffers,
        coherent_storage="memory-decoration-coherent" in features,
    )
    cpu = adapter_type == "CPU" if adapter_type is not None else looks_like_cpu(limits)
    if cpu:
        tuning = dataclasses.replace(tuning, map_spin_seconds=0.0, **CPU_DECODE_FIELDS)
    if cpu and "subgroup" in features:
        tuning = dataclasses.replace(tuning, **CPU_PREFILL_FIELDS)
    if environment_flag("SAO_SHADER_CHECKS"):
        tuning = dataclasses.replace(tuning, shader_runtime_checks=True)
    chunk = environment_int("SAO_TRANSFER_CHUNK_BYTES", tuning.transfer_chunk_bytes)
    # A chunk's buffers come from a pool that refuses buffers beyond the binding limit.
    return dataclasses.replace(tuning, transfer_chunk_bytes=min(chunk, binding_bytes) if chunk > 0 else 0)


#: What CPU adapters with subgroups change for prompts (lavapipe, 2 cores;
#: scripts/tune_kernels.py --quick and --lavapipe-check): the rows pass with 4 queries per
#: lane, so that one gathered vec4 and its 8 broadcasts feed 32 multiply-adds (1 query per
#: lane: 1.7x slower; 8: the same as 4).
CPU_PREFILL_FIELDS = dict(prefill_pass=ROWS, rows_lanes=8, rows_query_regs=4)

#: What every CPU adapter changes for decode (lavapipe, 2 cores, --quick): split-K over ~64
#: workgroups (2 cores gain nothing from more: 1024 was 2.5x slower at history 1023, 64
#: matched the simple pass there and beat it at 4095). The decode passes keep their
#: KV-append pass there: lavapipe ran the fused split pass 2-3x slower (decode at 1023:
#: 62-103 ms against 33-35 ms with the append pass). They keep the merge pass too: a split
#: pass that merges ran 6-55% slower there (2026-12-02, --quick --rounds 2: 24.0 against
#: 15.5 ms, f16 cache 16.9 against 15.9). And 2 keys per lane group: 1 (the GPUs' choice)
#: took 76.8 against 34.9 ms at history 1023 and 138.6 against 66.0 at 4095 (f32 cache;
#: f16 within 2%), 2026-12-06, --quick --rounds 2.
CPU_DECODE_FIELDS = dict(decode_target_workgroups=64, decode_fused_append=False, decode_split_merges=False, decode_keys_per_group=2)
