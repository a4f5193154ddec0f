"""The operator's contract: what a com.microsoft.SparseAttention call means.

``spec`` validates a call and names every rule an input breaks; ``block_plan`` turns a block
layout into the lists the kernels walk; ``reference`` is the float64 reference that shares no
code with the kernels; ``layouts`` draws Phi-3-small's block layouts. Nothing here imports
ONNX Runtime or touches a GPU, so every other wing can stand on it.
"""
