"""Small decoders with real-model structure, in the ONNX Runtime GenAI convention.

The graphs follow what the GenAI model builder writes for Phi-3-small, scaled down:

* inputs ``input_ids`` (int64 [batch_size, sequence_length]), ``attention_mask`` (int64
  [batch_size, total_sequence_length]) and per layer ``past_key_values.{i}.key/value``
  ([batch_size, kv_num_heads, past_sequence_length, head_size], a symbolic length, so the
  caller picks the capacity: GenAI binds one buffer of max_length rows to past and present);
* outputs ``logits`` ([batch_size, sequence_length, vocab]) and ``present.{i}.key/value``.
* Lengths come from the mask inside the graph, as the builder derives them:
  key_total_sequence_lengths = int32(ReduceSum(attention_mask, axis 1)), total_sequence_length
  = int32(Shape(attention_mask)[1]), and GroupQueryAttention's seqlens_k = key_total - 1.
* Each layer: LayerNormalization, packed QKV MatMul, attention with rotary (cos/sin cache
  initializers, do_rotary=1), output projection, residual, LayerNormalization, a SiLU MLP,
  residual. Then a final norm and the logits MatMul.
* Attention is com.microsoft.SparseAttention with Phi-3-small layouts (CSR initializers,
  per-layout vertical offsets, -1 padding), except every ``dense_every``-th layer, which is
  com.microsoft.GroupQueryAttention: Phi-3-small makes layer i dense when
  (i + 1) % dense_attention_every_n_layers == 0, and the builder emits GQA for those.

Weights are fixed random draws (``seed``), scaled so that hidden states, attention scores
and logits are of unit-ish scale: tiny activations would make every softmax uniform and
every argmax a coin toss, which would hide the bugs the end-to-end tests are for.

float16 models compute in float16 throughout: onnxruntime 1.32's CPU provider has float16
kernels for every op used here (Gather, LayerNormalization, MatMul, Add, Mul, Sigmoid,
SparseAttention, GroupQueryAttention), so plain ORT CPU runs the same graph for comparison.

Two variations of the exported models GPUs actually run:

* ``weights="int4"``: every linear layer (qkv_proj, o_proj, mlp up/down, lm_head) is a
  com.microsoft.MatMulNBits node (4 bits, blocks of 32, symmetric) laid out exactly as ONNX
  Runtime's ``MatMulNBitsQuantizer(model, bits=4, block_size=32, is_symmetric=True)`` writes
  it (tests/test_int4_models.py holds the two byte for byte). Small models quantize their float
  draws with ORT's own routine; models too large to draw in float (Phi-3-small's real width:
  tens of GB of float64) draw the int4 codes and the scales directly, one tensor at a time,
  and :func:`write_model_folder` streams them to an external data file.
* ``static_cache=N``: every past and present declares N rows instead of a symbolic length,
  as models exported with a static KV cache do.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from functools import partial
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from sparse_attention_op.op.layouts import causal_mask, mask_to_csr, phi3_small_mask
from sparse_attention_op.op.reference import sparse_attention_reference
from sparse_attention_op.op.spec import DOMAIN, OP_TYPE
from sparse_attention_op.ort.graph import node_attributes
from sparse_attention_op.testing.graphs import finish_model
from sparse_attention_op.testing.inputs import rotary_caches

GQA_OP_TYPE = "GroupQueryAttention"
DTYPES = {"float32": (np.float32, TensorProto.FLOAT), "float16": (np.float16, TensorProto.FLOAT16)}
NORMS = ("layer", "rms")
#: "int4" quantizes the float draws up to QUANTIZE_LIMIT float parameters and draws codes above
#: it; "int4-quantized" and "int4-drawn" force one way.
WEIGHTS = ("float", "int4", "int4-quantized", "int4-drawn")
QUANTIZE_LIMIT = 1 << 25  # float parameters: _weights' float64 draws of this many take 256 MB
INT4_BLOCK_SIZE = 32
Q4_SUFFIX = "_Q4"  # MatMulNBitsQuantizer's names: <weight>_Q4, <weight>_scales, <matmul node>_Q4
SCALES_SUFFIX = "_scales"
#: Fields added after models/ was committed. The model props carry them only when they differ
#: from their defaults, so the committed models stay byte-identical.
_LATE_FIELDS = ("weights", "static_cache")

INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
LOGITS = "logits"
PAST_KEY = "past_key_values.%d.key"
PAST_VALUE = "past_key_values.%d.value"
PRESENT_KEY = "present.%d.key"
PRESENT_VALUE = "present.%d.value"


@dataclass(frozen=True)
class DecoderConfig:
    """Shape and contents of a generated decoder. Every field is checked by :meth:`validate`."""

    vocab_size: int = 512
    hidden: int = 256
    layers: int = 3
    num_heads: int = 8
    kv_num_heads: int = 2
    head_size: int = 32
    sparse_block_size: int = 16
    local_blocks: int = 4
    vert_stride: int = 4
    max_position: int = 512  # context length: rows of cos/sin and of the layouts
    dense_every: int = 0  # layer i is GroupQueryAttention when (i + 1) % dense_every == 0; 0: none
    dtype: str = "float32"
    seed: int = 0
    num_layout: int = 0  # 0: one layout per head, like Phi-3-small; else a divisor of num_heads
    intermediate: int = 0  # MLP width; 0: 2 * hidden
    norm: str = "layer"  # "layer": LayerNormalization (Phi-3-small); "rms": SimplifiedLayerNormalization
    norm_epsilon: float = 1e-5
    logit_scale: float = 4.0  # std of the logits; large enough that greedy margins are not razor thin
    eos_token_id: int = 0
    bos_token_id: int = 1
    pad_token_id: int = 0
    weights: str = "float"  # one of WEIGHTS: float MatMuls, or int4 MatMulNBits (see weight_source)
    static_cache: int = 0  # rows every past and present declares; 0: the symbolic past/total lengths

    def validate(self) -> None:
        positive = (
            "vocab_size",
            "hidden",
            "layers",
            "num_heads",
            "kv_num_heads",
            "head_size",
            "sparse_block_size",
            "local_blocks",
            "vert_stride",
            "max_position",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"DecoderConfig.{name} must be a positive int, got {value!r}")
        for name in ("dense_every", "num_layout", "intermediate", "seed", "static_cache"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"DecoderConfig.{name} must be a non-negative int, got {value!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"DecoderConfig.dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        if self.norm not in NORMS:
            raise ValueError(f"DecoderConfig.norm must be one of {NORMS}, got {self.norm!r}")
        if self.num_heads % self.kv_num_heads:
            raise ValueError(f"DecoderConfig.num_heads ({self.num_heads}) must be a multiple of kv_num_heads ({self.kv_num_heads})")
        if self.num_heads % self.layouts:
            raise ValueError(f"DecoderConfig.num_layout ({self.num_layout}) must divide num_heads ({self.num_heads})")
        if self.head_size % 16:
            # Rotary in both ops needs head_size % 16 == 0 (docs/design.md section 1).
            raise ValueError(f"DecoderConfig.head_size must be a multiple of 16 (rotary), got {self.head_size}")
        block = self.sparse_block_size
        if block & (block - 1):
            raise ValueError(f"DecoderConfig.sparse_block_size must be a power of two, got {block}")
        if self.max_position % block:
            raise ValueError(f"DecoderConfig.max_position ({self.max_position}) must be a multiple of sparse_block_size ({block})")
        for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value < self.vocab_size:
                raise ValueError(f"DecoderConfig.{name} must be a token id in [0, {self.vocab_size}), got {value!r}")
        if not (self.logit_scale > 0 and self.norm_epsilon > 0):
            raise ValueError(f"DecoderConfig.logit_scale and norm_epsilon must be positive, got {self.logit_scale!r}, {self.norm_epsilon!r}")
        self._validate_weights()
        if self.static_cache > self.max_position:
            # Positions past max_position have no rotary row, so more cache rows could never be used.
            raise ValueError(f"DecoderConfig.static_cache ({self.static_cache}) must not exceed max_position ({self.max_position})")

    def _validate_weights(self) -> None:
        if self.weights not in WEIGHTS:
            raise ValueError(f"DecoderConfig.weights must be one of {WEIGHTS}, got {self.weights!r}")
        if self.weights == "float":
            return
        # Each matrix's input width K must be whole blocks: the drawn codes know no padding.
        widths = {"hidden": self.hidden, "num_heads * head_size": self.num_heads * self.head_size, "intermediate (2 * hidden when 0)": self.mlp_width}
        for name, width in widths.items():
            if width % INT4_BLOCK_SIZE:
                raise ValueError(
                    f"DecoderConfig.{name} ({width}) must be a multiple of {INT4_BLOCK_SIZE} (the int4 block size) when weights is {self.weights!r}"
                )

    @property
    def layouts(self) -> int:
        return self.num_layout or self.num_heads

    @property
    def mlp_width(self) -> int:
        return self.intermediate or 2 * self.hidden

    @property
    def qkv_width(self) -> int:
        return (self.num_heads + 2 * self.kv_num_heads) * self.head_size

    @property
    def float_parameters(self) -> int:
        """Parameters of the float model (embedding, matrices; norms are negligible)."""
        per_layer = self.hidden * self.qkv_width + self.num_heads * self.head_size * self.hidden + 2 * self.hidden * self.mlp_width
        return 2 * self.vocab_size * self.hidden + self.layers * per_layer

    @property
    def weight_source(self) -> str:
        """How the linear layers' weights are made: "float" (float MatMuls), "quantized" (ORT's
        int4 routine applied to the float draws) or "drawn" (int4 codes and scales drawn directly)."""
        if self.weights == "int4":
            return "drawn" if self.float_parameters > QUANTIZE_LIMIT else "quantized"
        return self.weights.removeprefix("int4-")

    def is_dense(self, layer: int) -> bool:
        """Phi-3-small's rule: layer i (0-based) is dense when (i + 1) % dense_every == 0."""
        return bool(self.dense_every) and (layer + 1) % self.dense_every == 0


