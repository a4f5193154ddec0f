"""What ``sparse-attention-op export`` writes: one-node test graphs and small decoders.

* ``export graph OUT.onnx``: one SparseAttention node (the layout as initializers, every
  other input a graph input), optionally with unit-scale random feeds as an .npz.
* ``export decoder FOLDER``: an ORT GenAI model folder (``model.onnx`` and
  ``genai_config.json``) holding a decoder of sparse_attention_op.testing.decoder_models: one of the
  bundled presets (models/), with fields overridden as asked.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np
import onnx

from sparse_attention_op.cli.arguments import UsageError
from sparse_attention_op.op.spec import OpAttributes, SparseAttentionError, build_call
from sparse_attention_op.testing.decoder_models import BUNDLED_MODELS, DecoderConfig, write_model_folder
from sparse_attention_op.testing.feeds import npz_path
from sparse_attention_op.testing.graphs import sparse_attention_model
from sparse_attention_op.testing.inputs import CaseConfig, random_inputs

DEFAULT_PRESET = "phi3-small-tiny"
#: DecoderConfig fields the command line may override (--layers 6, --dtype float16, ...).
DECODER_OPTIONS = (
    "layers",
    "hidden",
    "num_heads",
    "kv_num_heads",
    "head_size",
    "sparse_block_size",
    "local_blocks",
    "vert_stride",
    "max_position",
    "dense_every",
    "vocab_size",
    "intermediate",
    "seed",
    "dtype",
    "norm",
)


def add_graph_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("output", type=Path, help="the .onnx file to write")
    parser.add_argument("--batch", type=int, default=1, help="batch rows of the feeds (default %(default)s)")
    parser.add_argument("--seq-len", type=int, default=8, help="new tokens per row (default %(default)s)")
    parser.add_argument("--past", type=int, default=None, help="history rows per row (omit for a prompt)")
    parser.add_argument("--num-heads", type=int, default=4, help="query heads (default %(default)s)")
    parser.add_argument("--kv-num-heads", type=int, default=2, help="key/value heads (default %(default)s)")
    parser.add_argument("--head-size", type=int, default=32, help="default %(default)s")
    parser.add_argument("--max-cache-len", type=int, default=64, help="rows of past_key/past_value (default %(default)s)")
    parser.add_argument("--block", type=int, default=16, help="sparse_block_size (default %(default)s)")
    parser.add_argument("--num-layout", type=int, default=2, help="layouts; must divide --num-heads (default %(default)s)")
    parser.add_argument("--local-blocks", type=int, default=2, help="local blocks of the Phi-3-small layout (default %(default)s)")
    parser.add_argument("--vert-stride", type=int, default=2, help="vertical stride of the layout (default %(default)s)")
    parser.add_argument("--packed", action="store_true", help="packed QKV in the query input")
    parser.add_argument("--rotary", action="store_true", help="do_rotary = 1, with cos/sin caches as graph inputs")
    parser.add_argument("--interleaved", action="store_true", help="rotary_interleaved = 1")
    parser.add_argument("--rotary-dim", type=int, default=None, help="rotary dims (default: the whole head)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random feeds (default %(default)s)")
    parser.add_argument("--inputs", type=Path, default=None, metavar="FEEDS.npz", help="also write random feeds, named as the graph's inputs")


def export_graph(args: argparse.Namespace) -> list[Path]:
    """Write the one-node graph (and feeds) that ``args`` describe; the paths written."""
    config = CaseConfig(
        batch=args.batch,
        seq_len=args.seq_len,
        num_heads=args.num_heads,
        kv_num_heads=args.kv_num_heads,
        head_size=args.head_size,
        max_cache_len=args.max_cache_len,
        sparse_block_size=args.block,
        num_layout=args.num_layout,
        local_blocks=args.local_blocks,
        vert_stride=args.vert_stride,
        past_lengths=None if args.past is None else (args.past,) * args.batch,
        packed=args.packed,
        do_rotary=args.rotary,
        rotary_interleaved=args.interleaved,
        rotary_dim=args.rotary_dim,
    )
    for option, given in (("--rotary-dim", args.rotary_dim is not None), ("--interleaved", args.interleaved)):
        if given and not args.rotary:
            raise UsageError(f"{option} applies to the rotary embedding: add --rotary")
    _check_graph_config(config)
    inputs = random_inputs(config, np.random.default_rng(args.seed))
    _check_against_spec(config, inputs)
    model = sparse_attention_model(
        config.node_attributes(), inputs, constants=("block_row_indices", "block_col_indices"), shapes=declared_shapes(config)
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(args.output))
    written = [args.output]
    if args.inputs:
        graph_inputs = {i.name for i in model.graph.input}
        feeds_path = npz_path(args.inputs)
        np.savez(feeds_path, **{k: v for k, v in inputs.items() if k in graph_inputs})
        written.append(feeds_path)
    return written


def _check_graph_config(config: CaseConfig) -> None:
    """The rules the graph's shapes must meet, as command-line messages (before any work)."""
    for option, value in (
        ("--batch", config.batch),
        ("--seq-len", config.seq_len),
        ("--num-heads", config.num_heads),
        ("--kv-num-heads", config.kv_num_heads),
        ("--head-size", config.head_size),
        ("--max-cache-len", config.max_cache_len),
        ("--block", config.sparse_block_size),
        ("--num-layout", config.num_layout),
    ):
        if value < 1:
            raise UsageError(f"{option} must be at least 1, got {value}")
    if config.num_heads % config.kv_num_heads or config.num_heads % config.num_layout:
        raise UsageError(
            f"--num-heads {config.num_heads} must be a multiple of --kv-num-heads {config.kv_num_heads} and --num-layout {config.num_layout}"
        )
    if config.local_blocks < 0:
        raise UsageError(f"--local-blocks must be >= 0, got {config.local_blocks}")
    if config.vert_stride < 1:
        raise UsageError(f"--vert-stride must be at least 1, got {config.vert_stride}")
    past = config.past_lengths[0] if config.past_lengths else 0
    if past < 0:
        raise UsageError(f"--past must be >= 0, got {past}")
    if past + config.seq_len > config.max_cache_len:
        raise UsageError(f"--past + --seq-len = {past + config.seq_len} must fit --max-cache-len {config.max_cache_len}")
    if config.max_cache_len % config.sparse_block_size:
        raise UsageError(f"--max-cache-len {config.max_cache_len} must be a multiple of --block {config.sparse_block_size}")


