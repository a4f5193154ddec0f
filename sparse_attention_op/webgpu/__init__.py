"""WebGPU (wgpu-py) execution of SparseAttention calls."""

from sparse_attention_op.webgpu.device import GpuContext, NoAdapterError, get_context, list_adapters
from sparse_attention_op.webgpu.executor import WebGPUExecutor, get_executor

__all__ = ["GpuContext", "NoAdapterError", "WebGPUExecutor", "get_context", "get_executor", "list_adapters"]
