#!/usr/bin/env python3
"""Export a one-node SparseAttention test graph: ``sparse-attention-op export graph`` (sparse_attention_op/cli/export.py).

    python scripts/export_test_graph.py out.onnx --num-heads 8 --kv-num-heads 2 --head-size 64 \
        --seq-len 16 --max-cache-len 128 --block 16 --rotary --packed --inputs out.npz
"""

import sys

from sparse_attention_op.cli.parser import main

if __name__ == "__main__":
    sys.exit(main(["export", "graph", *sys.argv[1:]]))
