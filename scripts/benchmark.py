#!/usr/bin/env python3
"""The benchmark sweep: ``sparse-attention-op bench`` (sparse_attention_op/benchmarking/sweep.py).

python scripts/benchmark.py --torch --ort --json bench.json --plot bench.png   # the H200 sweep
python scripts/benchmark.py --quick --ort --plot quick.png                       # lavapipe (~20 s)
"""

import sys

from sparse_attention_op.benchmarking.sweep import main

if __name__ == "__main__":
    sys.exit(main())
