"""Run ONNX models containing com.microsoft.SparseAttention on WebGPU, from ONNX Runtime.

    import sparse_attention_op as sao
    sess = sao.create_session("model.onnx")   # an onnxruntime.InferenceSession
    outputs = sess.run(None, feeds)

Data flows one way: ORT -> bridge (a custom op handed ORT's own tensors, no copy) -> spec
(one validated call) -> WebGPU executor -> outputs, written into ORT's buffers. The bridge
never touches the GPU and the executor never parses ONNX.
"""

from .bridge import register
from .genai import load_genai_model, prepare_genai_folder
from .generation import GenerationError, GenerationResult, Sampling, generate
from .io_binding import bind_shared
from .model import prepare_model
from .session import SparseAttentionSession, create_session
from .spec import SparseAttentionError, SparseAttentionInputError
from .webgpu.executor import GpuExecutionError

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
]
__version__ = "0.2.0"
