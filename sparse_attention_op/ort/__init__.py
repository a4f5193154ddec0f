"""ONNX Runtime's side: the custom op, the graph rewrite and the sessions that use them.

``custom_op`` declares an op through ORT's C ABI (ctypes), ``extensions`` adds it to
onnxruntime-extensions' library, ``bridge`` is its kernel (ORT's tensors in, one validated
call to the WebGPU executor, ORT's output buffers filled), ``presents`` writes the caches ORT
hands back, ``graph`` holds the ONNX graph helpers every wing shares, ``model`` and
``rewrite`` turn SparseAttention nodes into the op, ``session`` and ``io_binding`` are what a
user opens. It stands on ``op`` and ``webgpu``.
"""
