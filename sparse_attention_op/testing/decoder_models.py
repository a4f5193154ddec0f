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
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from sparse_attention_op.testing.graphs import finish_model
from sparse_attention_op.testing.inputs import rotary_caches
from sparse_attention_op.op.layouts import causal_mask, mask_to_csr, phi3_small_mask
from sparse_attention_op.op.reference import sparse_attention_reference
from sparse_attention_op.op.spec import DOMAIN, OP_TYPE
from sparse_attention_op.ort.graph import node_attributes

GQA_OP_TYPE = "GroupQueryAttention"
DTYPES = {"float32": (np.float32, TensorProto.FLOAT), "float16": (np.float16, TensorProto.FLOAT16)}
NORMS = ("layer", "rms")

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

    def validate(self) -> None:
        positive = ("vocab_size", "hidden", "layers", "num_heads", "kv_num_heads", "head_size", "sparse_block_size",
                    "local_blocks", "vert_stride", "max_position")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"DecoderConfig.{name} must be a positive int, got {value!r}")
        for name in ("dense_every", "num_layout", "intermediate", "seed"):
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

    @property
    def layouts(self) -> int:
        return self.num_layout or self.num_heads

    @property
    def mlp_width(self) -> int:
        return self.intermediate or 2 * self.hidden

    @property
    def qkv_width(self) -> int:
        return (self.num_heads + 2 * self.kv_num_heads) * self.head_size

    def is_dense(self, layer: int) -> bool:
        """Phi-3-small's rule: layer i (0-based) is dense when (i + 1) % dense_every == 0."""
        return bool(self.dense_every) and (layer + 1) % self.dense_every == 0


#: Folder name under models/ -> the configuration scripts/build_models.py writes there.
#: Small enough to ship (under 3 MB each) yet shaped like Phi-3-small: 4 query heads per kv
#: head, one layout per head, a dense GroupQueryAttention layer every second layer. Blocks
#: of 16 tokens with 2 local blocks make the sparsity bite after 32 tokens.
BUNDLED_MODELS: dict[str, DecoderConfig] = {
    "phi3-small-tiny": DecoderConfig(
        vocab_size=512, hidden=128, layers=4, num_heads=8, kv_num_heads=2, head_size=16, sparse_block_size=16,
        local_blocks=2, vert_stride=4, max_position=512, dense_every=2, dtype="float32", seed=0, intermediate=256,
    ),
    "phi3-small-tiny-f16": DecoderConfig(
        vocab_size=512, hidden=128, layers=4, num_heads=8, kv_num_heads=2, head_size=16, sparse_block_size=16,
        local_blocks=2, vert_stride=4, max_position=512, dense_every=2, dtype="float16", seed=0, intermediate=256,
    ),
}


def _weights(config: DecoderConfig) -> dict[str, np.ndarray]:
    """Every weight by initializer name, drawn in a fixed order from ``config.seed``.

    Scales: matrices are N(0, 1/fan_in), so a unit-scale input gives unit-scale outputs;
    the two residual branches are scaled down by sqrt(2 * layers) so the residual stream
    stays unit-ish through depth; the logits head gives logits of std ``logit_scale``.
    """
    c = config
    rng = np.random.default_rng(c.seed)
    branch = 1.0 / np.sqrt(2 * c.layers)

    def matrix(rows, cols, scale=1.0):
        return rng.standard_normal((rows, cols)) * (scale / np.sqrt(rows))

    def norm(prefix):
        # Gains near one, small biases: a non-trivial norm that keeps the scale.
        out = {f"{prefix}.weight": 1.0 + 0.1 * rng.standard_normal(c.hidden)}
        if c.norm == "layer":
            out[f"{prefix}.bias"] = 0.1 * rng.standard_normal(c.hidden)
        return out

    weights = {"model.embed_tokens.weight": rng.standard_normal((c.vocab_size, c.hidden))}
    for i in range(c.layers):
        p = f"model.layers.{i}"
        weights.update(norm(f"{p}.input_layernorm"))
        weights[f"{p}.attn.qkv_proj.weight"] = matrix(c.hidden, c.qkv_width, 1.5)  # sharper attention than uniform
        weights[f"{p}.attn.o_proj.weight"] = matrix(c.num_heads * c.head_size, c.hidden, branch)
        weights.update(norm(f"{p}.post_attention_layernorm"))
        weights[f"{p}.mlp.up_proj.weight"] = matrix(c.hidden, c.mlp_width, 2.0)
        weights[f"{p}.mlp.down_proj.weight"] = matrix(c.mlp_width, c.hidden, 2.0 * branch)
    weights.update(norm("model.norm"))
    weights["lm_head.weight"] = matrix(c.hidden, c.vocab_size, c.logit_scale)
    dtype = DTYPES[c.dtype][0]
    return {name: array.astype(dtype) for name, array in weights.items()}


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