def phi3_small_config(layers: int = 32, max_position: int = 8192, **overrides) -> DecoderConfig:
    """Phi-3-small's real shape (microsoft/Phi-3-small-8k-instruct's config.json) as GPUs run it:
    int4 weights, float16 activations and embedding.

    hidden 4096, 32 query heads over 8 kv heads of size 128, MLP width 14336, vocabulary 100352,
    blocks of 64 tokens with 16 local blocks and vertical stride 8, one layout per head
    (homo_head false), every 2nd layer dense (dense_attention_every_n_layers 2). The real
    depth is 32 layers; fewer keep a model's width at a fraction of its size. Other fields
    (seed, static_cache, ...) may be overridden by keyword.
    """
    shape = dict(
        vocab_size=100352,
        hidden=4096,
        layers=layers,
        num_heads=32,
        kv_num_heads=8,
        head_size=128,
        sparse_block_size=64,
        local_blocks=16,
        vert_stride=8,
        max_position=max_position,
        dense_every=2,
        dtype="float16",
        num_layout=0,
        intermediate=14336,
        weights="int4",
    )
    return DecoderConfig(**{**shape, **overrides})


#: Folder name under models/ -> the configuration scripts/build_models.py writes there.
#: Small enough to ship (under 3 MB each) yet shaped like Phi-3-small: 4 query heads per kv
#: head, one layout per head, a dense GroupQueryAttention layer every second layer. Blocks
#: of 16 tokens with 2 local blocks make the sparsity bite after 32 tokens.
BUNDLED_MODELS: dict[str, DecoderConfig] = {
    "phi3-small-tiny": DecoderConfig(
        vocab_size=512,
        hidden=128,
        layers=4,
        num_heads=8,
        kv_num_heads=2,
        head_size=16,
        sparse_block_size=16,
        local_blocks=2,
        vert_stride=4,
        max_position=512,
        dense_every=2,
        dtype="float32",
        seed=0,
        intermediate=256,
    ),
}
BUNDLED_MODELS["phi3-small-tiny-f16"] = replace(BUNDLED_MODELS["phi3-small-tiny"], dtype="float16")


