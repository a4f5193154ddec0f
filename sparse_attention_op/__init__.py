"""Run ONNX models containing com.microsoft.SparseAttention on WebGPU, from ONNX Runtime.

    import sparse_attention_op as sao
    sess = sao.create_session("model.onnx")   # an onnxruntime.InferenceSession
    outputs = sess.run(None, feeds)

Data flows one way: ORT -> bridge (a custom op handed ORT's own tensors, no copy) -> spec
(one validated call) -> WebGPU executor -> outputs, written into ORT's buffers. The bridge
never touches the GPU and the executor never parses ONNX.

The package's wings, from the bottom: ``settings`` (every setting and environment variable),
``op`` (the operator's contract and its float64 reference), ``webgpu`` (the executor and its
kernels), ``ort`` (the custom op, the graph rewrite, sessions, execution providers),
``generation`` (the loop and ORT GenAI), ``testing`` (fixtures), ``benchmarking`` and ``cli``.
This module is the facade over them; nothing in the package imports it.
"""

from sparse_attention_op.generation.genai import load_genai_model, prepare_genai_folder
from sparse_attention_op.generation.loop import GenerationError, GenerationResult, Sampling, generate
from sparse_attention_op.op.spec import SparseAttentionError, SparseAttentionInputError
from sparse_attention_op.ort.bridge import register
from sparse_attention_op.ort.io_binding import bind_shared
from sparse_attention_op.ort.model import prepare_model
from sparse_attention_op.ort.session import SparseAttentionSession, create_session, session_options
from sparse_attention_op.webgpu.executor import GpuExecutionError

__all__ = [
    "GenerationError",
    "GenerationResult",
    "GpuExecutionError",
    "SparseAttentionError",
    "SparseAttentionInputError",
    "Sampling",
    "SparseAttentionSession",
    "bind_shared",
    "create_session",
    "generate",
    "load_genai_model",
    "prepare_genai_folder",
    "prepare_model",
    "register",
    "session_options",
]
__version__ = "0.2.0"
