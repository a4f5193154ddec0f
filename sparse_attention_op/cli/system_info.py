"""What this machine offers the kernels: versions, wgpu adapters, the chosen one's features,
limits and tuning (the ``info`` command).

Everything is gathered into plain dicts, so the command can print them as text or JSON.
"""

from __future__ import annotations

import dataclasses
import platform
from importlib import metadata

# The limits the device is created with and the features it requests: what the kernels use.
from sparse_attention_op.webgpu.device import OPTIONAL_FEATURES as KERNEL_FEATURES
from sparse_attention_op.webgpu.device import RAISED_LIMITS as KERNEL_LIMITS

#: Distributions whose versions matter to a bug report.
DISTRIBUTIONS = ("sparse-attention-op", "onnxruntime", "onnxruntime-extensions", "wgpu", "onnx", "numpy")

#: Phi-3-small's attention (docs/design.md section 7): the shape the tuning examples use.
_EXAMPLE_ATTRIBUTES = dict(num_heads=32, kv_num_heads=8, sparse_block_size=64)
_EXAMPLE_HEAD_SIZE = 128
_EXAMPLE_CAPACITY = 8192


def versions() -> dict[str, str]:
    """Installed versions of the packages the bridge depends on (``"not installed"`` where absent)."""
    found = {"python": platform.python_version()}
    for name in DISTRIBUTIONS:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    try:  # the native library wgpu-py wraps: its version decides much of the behaviour
        from wgpu.backends import wgpu_native

        found["wgpu-native"] = str(wgpu_native.__version__)
    except (ImportError, AttributeError):
        pass
    return found


def adapter_summaries() -> list[dict]:
    """Every adapter wgpu enumerates, best first (the order the package picks from)."""
    from sparse_attention_op.webgpu.device import describe, list_adapters

    return [
        {
            "description": describe(a),
            "type": a.info.get("adapter_type", "?"),
            "backend": a.info.get("backend_type", "?"),
            "vendor": a.info.get("vendor", "?"),
            "driver": a.info.get("description", ""),
        }
        for a in list_adapters()
    ]


def chosen_adapter() -> dict:
    """The adapter and device the package uses, with what the kernels care about.

    Raises :class:`~sparse_attention_op.webgpu.NoAdapterError` when there is none."""
    from sparse_attention_op.webgpu.device import get_context
    from sparse_attention_op.webgpu.tuning import choose_tuning

    context = get_context()
    tuning = choose_tuning(context.limits, context.features, context.adapter_type)
    info = context.adapter.info
    return {
        "description": context.description,
        "type": context.adapter_type,
        "backend": context.backend,
        "driver": info.get("description", ""),
        "features": {name: name in context.features for name in KERNEL_FEATURES},
        "limits": {name: int(context.limits[name]) for name in KERNEL_LIMITS if name in context.limits},
        "tuning": dataclasses.asdict(tuning),
        "routes": example_routes(tuning),
    }


def example_routes(tuning) -> dict[str, str]:
    """Which pass the tuning picks at Phi-3-small's shape, for a long prompt and a decode step,
    in words: the quickest way to see what an adapter will run."""
    from sparse_attention_op.op.spec import OpAttributes, describe_call
    from sparse_attention_op.webgpu.tuning import SPLIT, TILED

    attributes = OpAttributes.from_mapping(_EXAMPLE_ATTRIBUTES)
    heads, kv_heads, block = attributes.num_heads, attributes.kv_num_heads, attributes.sparse_block_size
    blocks = _EXAMPLE_CAPACITY // block
    cache = (1, kv_heads, _EXAMPLE_CAPACITY, _EXAMPLE_HEAD_SIZE)
    routes = {}
    for label, seq_len, total in (("prefill 1024", 1024, 1024), (f"decode at {_EXAMPLE_CAPACITY - 1}", 1, _EXAMPLE_CAPACITY)):
        shapes = {
            "query": (1, seq_len, heads * _EXAMPLE_HEAD_SIZE),
            "key": (1, seq_len, kv_heads * _EXAMPLE_HEAD_SIZE),
            "value": (1, seq_len, kv_heads * _EXAMPLE_HEAD_SIZE),
            "past_key": cache,
            "past_value": cache,
            "block_row_indices": (heads, blocks + 1),
            "block_col_indices": (heads, blocks * 4),
            "cos_cache": None,
            "sin_cache": None,
        }
        shape = describe_call(attributes, shapes, [total], [total])
        route = tuning.attention_route(shape)
        detail = ""
        if route == TILED:
            tiling = tuning.prefill_tiling(shape)
            detail = f" ({tiling.query_tile} queries x {tiling.key_tile} keys per tile, {tiling.workgroup} invocations)"
        elif route == SPLIT:
            detail = f" ({tuning.decode_splits(shape)} splits per query)"
        routes[label] = route + detail
    return routes