@dataclass(frozen=True)
class _Matrix:
    """A linear layer's weight: [rows (K, fan in), cols (N)], drawn with std scale / sqrt(rows)."""

    rows: int
    cols: int
    scale: float


def _layer_matrices(config: DecoderConfig, layer: int) -> dict[str, _Matrix]:
    """Layer ``layer``'s four matrices in draw (and graph) order: qkv, o_proj, up, down.

    Scales: the two residual branches are scaled down by sqrt(2 * layers) so the residual
    stream stays unit-ish through depth.
    """
    c, p = config, f"model.layers.{layer}"
    branch = 1.0 / np.sqrt(2 * c.layers)
    return {
        f"{p}.attn.qkv_proj.weight": _Matrix(c.hidden, c.qkv_width, 1.5),  # sharper attention than uniform
        f"{p}.attn.o_proj.weight": _Matrix(c.num_heads * c.head_size, c.hidden, branch),
        f"{p}.mlp.up_proj.weight": _Matrix(c.hidden, c.mlp_width, 2.0),
        f"{p}.mlp.down_proj.weight": _Matrix(c.mlp_width, c.hidden, 2.0 * branch),
    }


def _head_matrix(config: DecoderConfig) -> dict[str, _Matrix]:
    """The logits head: logits of std ``logit_scale``."""
    return {"lm_head.weight": _Matrix(config.hidden, config.vocab_size, config.logit_scale)}


def _all_matrices(config: DecoderConfig) -> dict[str, _Matrix]:
    matrices = {}
    for i in range(config.layers):
        matrices.update(_layer_matrices(config, i))
    return {**matrices, **_head_matrix(config)}


def _norm_params(config: DecoderConfig, rng: np.random.Generator, prefix: str) -> dict[str, np.ndarray]:
    # Gains near one, small biases: a non-trivial norm that keeps the scale.
    out = {f"{prefix}.weight": 1.0 + 0.1 * rng.standard_normal(config.hidden)}
    if config.norm == "layer":
        out[f"{prefix}.bias"] = 0.1 * rng.standard_normal(config.hidden)
    return out


def _weights(config: DecoderConfig) -> dict[str, np.ndarray]:
    """Every float weight by initializer name, drawn in a fixed order from ``config.seed``.

    Matrices are N(0, scale^2 / fan_in) (see :class:`_Matrix`), so a unit-scale input gives
    outputs of scale ``scale``.
    """
    c = config
    rng = np.random.default_rng(c.seed)

    def draw(matrices: dict[str, _Matrix]) -> dict[str, np.ndarray]:
        return {name: rng.standard_normal((m.rows, m.cols)) * (m.scale / np.sqrt(m.rows)) for name, m in matrices.items()}

    weights = {"model.embed_tokens.weight": rng.standard_normal((c.vocab_size, c.hidden))}
    for i in range(c.layers):
        p = f"model.layers.{i}"
        matrices = list(_layer_matrices(c, i).items())  # qkv, o_proj | up, down: each pair follows its norm
        weights.update(_norm_params(c, rng, f"{p}.input_layernorm"))
        weights.update(draw(dict(matrices[:2])))
        weights.update(_norm_params(c, rng, f"{p}.post_attention_layernorm"))
        weights.update(draw(dict(matrices[2:])))
    weights.update(_norm_params(c, rng, "model.norm"))
    weights.update(draw(_head_matrix(c)))
    dtype = DTYPES[c.dtype][0]
    return {name: array.astype(dtype) for name, array in weights.items()}


# --- int4 weights -------------------------------------------------------------------------------

# (code - 8)^2 averaged over the 16 codes: a uniform code's second moment.
_CODE_SECOND_MOMENT = float(np.mean((np.arange(16) - 8.0) ** 2))
_SCALE_SPREAD = (0.5, 1.5)  # drawn scales vary per block, as trained ones do
_SPREAD_SECOND_MOMENT = (_SCALE_SPREAD[1] ** 3 - _SCALE_SPREAD[0] ** 3) / (3 * (_SCALE_SPREAD[1] - _SCALE_SPREAD[0]))