def build_decoder(config: DecoderConfig) -> onnx.ModelProto:
    """The decoder of ``config`` as an ONNX model (deterministic: same config, same bytes)."""
    if not isinstance(config, DecoderConfig):
        raise TypeError(f"config must be a DecoderConfig, got {type(config).__name__}")
    config.validate()
    c = config
    np_dtype, elem = DTYPES[c.dtype]
    initializers = [numpy_helper.from_array(array, name) for name, array in _weights(c).items()]
    rows, cols = mask_to_csr(phi3_small_mask(c.max_position // c.sparse_block_size, c.layouts, c.local_blocks, c.vert_stride))
    cos, sin = rotary_caches(c.max_position, c.head_size)
    initializers += [
        numpy_helper.from_array(rows, "block_row_indices"),
        numpy_helper.from_array(cols, "block_col_indices"),
        numpy_helper.from_array(cos.astype(np_dtype), "cos_cache"),
        numpy_helper.from_array(sin.astype(np_dtype), "sin_cache"),
        numpy_helper.from_array(np.array([1], np.int64), "/model/constants/axes_1"),
        numpy_helper.from_array(np.array(1, np.int64), "/model/constants/index_1"),
        numpy_helper.from_array(np.array(1, np.int32), "/model/constants/one_int32"),
    ]

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
        normed = _norm(g, c, x, f"{p}.input_layernorm", f"{n}/input_layernorm/LayerNorm")
        qkv = g.one("MatMul", [normed, f"{p}.attn.qkv_proj.weight"], f"{n}/attn/qkv_proj/MatMul")
        present = [PRESENT_KEY % i, PRESENT_VALUE % i]
        past = [PAST_KEY % i, PAST_VALUE % i]
        if c.is_dense(i):
            attention = g.add(
                GQA_OP_TYPE, [qkv, "", "", *past, seqlens_k, total, "cos_cache", "sin_cache"], f"{n}/attn/GroupQueryAttention",
                DOMAIN, outputs=[f"{n}/attn/GroupQueryAttention/output_0", *present],
                num_heads=c.num_heads, kv_num_heads=c.kv_num_heads, do_rotary=1, rotary_interleaved=0,
            )[0]
        else:
            attention = g.add(
                OP_TYPE, [qkv, "", "", *past, "block_row_indices", "block_col_indices", total, key_totals, "cos_cache", "sin_cache"],
                f"{n}/attn/SparseAttention", DOMAIN, outputs=[f"{n}/attn/SparseAttention/output_0", *present],
                num_heads=c.num_heads, kv_num_heads=c.kv_num_heads, sparse_block_size=c.sparse_block_size, do_rotary=1,
                rotary_interleaved=0,
            )[0]
        projected = g.one("MatMul", [attention, f"{p}.attn.o_proj.weight"], f"{n}/attn/o_proj/MatMul")
        x = g.one("Add", [x, projected], f"{n}/attn/residual/Add")
        normed = _norm(g, c, x, f"{p}.post_attention_layernorm", f"{n}/post_attention_layernorm/LayerNorm")
        up = g.one("MatMul", [normed, f"{p}.mlp.up_proj.weight"], f"{n}/mlp/up_proj/MatMul")
        gate = g.one("Sigmoid", [up], f"{n}/mlp/act_fn/Sigmoid")
        activated = g.one("Mul", [up, gate], f"{n}/mlp/act_fn/Mul")
        down = g.one("MatMul", [activated, f"{p}.mlp.down_proj.weight"], f"{n}/mlp/down_proj/MatMul")
        x = g.one("Add", [x, down], f"{n}/mlp/residual/Add")
    normed = _norm(g, c, x, "model.norm", "/model/norm/LayerNorm")
    g.add("MatMul", [normed, "lm_head.weight"], "/lm_head/MatMul", outputs=[LOGITS])

    cache_in = ["batch_size", c.kv_num_heads, "past_sequence_length", c.head_size]
    cache_out = ["batch_size", c.kv_num_heads, "total_sequence_length", c.head_size]
    inputs = [
        helper.make_tensor_value_info(INPUT_IDS, TensorProto.INT64, ["batch_size", "sequence_length"]),
        helper.make_tensor_value_info(ATTENTION_MASK, TensorProto.INT64, ["batch_size", "total_sequence_length"]),
    ]
    outputs = [helper.make_tensor_value_info(LOGITS, elem, ["batch_size", "sequence_length", c.vocab_size])]
    for i in range(c.layers):
        inputs += [helper.make_tensor_value_info(name % i, elem, cache_in) for name in (PAST_KEY, PAST_VALUE)]
        outputs += [helper.make_tensor_value_info(name % i, elem, cache_out) for name in (PRESENT_KEY, PRESENT_VALUE)]
    graph = helper.make_graph(g.nodes, "phi3small_tiny_decoder", inputs, outputs, initializers)
    # onnx's checker does not know ORT's SimplifiedLayerNormalization (an ORT schema in the ONNX domain).
    model = finish_model(graph, check=c.norm == "layer")
    # The config travels with the model, so a reader knows what it is looking at.
    helper.set_model_props(model, {"sparse_attention_op.decoder_config": json.dumps(asdict(c), sort_keys=True)})
    return model


def genai_config(config: DecoderConfig, filename: str = "model.onnx") -> dict:
    """genai_config.json of onnxruntime-genai (0.x schema) for a model built from ``config``.

    ``type`` is "phi3small", as the builder writes for Phi-3-small; past and present share
    one buffer of ``max_length`` rows (the GQA and SparseAttention kernels need that).
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
            "max_length": c.max_position,
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


def write_model_folder(config: DecoderConfig, folder: str | os.PathLike, filename: str = "model.onnx") -> Path:
    """Write ``folder/filename`` and ``folder/genai_config.json``; return the model's path."""
    if not isinstance(filename, str) or not filename or Path(filename).name != filename:
        raise ValueError(f"filename must be a plain file name, got {filename!r}")
    folder = Path(folder)
    data, config_text = model_bytes(config), genai_config_text(config, filename)  # built first: a failure writes nothing
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / filename
    path.write_bytes(data)
    (folder / "genai_config.json").write_text(config_text)
    return path


# --- float64 reference ------------------------------------------------------------------------


def _norm_reference(x: np.ndarray, weights: dict, prefix: str, node: onnx.NodeProto) -> np.ndarray:
    epsilon = node_attributes(node).get("epsilon", 1e-5)
    gain = weights[f"{prefix}.weight"]
    if node.op_type == "LayerNormalization":
        centred = x - x.mean(axis=-1, keepdims=True)
        return centred / np.sqrt((centred**2).mean(axis=-1, keepdims=True) + epsilon) * gain + weights[f"{prefix}.bias"]
    return x / np.sqrt((x**2).mean(axis=-1, keepdims=True) + epsilon) * gain


def decoder_reference(model: onnx.ModelProto, input_ids, lengths) -> np.ndarray:
    """float64 logits (batch, seq, vocab) of a :func:`build_decoder` model over whole prompts.

    ``input_ids`` (batch, seq) is right-padded: row b's tokens are its first ``lengths[b]``
    entries (the SparseAttention contract, docs/design.md section 1). Weights are read from
    the model's initializers by name; SparseAttention layers use
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
    weights = {init.name: numpy_helper.to_array(init).astype(np.float64) for init in model.graph.initializer}
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
            qkv, None, None, cache, cache, layout_rows, layout_cols, total, key_totals, cos, sin,
            num_heads=num_heads, kv_num_heads=kv_heads, sparse_block_size=block, scale=float(attrs.get("scale", 0.0)),
            do_rotary=attrs.get("do_rotary", 0), rotary_interleaved=attrs.get("rotary_interleaved", 0),
        )
        x = x + attention @ weights[f"{p}.attn.o_proj.weight"]
        normed = _norm_reference(x, weights, f"{p}.post_attention_layernorm", nodes[f"{n}/post_attention_layernorm/LayerNorm"])
        up = normed @ weights[f"{p}.mlp.up_proj.weight"]
        x = x + (up / (1.0 + np.exp(-up))) @ weights[f"{p}.mlp.down_proj.weight"]
    normed = _norm_reference(x, weights, "model.norm", nodes["/model/norm/LayerNorm"])
    return normed @ weights["lm_head.weight"]
