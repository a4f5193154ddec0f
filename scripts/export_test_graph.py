#!/usr/bin/env python3
"""Export a one-node SparseAttention test graph (and, optionally, matching inputs).

    python scripts/export_test_graph.py out.onnx --num-heads 8 --kv-num-heads 2 --head-size 64 \
        --seq-len 16 --max-cache-len 128 --block 16 --rotary --packed --inputs out.npz

The layout (Phi-3-small style: local blocks plus vertical stripes) is stored as
initializers; every other input is a graph input. ``--inputs`` writes unit-scale random
feeds for the graph as an .npz, named as the graph's inputs.
"""

import argparse
from pathlib import Path

import numpy as np
import onnx

from sparse_attention_op.graphs import sparse_attention_model
from sparse_attention_op.inputs import CaseConfig, random_inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output", type=Path)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=8)
    parser.add_argument("--past", type=int, default=None, help="history per row (omit for a prompt)")
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--kv-num-heads", type=int, default=2)
    parser.add_argument("--head-size", type=int, default=32)
    parser.add_argument("--max-cache-len", type=int, default=64)
    parser.add_argument("--block", type=int, default=16, help="sparse_block_size")
    parser.add_argument("--num-layout", type=int, default=2)
    parser.add_argument("--local-blocks", type=int, default=2)
    parser.add_argument("--vert-stride", type=int, default=2)
    parser.add_argument("--packed", action="store_true", help="packed QKV in the query input")
    parser.add_argument("--rotary", action="store_true")
    parser.add_argument("--interleaved", action="store_true", help="rotary_interleaved = 1")
    parser.add_argument("--rotary-dim", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--inputs", type=Path, default=None, help="also write random feeds (.npz)")
    args = parser.parse_args()

    config = CaseConfig(
        batch=args.batch, seq_len=args.seq_len, num_heads=args.num_heads, kv_num_heads=args.kv_num_heads,
        head_size=args.head_size, max_cache_len=args.max_cache_len, sparse_block_size=args.block,
        num_layout=args.num_layout, local_blocks=args.local_blocks, vert_stride=args.vert_stride,
        past_lengths=None if args.past is None else (args.past,) * args.batch, packed=args.packed,
        do_rotary=args.rotary, rotary_interleaved=args.interleaved, rotary_dim=args.rotary_dim,
    )
    inputs = random_inputs(config, np.random.default_rng(args.seed))
    model = sparse_attention_model(config.node_attributes(), inputs, constants=("block_row_indices", "block_col_indices"))
    onnx.save(model, str(args.output))
    print(f"wrote {args.output}: {config}")
    if args.inputs:
        graph_inputs = {i.name for i in model.graph.input}
        np.savez(args.inputs, **{k: v for k, v in inputs.items() if k in graph_inputs})
        print(f"wrote {args.inputs}")


if __name__ == "__main__":
    main()