def _check_against_spec(config: CaseConfig, inputs: dict) -> None:
    """The node must be one SparseAttention accepts: spec.py's rules, applied to the feeds
    as the op applies them to a call (head sizes, rotary widths, the layout), before any
    file is written."""
    try:
        build_call(inputs, OpAttributes.from_mapping(config.node_attributes()))
    except SparseAttentionError as error:
        raise UsageError(f"these options make a graph SparseAttention refuses: {error}") from None


def declared_shapes(config: CaseConfig) -> dict[str, list]:
    """The graph's input and output shapes: sizes where the node's attributes fix them (head
    widths), names where a call chooses them, so that ``run`` sizes random feeds for the
    graph without being told its head size."""
    batch, seq, cache = "batch_size", "sequence_length", "max_cache_len"
    heads, kv_heads, head = config.num_heads, config.kv_num_heads, config.head_size
    cache_shape = [batch, kv_heads, cache, head]
    shapes = {
        "query": [batch, seq, (heads + 2 * kv_heads if config.packed else heads) * head],
        "key": [batch, seq, kv_heads * head],
        "value": [batch, seq, kv_heads * head],
        "past_key": cache_shape,
        "past_value": cache_shape,
        "total_sequence_length": [1],
        "key_total_sequence_lengths": [batch],
        "output": [batch, seq, heads * head],
        "present_key": cache_shape,
        "present_value": cache_shape,
    }
    if config.do_rotary:
        shapes["cos_cache"] = shapes["sin_cache"] = ["max_rotary_len", (config.rotary_dim or head) // 2]
    return shapes


def add_decoder_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folder", type=Path, help="the GenAI model folder to write (model.onnx, genai_config.json)")
    parser.add_argument("--overwrite", action="store_true", help="replace the folder's model and genai_config.json if it has them")
    parser.add_argument(
        "--preset",
        choices=sorted(BUNDLED_MODELS),
        default=DEFAULT_PRESET,
        help="the configuration to start from (default %(default)s; models/ holds each)",
    )
    defaults = DecoderConfig()
    for name in DECODER_OPTIONS:
        kind = type(getattr(defaults, name))
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=kind, default=None, metavar=kind.__name__.upper(), help=f"override the preset's {name}"
        )


def export_decoder(args: argparse.Namespace) -> tuple[Path, DecoderConfig]:
    """Write the decoder folder ``args`` describe; the model's path and its configuration."""
    overrides = {name: getattr(args, name) for name in DECODER_OPTIONS if getattr(args, name) is not None}
    config = dataclasses.replace(BUNDLED_MODELS[args.preset], **overrides)
    config.validate()
    present = [name for name in ("model.onnx", "genai_config.json") if (args.folder / name).exists()]
    if present and not args.overwrite:
        raise FileExistsError(f"{args.folder} already holds {' and '.join(present)} (a model folder): pass --overwrite to replace them")
    return write_model_folder(config, args.folder), config
