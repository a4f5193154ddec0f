import sys

from sparse_attention_op.cli import main

sys.exit(main())
