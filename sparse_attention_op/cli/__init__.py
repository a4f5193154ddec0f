"""The ``sparse-attention-op`` command line: the parser (``parser``), one function per command
(``commands``), their reports (``inspection``, ``system_info``, ``tables``), the demo and the
export of test graphs. It is the top of the house: nothing in the package imports it.
"""

from sparse_attention_op.cli.parser import main

__all__ = ["main"]