def quantize_int4(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``weight`` [K, N] as MatMulNBits' B (uint8 [N, K/32, 16]) and scales ([N, K/32], weight's dtype).

    ORT's own C++ routine, called as ``DefaultWeightOnlyQuantizer.qbits_block_quant`` calls
    it for a symmetric 4-bit QOperator model (its zero points stay unused: symmetric means 8).
    """
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits  # ORT's import is slow; only int4 builds pay it

    weight = np.ascontiguousarray(weight)
    rows, cols = weight.shape
    if rows % INT4_BLOCK_SIZE:
        raise ValueError(f"weight must have a multiple of {INT4_BLOCK_SIZE} rows (K), got shape {weight.shape}")
    blocks = rows // INT4_BLOCK_SIZE
    packed = np.zeros((cols, blocks, INT4_BLOCK_SIZE // 2), np.uint8)
    scales = np.zeros((cols, blocks), weight.dtype)
    zero_points = np.zeros((cols, (blocks + 1) // 2), np.uint8)
    quantize_matmul_4bits(packed, weight, scales, zero_points, INT4_BLOCK_SIZE, cols, rows, True)
    return packed, scales


def dequantize_int4(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The float64 [K, N] matrix that MatMulNBits' B ([N, K/32, 16] uint8) and scales mean.

    Byte j of a block holds element 2j in its low nibble and 2j + 1 in its high nibble;
    symmetric 4-bit codes have zero point 8, so an element is (code - 8) * its block's scale.
    """
    cols, blocks, half = packed.shape
    if half * 2 != INT4_BLOCK_SIZE or scales.shape != (cols, blocks):
        raise ValueError(
            f"packed must be [N, K/{INT4_BLOCK_SIZE}, {INT4_BLOCK_SIZE // 2}] and scales [N, K/{INT4_BLOCK_SIZE}], "
            f"got {packed.shape} and {scales.shape}"
        )
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(cols, blocks, INT4_BLOCK_SIZE)
    values = (codes.astype(np.float64) - 8.0) * scales.astype(np.float64)[..., None]
    return values.reshape(cols, blocks * INT4_BLOCK_SIZE).T


def _tensor_rng(config: DecoderConfig, name: str) -> np.random.Generator:
    # One stream per tensor, so any tensor can be drawn alone, in any order, without the others.
    return np.random.default_rng([config.seed, zlib.crc32(name.encode())])


