"""Tunables per adapter, in one place: every code-shaping choice the kernels make, and why.

A :class:`Tuning` is chosen once per device from its limits and features
(:func:`choose_tuning`); the kernels module reads it and nothing else decides tile sizes.
Shape-dependent choices that follow from a tuning (how many queries a tile holds for a
given call) are methods here too, so the reasoning stays next to the numbers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..spec import CallShape


@dataclass(frozen=True)
class Tuning:
    #: Invocations of the attention pass's workgroup: one key per invocation per tile.
    attention_workgroup: int = 64
    #: Queries sharing each K/V load in prefill. They span at most two block rows for
    #: blocks >= 4, and the workgroup memory they need grows with the head size.
    attention_query_tile: int = 4
    #: Invocations of the KV-append pass's workgroup (one per vec4 of a new row).
    append_workgroup: int = 256
    #: Workgroup memory the adapter offers (bytes).
    workgroup_storage_bytes: int = 16384

    def attention_queries(self, shape: CallShape) -> int:
        """Decode has one query per head, so a tile would only idle; prefill shares each
        K/V load between up to attention_query_tile queries, as many as fit."""
        tile = 1 if shape.seq_len == 1 else min(self.attention_query_tile, shape.seq_len)
        while tile > 1 and attention_workgroup_bytes(self.attention_workgroup, tile, shape.head_size) > self.workgroup_storage_bytes:
            tile //= 2
        return tile


def value_parts(workgroup: int, head_size: int) -> int:
    """Lanes per output vec4 in the attention pass's value update (spare lanes split the keys)."""
    return max(1, workgroup // (head_size // 4))


def attention_workgroup_bytes(workgroup: int, query_tile: int, head_size: int) -> int:
    head_vec = head_size // 4
    parts = value_parts(workgroup, head_size)
    shared = 2 * query_tile * head_vec * 16 + 3 * query_tile * workgroup * 4 + workgroup * 4
    return shared + (query_tile * parts * head_vec * 16 if parts > 1 else 0)


def choose_tuning(limits: dict, features: frozenset) -> Tuning:
    """The tuning for an adapter with these limits and features."""
    return dataclasses.replace(Tuning(), workgroup_storage_bytes=int(limits.get("max-compute-workgroup-storage-size", 16384)))