def _drawn_codes(config: DecoderConfig, name: str, matrix: _Matrix) -> np.ndarray:
    """Uniform int4 codes, packed as MatMulNBits' B: every byte's two nibbles are uniform."""
    blocks = matrix.rows // INT4_BLOCK_SIZE
    raw = _tensor_rng(config, name + Q4_SUFFIX).bytes(matrix.cols * blocks * INT4_BLOCK_SIZE // 2)
    return np.frombuffer(raw, np.uint8).reshape(matrix.cols, blocks, INT4_BLOCK_SIZE // 2)


def _drawn_scales(config: DecoderConfig, name: str, matrix: _Matrix) -> np.ndarray:
    """Scales that give the dequantized matrix the float draw's RMS, scale / sqrt(rows)."""
    blocks = matrix.rows // INT4_BLOCK_SIZE
    base = matrix.scale / np.sqrt(matrix.rows) / np.sqrt(_CODE_SECOND_MOMENT * _SPREAD_SECOND_MOMENT)
    spread = _tensor_rng(config, name + SCALES_SUFFIX).uniform(*_SCALE_SPREAD, (matrix.cols, blocks))
    return (base * spread).astype(DTYPES[config.dtype][0])


def _drawn_embedding(config: DecoderConfig, name: str, chunk_rows: int = 8192) -> np.ndarray:
    """Unit-normal entries, each a random pick from a palette of 65536 normal draws: the same
    distribution to within float16's rounding, at half the cost of drawing every entry (the
    embedding is most of a real-width model's drawing time). Chunked so that no float64 or
    index array of the whole vocabulary exists at once."""
    rng, dtype = _tensor_rng(config, name), DTYPES[config.dtype][0]
    palette = rng.standard_normal(1 << 16).astype(dtype)
    table = np.empty((config.vocab_size, config.hidden), dtype)
    for start in range(0, config.vocab_size, chunk_rows):
        stop = min(start + chunk_rows, config.vocab_size)
        table[start:stop] = palette[rng.integers(0, 1 << 16, (stop - start, config.hidden), dtype=np.uint16)]
    return table


def _drawn_norm(config: DecoderConfig, prefix: str) -> dict[str, np.ndarray]:
    dtype = DTYPES[config.dtype][0]
    return {name: array.astype(dtype) for name, array in _norm_params(config, _tensor_rng(config, prefix), prefix).items()}


# --- initializers -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Tensor:
    """One initializer, made on demand: a real-width model is written one tensor at a time."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    make: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def _made(name: str, array: np.ndarray) -> _Tensor:
    return _Tensor(name, array.shape, array.dtype, lambda: array)


def _fixed_tensors(config: DecoderConfig) -> list[_Tensor]:
    """The layouts, rotary caches and graph constants (the same for every weight source)."""
    c = config
    np_dtype = DTYPES[c.dtype][0]
    rows, cols = mask_to_csr(phi3_small_mask(c.max_position // c.sparse_block_size, c.layouts, c.local_blocks, c.vert_stride))
    cos, sin = rotary_caches(c.max_position, c.head_size)
    return [
        _made("block_row_indices", rows),
        _made("block_col_indices", cols),
        _made("cos_cache", cos.astype(np_dtype)),
        _made("sin_cache", sin.astype(np_dtype)),
        _made("/model/constants/axes_1", np.array([1], np.int64)),
        _made("/model/constants/index_1", np.array(1, np.int64)),
        _made("/model/constants/one_int32", np.array(1, np.int32)),
    ]


def _float_plan(config: DecoderConfig) -> list[_Tensor]:
    return [_made(name, array) for name, array in _weights(config).items()]


def _quantized_plan(config: DecoderConfig) -> list[_Tensor]:
    """The float draws, each matrix replaced by ORT's int4 quantization of it."""
    matrices = _all_matrices(config)
    plan = []
    for name, array in _weights(config).items():
        if name in matrices:
            packed, scales = quantize_int4(array)
            plan += [_made(name + Q4_SUFFIX, packed), _made(name + SCALES_SUFFIX, scales)]
        else:
            plan.append(_made(name, array))
    return plan


def _drawn_matrix(config: DecoderConfig, name: str, matrix: _Matrix) -> list[_Tensor]:
    blocks = matrix.rows // INT4_BLOCK_SIZE
    return [
        _Tensor(name + Q4_SUFFIX, (matrix.cols, blocks, INT4_BLOCK_SIZE // 2), np.dtype(np.uint8), partial(_drawn_codes, config, name, matrix)),
        _Tensor(name + SCALES_SUFFIX, (matrix.cols, blocks), np.dtype(DTYPES[config.dtype][0]), partial(_drawn_scales, config, name, matrix)),
    ]


def _drawn_plan(config: DecoderConfig) -> list[_Tensor]:
    """Codes and scales drawn tensor by tensor, in the float draws' order; nothing is made yet."""
    c = config
    dtype = np.dtype(DTYPES[c.dtype][0])
    plan = [_Tensor("model.embed_tokens.weight", (c.vocab_size, c.hidden), dtype, partial(_drawn_embedding, c, "model.embed_tokens.weight"))]

    def norm(prefix):
        # Tiny: made now, so the shapes come from the arrays.
        return [_made(name, array) for name, array in _drawn_norm(c, prefix).items()]

    for i in range(c.layers):
        p = f"model.layers.{i}"
        matrices = list(_layer_matrices(c, i).items())
        plan += norm(f"{p}.input_layernorm")
        for name, matrix in matrices[:2]:
            plan += _drawn_matrix(c, name, matrix)
        plan += norm(f"{p}.post_attention_layernorm")
        for name, matrix in matrices[2:]:
            plan += _drawn_matrix(c, name, matrix)
    plan += norm("model.norm")
    for name, matrix in _head_matrix(c).items():
        plan += _drawn_matrix(c, name, matrix)
    return plan


def _initializer_plan(config: DecoderConfig) -> list[_Tensor]:
    """Every initializer in the order the external data file holds them: the weights layer by
    layer (embedding first), then the layouts, rotary caches and constants."""
    weights = {"float": _float_plan, "quantized": _quantized_plan, "drawn": _drawn_plan}[config.weight_source](config)
    return weights + _fixed_tensors(config)


def _graph_order(tensors: list[TensorProto]) -> list[TensorProto]:
    """The order ORT's quantizer leaves: it removes each float matrix and appends its <name>_Q4
    and <name>_scales at the end, in node order. Float models keep the plan's order."""
    quantized = [t for t in tensors if t.name.endswith((Q4_SUFFIX, SCALES_SUFFIX))]
    return [t for t in tensors if not t.name.endswith((Q4_SUFFIX, SCALES_SUFFIX))] + quantized


def initializer_bytes(config: DecoderConfig) -> int:
    """Bytes of all the initializers of ``config``'s model (a progress bar's total)."""
    config.validate()
    return sum(tensor.nbytes for tensor in _initializer_plan(config))


# --- graph ----------------------------------------------------------------------------------------


class _GraphBuilder:
    """Collects nodes with unique names, builder-style (``/model/layers.0/attn/...``)."""

    def __init__(self):
        self.nodes: list[onnx.NodeProto] = []

    def add(self, op_type: str, inputs, name: str, domain: str = "", outputs: int | list[str] = 1, **attrs) -> list[str]:
        names = outputs if isinstance(outputs, list) else [f"{name}/output_{k}" for k in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, name=name, domain=domain, **attrs))
        return names

    def one(self, op_type: str, inputs, name: str, domain: str = "", **attrs) -> str:
        return self.add(op_type, inputs, name, domain, **attrs)[0]


def _norm(g: _GraphBuilder, config: DecoderConfig, x: str, prefix: str, name: str) -> str:
    if config.norm == "layer":
        return g.one("LayerNormalization", [x, f"{prefix}.weight", f"{prefix}.bias"], name, axis=-1, epsilon=config.norm_epsilon)
    return g.one("SimplifiedLayerNormalization", [x, f"{prefix}.weight"], name, axis=-1, epsilon=config.norm_epsilon)


def _linear(g: _GraphBuilder, config: DecoderConfig, x: str, weight: str, matrix: _Matrix, name: str, output: str = "") -> str:
    """x @ weight: a MatMul, or with int4 weights the node ORT's quantizer puts in its place
    (MatMulNBits named <matmul>_Q4, the MatMul's output name, attributes K, N, bits, block_size)."""
    outputs = [output or f"{name}/output_0"]
    if config.weights == "float":
        return g.add("MatMul", [x, weight], name, outputs=outputs)[0]
    return g.add(
        "MatMulNBits",
        [x, weight + Q4_SUFFIX, weight + SCALES_SUFFIX],
        name + Q4_SUFFIX,
        DOMAIN,
        outputs=outputs,
        K=matrix.rows,
        N=matrix.cols,
        bits=4,
        block_size=INT4_BLOCK_SIZE,
    )[0]


def _decoder_nodes(config: DecoderConfig) -> list[onnx.NodeProto]:
    c = config
    g = _GraphBuilder()
    # Lengths from the mask, as the GenAI builder derives them.
    key_totals_64 = g.one("ReduceSum", [ATTENTION_MASK, "/model/constants/axes_1"], "/model/attn_mask_reformat/ReduceSum", keepdims=0)
    key_totals = g.one("Cast", [key_totals_64], "/model/attn_mask_reformat/key_total_seq_lens/Cast", to=TensorProto.INT32)
    seqlens_k = g.one("Sub", [key_totals, "/model/constants/one_int32"], "/model/attn_mask_reformat/seqlens_k/Sub")
    mask_shape = g.one("Shape", [ATTENTION_MASK], "/model/attn_mask_reformat/Shape")
    total_64 = g.one("Gather", [mask_shape, "/model/constants/index_1"], "/model/attn_mask_reformat/Gather", axis=0)
    total = g.one("Cast", [total_64], "/model/attn_mask_reformat/total_seq_len/Cast", to=TensorProto.INT32)

    x = g.one("Gather", ["model.embed_tokens.weight", INPUT_IDS], "/model/embed_tokens/Gather", axis=0)
    for i in range(c.layers):
        p, n = f"model.layers.{i}", f"/model/layers.{i}"
        qkv_w, o_w, up_w, down_w = matrices = _layer_matrices(c, i)
        normed = _norm(g, c, x, f"{p}.input_layernorm", f"{n}/input_layernorm/LayerNorm")
        qkv = _linear(g, c, normed, qkv_w, matrices[qkv_w], f"{n}/attn/qkv_proj/MatMul")
        present = [PRESENT_KEY % i, PRESENT_VALUE % i]
        past = [PAST_KEY % i, PAST_VALUE % i]
        if c.is_dense(i):
            attention = g.add(
                GQA_OP_TYPE,
                [qkv, "", "", *past, seqlens_k, total, "cos_cache", "sin_cache"],
                f"{n}/attn/GroupQueryAttention",
                DOMAIN,
                outputs=[f"{n}/attn/GroupQueryAttention/output_0", *present],
                num_heads=c.num_heads,
                kv_num_heads=c.kv_num_heads,
                do_rotary=1,
                rotary_interleaved=0,
            )[0]
        else:
            attention = g.add(
                OP_TYPE,
                [qkv, "", "", *past, "block_row_indices", "block_col_indices", total, key_totals, "cos_cache", "sin_cache"],
                f"{n}/attn/SparseAttention",
                DOMAIN,
                outputs=[f"{n}/attn/SparseAttention/output_0", *present],
                num_heads=c.num_heads,
                kv_num_heads=c.kv_num_heads,
                sparse_block_size=c.sparse_block_size,
                do_rotary=1,
                rotary_interleaved=0,
            )[0]
        projected = _linear(g, c, attention, o_w, matrices[o_w], f"{n}/attn/o_proj/MatMul")
        x = g.one("Add", [x, projected], f"{n}/attn/residual/Add")
        normed = _norm(g, c, x, f"{p}.post_attention_layernorm", f"{n}/post_attention_layernorm/LayerNorm")
        up = _linear(g, c, normed, up_w, matrices[up_w], f"{n}/mlp/up_proj/MatMul")
        gate = g.one("Sigmoid", [up], f"{n}/mlp/act_fn/Sigmoid")
        activated = g.one("Mul", [up, gate], f"{n}/mlp/act_fn/Mul")
        down = _linear(g, c, activated, down_w, matrices[down_w], f"{n}/mlp/down_proj/MatMul")
        x = g.one("Add", [x, down], f"{n}/mlp/residual/Add")
    normed = _norm(g, c, x, "model.norm", "/model/norm/LayerNorm")
    ((head_name, head),) = _head_matrix(c).items()
    _linear(g, c, normed, head_name, head, "/lm_head/MatMul", output=LOGITS)
    return g.nodes


def _graph_io(config: DecoderConfig) -> tuple[list[onnx.ValueInfoProto], list[onnx.ValueInfoProto]]:
    """Graph inputs and outputs. A static cache declares its rows; otherwise the caller picks them."""
    c = config
    elem = DTYPES[c.dtype][1]
    cache_in = ["batch_size", c.kv_num_heads, c.static_cache or "past_sequence_length", c.head_size]
    cache_out = ["batch_size", c.kv_num_heads, c.static_cache or "total_sequence_length", c.head_size]
    inputs = [
        helper.make_tensor_value_info(INPUT_IDS, TensorProto.INT64, ["batch_size", "sequence_length"]),
        helper.make_tensor_value_info(ATTENTION_MASK, TensorProto.INT64, ["batch_size", "total_sequence_length"]),
    ]
    outputs = [helper.make_tensor_value_info(LOGITS, elem, ["batch_size", "sequence_length", c.vocab_size])]
    for i in range(c.layers):
        inputs += [helper.make_tensor_value_info(name % i, elem, cache_in) for name in (PAST_KEY, PAST_VALUE)]
        outputs += [helper.make_tensor_value_info(name % i, elem, cache_out) for name in (PRESENT_KEY, PRESENT_VALUE)]
    return inputs, outputs


def _props_config(config: DecoderConfig) -> dict:
    """asdict(config) less the late fields still at their defaults (see _LATE_FIELDS)."""
    defaults = {field.name: field.default for field in fields(DecoderConfig)}
    return {name: value for name, value in asdict(config).items() if name not in _LATE_FIELDS or value != defaults[name]}


def _assemble(config: DecoderConfig, initializers: list[TensorProto], check: bool) -> onnx.ModelProto:
    inputs, outputs = _graph_io(config)
    graph = helper.make_graph(_decoder_nodes(config), "phi3small_tiny_decoder", inputs, outputs, _graph_order(initializers))
    # onnx's checker does not know ORT's SimplifiedLayerNormalization (an ORT schema in the ONNX domain).
    model = finish_model(graph, check=check and config.norm == "layer")
    # The config travels with the model, so a reader knows what it is looking at.
    helper.set_model_props(model, {"sparse_attention_op.decoder_config": json.dumps(_props_config(config), sort_keys=True)})
    return model


def build_decoder(config: DecoderConfig) -> onnx.ModelProto:
    """The decoder of ``config`` as an ONNX model (deterministic: same config, same bytes).

    Every weight is held in the proto, which protobuf caps at 2 GB: larger models go through
    :func:`write_model_folder` with ``external_data=True``.
    """
    if not isinstance(config, DecoderConfig):
        raise TypeError(f"config must be a DecoderConfig, got {type(config).__name__}")
    config.validate()
    initializers = [numpy_helper.from_array(np.asarray(tensor.make()), tensor.name) for tensor in _initializer_plan(config)]
    return _assemble(config, initializers, check=True)


def genai_config(config: DecoderConfig, filename: str = "model.onnx") -> dict:
    """genai_config.json of onnxruntime-genai (0.x schema) for a model built from ``config``.

    ``type`` is "phi3small", as the builder writes for Phi-3-small; past and present share
    one buffer of ``max_length`` rows (the GQA and SparseAttention kernels need that), which
    a static cache fixes at its ``static_cache`` rows.
    """
    config.validate()
    c = config
    return {
        "model": {
            "bos_token_id": c.bos_token_id,
            "context_length": c.max_position,
            "decoder": {
                "session_options": {},
                "filename": filename,
                "head_size": c.head_size,
                "hidden_size": c.hidden,
                "inputs": {
                    "input_ids": INPUT_IDS,
                    "attention_mask": ATTENTION_MASK,
                    "past_key_names": PAST_KEY,
                    "past_value_names": PAST_VALUE,
                },
                "outputs": {
                    "logits": LOGITS,
                    "present_key_names": PRESENT_KEY,
                    "present_value_names": PRESENT_VALUE,
                },
                "num_attention_heads": c.num_heads,
                "num_hidden_layers": c.layers,
                "num_key_value_heads": c.kv_num_heads,
            },
            "eos_token_id": c.eos_token_id,
            "pad_token_id": c.pad_token_id,
            "type": "phi3small",
            "vocab_size": c.vocab_size,
        },
        "search": {
            "diversity_penalty": 0.0,
            "do_sample": False,
            "early_stopping": True,
            "length_penalty": 1.0,
            "max_length": c.static_cache or c.max_position,
            "min_length": 0,
            "no_repeat_ngram_size": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            "past_present_share_buffer": True,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 1,
            "top_p": 1.0,
        },
    }


def model_bytes(config: DecoderConfig) -> bytes:
    """The serialized model exactly as :func:`write_model_folder` writes it."""
    return build_decoder(config).SerializeToString()


def genai_config_text(config: DecoderConfig, filename: str = "model.onnx") -> str:
    """genai_config.json's text exactly as :func:`write_model_folder` writes it."""
    return json.dumps(genai_config(config, filename), indent=4) + "\n"


#: onnx's conventions for external data: smaller tensors stay in the proto; large ones start
#: on a 64 KiB boundary, so a loader can map them straight from the file.
EXTERNAL_MIN_BYTES = 1024
ALIGN_MIN_BYTES = 1 << 20
ALIGNMENT = 1 << 16
_PARTIAL = ".partial"  # files being written carry this suffix until the folder is complete

Progress = Callable[[str, int], None]  # called after each initializer is written: (name, bytes)


def write_model_folder(
    config: DecoderConfig, folder: str | os.PathLike, filename: str = "model.onnx", *, external_data: bool = False, progress: Progress | None = None
) -> Path:
    """Write ``folder/filename`` and ``folder/genai_config.json``; return the model's path.

    ``external_data=True`` writes every initializer of 1 KB or more to ``filename + ".data"``
    (one file, as the GenAI builder does), drawing and writing one tensor at a time: memory
    stays near the largest tensor, whatever the model's size. Use it beyond protobuf's 2 GB.
    ``progress(name, bytes)`` is called after each initializer is written there (a progress
    bar's total is :func:`initializer_bytes`); without external data, once for the model file.
    """
    if not isinstance(filename, str) or not filename or Path(filename).name != filename:
        raise ValueError(f"filename must be a plain file name, got {filename!r}")
    folder = Path(folder)
    if external_data:
        return _write_external_folder(config, folder, filename, progress)
    data, config_text = model_bytes(config), genai_config_text(config, filename)  # built first: a failure writes nothing
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / filename
    path.write_bytes(data)
    (folder / "genai_config.json").write_text(config_text)
    if progress is not None:
        progress(filename, len(data))
    return path


def _external_tensor(array: np.ndarray, name: str, location: str, offset: int) -> TensorProto:
    tensor = TensorProto(name=name, dims=array.shape, data_type=helper.np_dtype_to_tensor_dtype(array.dtype))
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", offset), ("length", array.nbytes)):
        tensor.external_data.add(key=key, value=str(value))
    return tensor


def _stream_initializers(plan: list[_Tensor], data_path: Path, location: str, progress: Progress | None) -> list[TensorProto]:
    """Make each tensor of ``plan`` and append it to ``data_path``; the protos that point there."""
    tensors = []
    with open(data_path, "wb") as data:
        for entry in plan:
            # ONNX stores raw data little-endian. (np.asarray, not ascontiguousarray: that makes
            # scalars 1-D; reshape(-1) below copies whatever is not contiguous.)
            array = np.asarray(entry.make(), dtype=np.dtype(entry.dtype).newbyteorder("<"))
            if array.nbytes < EXTERNAL_MIN_BYTES:
                tensors.append(numpy_helper.from_array(array, entry.name))
            else:
                if array.nbytes >= ALIGN_MIN_BYTES:
                    data.write(b"\0" * (-data.tell() % ALIGNMENT))
                tensors.append(_external_tensor(array, entry.name, location, data.tell()))
                data.write(memoryview(array.reshape(-1)).cast("B"))
            if progress is not None:
                progress(entry.name, array.nbytes)
            del array  # before the next tensor is made
    return tensors


def _write_external_folder(config: DecoderConfig, folder: Path, filename: str, progress: Progress | None) -> Path:
    config.validate()
    config_text = genai_config_text(config, filename)
    location = filename + ".data"
    folder.mkdir(parents=True, exist_ok=True)
    final = {name: folder / name for name in (location, filename)}
    partial_paths = {name: path.with_name(path.name + _PARTIAL) for name, path in final.items()}
    try:
        tensors = _stream_initializers(_initializer_plan(config), partial_paths[location], location, progress)
        # The checker wants the data file beside the model, so it runs on the finished folder.
        partial_paths[filename].write_bytes(_assemble(config, tensors, check=False).SerializeToString())
        for name in (location, filename):  # the model last: a folder with a model is a complete one
            os.replace(partial_paths[name], final[name])
    finally:
        for path in partial_paths.values():
            path.unlink(missing_ok=True)
    (folder / "genai_config.json").write_text(config_text)
    if config.norm == "layer":
        onnx.checker.check_model(str(final[filename]))
    return final[filename]


# --- float64 reference ------------------------------------------------------------------------


def _norm_reference(x: np.ndarray, weights: dict, prefix: str, node: onnx.NodeProto) -> np.ndarray:
    epsilon = node_attributes(node).get("epsilon", 1e-5)
    gain = weights[f"{prefix}.weight"]
    if node.op_type == "LayerNormalization":
        centred = x - x.mean(axis=-1, keepdims=True)
        return centred / np.sqrt((centred**2).mean(axis=-1, keepdims=True) + epsilon) * gain + weights[f"{prefix}.bias"]
    return x / np.sqrt((x**2).mean(axis=-1, keepdims=True) + epsilon) * gain


def _reference_weights(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """float64 initializers by name; int4 pairs <name>_Q4, <name>_scales become the matrix <name>."""
    arrays = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    weights = {}
    for name, array in arrays.items():
        if name.endswith(Q4_SUFFIX):
            base = name.removesuffix(Q4_SUFFIX)
            weights[base] = dequantize_int4(array, arrays[base + SCALES_SUFFIX])
        elif not name.endswith(SCALES_SUFFIX):
            weights[name] = array.astype(np.float64)
    return weights


def decoder_reference(model: onnx.ModelProto, input_ids, lengths) -> np.ndarray:
    """float64 logits (batch, seq, vocab) of a :func:`build_decoder` model over whole prompts.

    ``input_ids`` (batch, seq) is right-padded: row b's tokens are its first ``lengths[b]``
    entries (the SparseAttention contract, docs/design.md section 1). Weights are read from
    the model's initializers by name (int4 ones dequantized); SparseAttention layers use
    :func:`~sparse_attention_op.op.reference.sparse_attention_reference`, GroupQueryAttention
    layers the same reference with a causal layout. Logits at padding positions are
    whatever the padding computes: compare only positions < lengths[b].
    """
    ids = np.asarray(input_ids)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"input_ids must be a 2-D integer array (batch, seq), got shape {ids.shape} dtype {ids.dtype}")
    batch, seq = ids.shape
    lengths = np.asarray(lengths).reshape(-1)
    if lengths.shape != (batch,) or np.any(lengths < 1) or np.any(lengths > seq):
        raise ValueError(f"lengths must hold one length in [1, {seq}] per row of input_ids ({batch} rows), got {[int(n) for n in lengths]}")
    weights = _reference_weights(model)
    vocab = weights["model.embed_tokens.weight"].shape[0]
    if ids.min() < 0 or ids.max() >= vocab:
        raise ValueError(f"input_ids must lie in [0, {vocab}), got values in [{ids.min()}, {ids.max()}]")
    nodes = {node.name: node for node in model.graph.node}
    layers = sum(1 for graph_input in model.graph.input if graph_input.name.startswith("past_key_values.") and graph_input.name.endswith(".key"))
    rows, cols = weights["block_row_indices"].astype(np.int32), weights["block_col_indices"].astype(np.int32)
    cos, sin = weights["cos_cache"], weights["sin_cache"]
    total = np.array([seq], np.int32)
    key_totals = lengths.astype(np.int32)

    x = weights["model.embed_tokens.weight"][ids]
    for i in range(layers):
        p, n = f"model.layers.{i}", f"/model/layers.{i}"
        normed = _norm_reference(x, weights, f"{p}.input_layernorm", nodes[f"{n}/input_layernorm/LayerNorm"])
        qkv = normed @ weights[f"{p}.attn.qkv_proj.weight"]
        sparse = nodes.get(f"{n}/attn/SparseAttention")
        node = sparse or nodes[f"{n}/attn/GroupQueryAttention"]
        attrs = node_attributes(node)
        if sparse is not None:
            block, layout_rows, layout_cols = attrs["sparse_block_size"], rows, cols
        else:
            # Dense attention is the causal layout; any block size covering the cache will do.
            block = 16
            layout_rows, layout_cols = mask_to_csr(causal_mask(-(-cos.shape[0] // block)))
        num_heads, kv_heads = attrs["num_heads"], attrs["kv_num_heads"]
        head_size = qkv.shape[-1] // (num_heads + 2 * kv_heads)
        cache = np.zeros((batch, kv_heads, seq, head_size))
        attention, _, _ = sparse_attention_reference(
            qkv,
            None,
            None,
            cache,
            cache,
            layout_rows,
            layout_cols,
            total,
            key_totals,
            cos,
            sin,
            num_heads=num_heads,
            kv_num_heads=kv_heads,
            sparse_block_size=block,
            scale=float(attrs.get("scale", 0.0)),
            do_rotary=attrs.get("do_rotary", 0),
            rotary_interleaved=attrs.get("rotary_interleaved", 0),
        )
        x = x + attention @ weights[f"{p}.attn.o_proj.weight"]
        normed = _norm_reference(x, weights, f"{p}.post_attention_layernorm", nodes[f"{n}/post_attention_layernorm/LayerNorm"])
        up = normed @ weights[f"{p}.mlp.up_proj.weight"]
        x = x + (up / (1.0 + np.exp(-up))) @ weights[f"{p}.mlp.down_proj.weight"]
    normed = _norm_reference(x, weights, "model.norm", nodes["/model/norm/LayerNorm"])
    return normed @ weights["lm_head.weight"]
