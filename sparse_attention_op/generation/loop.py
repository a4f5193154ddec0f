"""A generation loop for decoders in the ORT GenAI I/O convention, on shared KV buffers.

The convention (what the GenAI model builder writes, and sparse_attention_op.testing.decoder_models):
inputs ``input_ids`` (int64 [batch, seq]), ``attention_mask`` (int64 [batch, total]),
optionally ``position_ids``, and per layer ``past_key_values.{i}.key/value``; outputs
``logits`` ([batch, seq, vocab]) and ``present.{i}.key/value``.

Each layer's past and present are bound to one buffer of ``capacity`` rows (IO binding, as
GenAI runs decoders): the op writes the new rows into that buffer in place, and no
cache-sized tensor is copied per step (docs/design.md section 4).

Padding. The SparseAttention contract counts a row's *first* ``key_total_sequence_lengths[b]``
tokens as its history, so rows of a batch are right-padded here: prompts may be given as
lists of different lengths, or as one padded array with an ``attention_mask`` whose zeros
are on the left or on the right; a left-padded row is moved to the left edge first. Every
row then generates what it would generate alone (ORT GenAI's own left padding does not:
docs/genai.md, "Limitations").
"""

from __future__ import annotations

import numbers
import os
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnxruntime as ort

from sparse_attention_op.op.spec import INPUT_NAMES
from sparse_attention_op.ort.graph import (
    ModelLike,
    declared_head_size,
    declared_tensors,
    is_group_query_attention,
    is_sparse_attention,
    node_attributes,
)
from sparse_attention_op.ort.io_binding import device_pasts, on_device
from sparse_attention_op.ort.last_logits import LOGITS, LOGITS_POSITIONS, logits_head
from sparse_attention_op.ort.model import load_for_session
from sparse_attention_op.ort.providers import require_ep, session_ep
from sparse_attention_op.settings import SessionSettings, SettingsError

INPUT_IDS, ATTENTION_MASK, POSITION_IDS = "input_ids", "attention_mask", "position_ids"
_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
PRESENT = "present.{layer}.{kind}"


class GenerationError(ValueError):
    """An argument of :func:`generate` or the model's I/O does not fit; the message says which."""


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen from a row's logits.

    Greedy (``do_sample=False``, the default) takes the argmax (ties: the lowest id). Sampled
    draws from softmax(logits / temperature) after keeping the ``top_k`` largest (0: all) and
    then the smallest set whose probability reaches ``top_p``; ``seed`` fixes the draws.
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def validate(self) -> None:
        if not self.do_sample:
            return  # greedy: the other fields are not used
        for name in ("temperature", "top_p"):
            if not _is_real(getattr(self, name)):
                raise GenerationError(f"{name} must be a number, got {getattr(self, name)!r}")
        if not self.temperature > 0:
            raise GenerationError(f"temperature must be > 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise GenerationError(f"top_k must be an int >= 0 (0: no limit), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise GenerationError(f"top_p must lie in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise GenerationError(f"seed must be None or an int >= 0, got {self.seed!r}")


@dataclass
class GenerationResult:
    """What :func:`generate` produced, per row, and how long it took.

    ``tokens[b]`` are row b's new tokens, ending with the stop token that ended it, if one
    did (``finish_reasons[b]`` "stop"; else "length"). ``prompt_seconds`` is the prompt's
    run (the first new token); ``step_seconds`` one entry per decode step after it.
    """

    tokens: list[list[int]]
    prompt_lengths: list[int]
    finish_reasons: list[str]
    prompt_seconds: float
    step_seconds: list[float] = field(default_factory=list)

    @property
    def ms_per_token(self) -> float:
        """Mean wall time of one decode step (one new token for every unfinished row), in ms;
        the prompt's time when nothing followed it."""
        if not self.step_seconds:
            return 1e3 * self.prompt_seconds
        return 1e3 * sum(self.step_seconds) / len(self.step_seconds)

    @property
    def tokens_per_second(self) -> float:
        """Decode throughput: the tokens the decode steps produced (all rows; each row's first
        new token comes from the prompt) over their wall time. 0 when no step ran."""
        decode_tokens = sum(max(len(row) - 1, 0) for row in self.tokens)
        seconds = sum(self.step_seconds)
        return decode_tokens / seconds if seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "tokens": self.tokens,
            "ms_per_token": self.ms_per_token,
            "tokens_per_second": self.tokens_per_second,
            "prompt_ms": 1e3 * self.prompt_seconds,
            "prompt_lengths": self.prompt_lengths,
            "finish_reasons": self.finish_reasons,
        }


@dataclass(frozen=True)
class _DecoderIO:
    """The model's inputs and outputs in the GenAI convention, with the caches' shapes."""

    layers: tuple[int, ...]  # the layers whose caches are graph inputs (a held cache is none: ort/held_caches.py)
    kv_heads: int
    head_size: int
    cache_dtype: np.dtype
    has_position_ids: bool
    other_inputs: tuple[str, ...]
    vocab_size: int | None  # logits' last dim where the model fixes it
    static_rows: int | None  # the rows every past declares, for a model exported with a static KV cache
    id_dtypes: tuple[np.dtype, np.dtype, np.dtype]  # input_ids, attention_mask, position_ids (int64 or int32)
    last_logits: bool  # the logits are computed at one chosen position per row (ort/last_logits.py)

    @staticmethod
    def of(session: ort.InferenceSession, hints: dict | None = None) -> _DecoderIO:
        """The session's convention; ``hints`` ({"kv_heads", "head_size"}, read from the model's
        attention nodes by :func:`cache_dims_of`) stand in for cache dims the session declares symbolic."""
        hints = hints or {}
        inputs = {i.name: i for i in session.get_inputs()}
        outputs = {o.name for o in session.get_outputs()}
        for name in (INPUT_IDS, ATTENTION_MASK):
            if name not in inputs:
                raise GenerationError(
                    f"the model has no input '{name}': generate needs the ORT GenAI convention "
                    f"({INPUT_IDS}, {ATTENTION_MASK}, past_key_values.{{i}}.key/value)"
                )
        if LOGITS not in outputs:
            raise GenerationError(f"the model has no output '{LOGITS}'")
        vocab = next(o.shape[-1] for o in session.get_outputs() if o.name == LOGITS)
        pasts = {}
        for name, graph_input in inputs.items():
            match = _PAST.match(name)
            if match:
                pasts[(int(match.group(1)), match.group(2))] = graph_input
        layers = tuple(sorted({layer for layer, _ in pasts}))
        if not layers:
            raise GenerationError("the model has no input 'past_key_values.0.key': generate needs a decoder with a KV cache")
        shapes, rows = set(), set()
        for layer in layers:
            for kind in ("key", "value"):
                graph_input = pasts.get((layer, kind))
                if graph_input is None:
                    other = "value" if kind == "key" else "key"
                    raise GenerationError(f"the model has no input 'past_key_values.{layer}.{kind}' for its 'past_key_values.{layer}.{other}'")
                present = PRESENT.format(layer=layer, kind=kind)
                if present not in outputs:
                    raise GenerationError(f"the model has no output '{present}' for input '{graph_input.name}'")
                shape = list(graph_input.shape)
                if len(shape) == 4:
                    for axis, hint in ((1, "kv_heads"), (3, "head_size")):
                        if not isinstance(shape[axis], int) and hints.get(hint):
                            shape[axis] = hints[hint]
                if len(shape) != 4 or not all(isinstance(d, int) for d in (shape[1], shape[3])):
                    raise GenerationError(
                        f"input '{graph_input.name}' must be [batch, kv_heads, rows, head_size] with fixed kv_heads and "
                        f"head_size, got {graph_input.shape} (pass the model itself, so generate reads them from its attention nodes, or cache_dims=)"
                    )
                shapes.add((shape[1], shape[3], graph_input.type))
                rows.add(shape[2] if isinstance(shape[2], int) else None)
        if len(shapes) != 1:
            raise GenerationError(f"every past must have one kv_heads, head_size and type; the model has {sorted(shapes)}")
        kv_heads, head_size, type_name = shapes.pop()
        if len(rows) != 1:
            raise GenerationError(f"every past must declare the same rows, fixed or symbolic; the model's declare {sorted(rows, key=str)}")
        static_rows = rows.pop()
        dtypes = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
        if type_name not in dtypes:
            raise GenerationError(f"past caches of type {type_name} are not supported (float or float16)")
        known = {INPUT_IDS, ATTENTION_MASK, POSITION_IDS, LOGITS_POSITIONS} | {i.name for i in pasts.values()}
        integers = {"tensor(int64)": np.dtype(np.int64), "tensor(int32)": np.dtype(np.int32)}
        id_dtypes = []
        for name in (INPUT_IDS, ATTENTION_MASK, POSITION_IDS):
            declared = inputs[name].type if name in inputs else "tensor(int64)"
            if declared not in integers:
                raise GenerationError(f"input '{name}' must be int64 or int32, the model declares {declared}")
            id_dtypes.append(integers[declared])
        return _DecoderIO(
            layers,
            kv_heads,
            head_size,
            np.dtype(dtypes[type_name]),
            POSITION_IDS in inputs,
            tuple(name for name in inputs if name not in known),
            vocab if isinstance(vocab, int) else None,
            static_rows,
            tuple(id_dtypes),
            LOGITS_POSITIONS in inputs,
        )


def generate(
    model: ModelLike | ort.InferenceSession,
    prompts: Sequence[Sequence[int]] | np.ndarray,
    max_new_tokens: int,
    *,
    attention_mask: np.ndarray | None = None,
    stop_tokens: Iterable[int] = (),
    pad_token_id: int = 0,
    sampling: Sampling = Sampling(),
    capacity: int | None = None,
    kv_check: str = "fast",
    on_step: Callable[[int, list[int | None]], None] | None = None,
    cache_dims: tuple[int, int] | None = None,
    ep: str = "cpu",
    ep_options: dict | None = None,
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` new tokens for every prompt.

    ``model``: an ONNX model in the GenAI convention (a path, an ORT GenAI folder, bytes or a ModelProto: run
    through :func:`~sparse_attention_op.create_session` with ``kv_check``), or an
    ``InferenceSession`` to use as it is (a plain one runs ONNX Runtime's own kernels; its
    cache check is the one it was created with, and ``kv_check`` is only validated).
    ``prompts``: token ids per row, as lists of any lengths, or a 2-D integer array whose
    padding ``attention_mask`` (same shape, 1 = token, 0 = padding on either side) marks.
    A row stops after it emits one of ``stop_tokens``; finished rows are fed
    ``pad_token_id`` until every row is done. ``capacity``: rows of each KV buffer (default:
    the longest prompt plus ``max_new_tokens``; the model's context length bounds it; a
    model whose pasts declare a fixed length, a static KV cache, has that capacity).
    ``ep``: where the model's other nodes run, ``"cpu"`` or ``"webgpu"`` (ORT's WebGPU plugin
    EP, with ``ep_options``; see create_session). With the WebGPU EP each
    GroupQueryAttention layer's cache lives on the EP's device and each SparseAttention
    layer's in host memory, where this package's op reads it: no cache crosses between the
    two on any step. A given session's own EP decides the same way.
    ``on_step(step, new_tokens)`` is called after every token (None for finished rows).
    ``cache_dims``: (kv_heads, head_size) of the caches, for a session whose pasts leave them
    symbolic (given a model or folder, generate reads them there: :func:`cache_dims_of`).
    """
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    max_new_tokens = int(max_new_tokens)
    if not isinstance(sampling, Sampling):
        raise GenerationError(f"sampling must be a Sampling, got {type(sampling).__name__}")
    sampling.validate()
    if not _is_int(pad_token_id) or pad_token_id < 0:
        raise GenerationError(f"pad_token_id must be an int >= 0, got {pad_token_id!r}")
    if on_step is not None and not callable(on_step):
        raise GenerationError(f"on_step must be callable (step, new_tokens) or None, got {type(on_step).__name__}")
    try:
        SessionSettings(kv_check=kv_check)
    except SettingsError as error:
        raise GenerationError(str(error)) from None
    if cache_dims is not None and (len(tuple(cache_dims)) != 2 or not all(_is_int(d) and d > 0 for d in cache_dims)):
        raise GenerationError(f"cache_dims must be (kv_heads, head_size), two ints > 0, got {cache_dims!r}")
    rows = _prompt_rows(prompts, attention_mask)
    stops = _token_set(stop_tokens, "stop_tokens")
    longest = max(map(len, rows))
    if capacity is not None and (not _is_int(capacity) or capacity < longest + max_new_tokens):
        raise GenerationError(
            f"capacity must be an int that holds the longest prompt plus max_new_tokens = {longest + max_new_tokens} rows, got {capacity!r}"
        )
    require_ep(ep)
    session, hints = _session(model, kv_check, ep, ep_options)
    context = hints.get("context_length")
    # The positions a call reaches must lie in the context; the buffers may hold more rows.
    if context is not None and longest + max_new_tokens > context:
        raise GenerationError(
            f"the longest prompt ({longest}) plus max_new_tokens ({max_new_tokens}) is {longest + max_new_tokens} "
            f"positions, more than the model's context of {context} tokens (its cos/sin rows and layout)"
        )
    if cache_dims is not None:
        hints = {**hints, "kv_heads": cache_dims[0], "head_size": cache_dims[1]}
    io = _DecoderIO.of(session, hints)
    capacity = _capacity(io, capacity, longest + max_new_tokens)
    if io.other_inputs:
        raise GenerationError(f"the model takes input(s) generate does not know how to feed: {', '.join(io.other_inputs)}")
    if io.vocab_size is not None:
        _check_ids(rows, stops, pad_token_id, io.vocab_size)  # before any work
    loop = _Loop(session, io, len(rows), capacity, hints.get("device_layers"))
    rng = np.random.default_rng(sampling.seed) if sampling.do_sample else None
    ids, lengths = _right_padded(rows, pad_token_id)

    start = time.perf_counter()
    last = loop.last(ids, lengths)
    _check_ids(rows, stops, pad_token_id, last.shape[-1])
    generated: list[list[int]] = [[] for _ in rows]
    done = [False] * len(rows)
    prompt_seconds, step_seconds = time.perf_counter() - start, []
    for step in range(max_new_tokens):
        chosen = _choose(last, sampling, rng)
        emitted: list[int | None] = []
        for b, token in enumerate(chosen):
            if done[b]:
                emitted.append(None)
                continue
            generated[b].append(int(token))
            emitted.append(int(token))
            done[b] = int(token) in stops
        if on_step is not None:
            on_step(step, emitted)
        if all(done) or step == max_new_tokens - 1:
            break
        start = time.perf_counter()
        feed = np.array([pad_token_id if d else t for t, d in zip(chosen, done)], np.int64)[:, None]
        lengths = lengths + 1
        last = loop.last(feed, lengths)
        step_seconds.append(time.perf_counter() - start)
    reasons = ["stop" if d else "length" for d in done]
    return GenerationResult(generated, [len(r) for r in rows], reasons, prompt_seconds, step_seconds)


def _logits_positions(ends: np.ndarray) -> np.ndarray:
    """What a trimmed model's head is fed (ort/last_logits.py): one position where every row
    ends there, else each row's."""
    return (ends[:1] if (ends == ends[0]).all() else ends).astype(np.int64)


def _capacity(io: _DecoderIO, asked: int | None, needed: int) -> int:
    """Rows of each KV buffer: a static cache's own, else what was asked, else what is needed."""
    if io.static_rows is None:
        return int(asked) if asked is not None else needed
    if asked is not None and asked != io.static_rows:
        raise GenerationError(
            f"capacity={asked} differs from the {io.static_rows} rows the model's pasts declare (a static KV cache): "
            "leave capacity out, or pass that number"
        )
    if needed > io.static_rows:
        raise GenerationError(
            f"the longest prompt plus max_new_tokens is {needed} positions, more than the {io.static_rows} rows of the model's static KV cache"
        )
    return io.static_rows


def prompt_logits(
    session: ort.InferenceSession, prompts: Sequence[Sequence[int]], pad_token_id: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One run of whole prompts over empty caches, as :func:`generate` starts:
    (logits float32 (batch, longest, vocab), the right-padded ids, the lengths). Logits at
    padding positions are whatever padding computes: use positions below each length."""
    rows = _prompt_rows(prompts, None)
    ids, lengths = _right_padded(rows, pad_token_id)
    io = _DecoderIO.of(session)
    if io.last_logits:
        raise GenerationError(
            f"the session computes logits at one position per row (its model takes '{LOGITS_POSITIONS}'): make one without last_logits"
        )
    loop = _Loop(session, io, len(rows), _capacity(io, None, ids.shape[1]), _device_layers(session))
    return loop.step(ids, lengths).astype(np.float32), ids, lengths


def _right_padded(rows: list[list[int]], pad_token_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(batch, longest) int64 ids, row b's tokens first and ``pad_token_id`` after; the lengths."""
    lengths = np.array([len(r) for r in rows], np.int64)
    ids = np.full((len(rows), int(lengths.max())), pad_token_id, np.int64)
    for b, row in enumerate(rows):
        ids[b, : len(row)] = row
    return ids, lengths


class _Loop:
    """One generation's buffers and bindings: a KV buffer per past, bound as past and present.

    A buffer lives where the attention that reads it runs: in host memory for this
    package's op (and for any node on ORT's CPU EP), on the WebGPU EP's device for the
    layers ``device_layers`` names (GroupQueryAttention under that EP). Bound there as both
    past and present, no cache crosses between host and device on any step.
    """

    def __init__(self, session: ort.InferenceSession, io: _DecoderIO, batch: int, capacity: int, device_layers=None):
        self.session, self.io = session, io
        shape = (batch, io.kv_heads, capacity, io.head_size)
        # The host OrtValues borrow these arrays' memory: they live as long as the loop.
        self._arrays = {}
        self._caches = {}
        # One binding for the whole loop: the caches are bound once, as past and as present;
        # each step rebinds only the token inputs and the logits.
        self._binding = session.io_binding()
        self._binding.bind_output(LOGITS)  # bound first: get_outputs()[0], rebinding keeps its place
        device_layers = device_layers or frozenset()
        for layer in io.layers:
            for kind in ("key", "value"):
                array = np.zeros(shape, io.cache_dtype)
                value = ort.OrtValue.ortvalue_from_numpy(array)
                if layer in device_layers:
                    value = on_device(value)
                else:
                    self._arrays[layer, kind] = array
                self._caches[layer, kind] = value
                self._binding.bind_ortvalue_input(f"past_key_values.{layer}.{kind}", value)
                self._binding.bind_ortvalue_output(PRESENT.format(layer=layer, kind=kind), value)

    def step(self, ids: np.ndarray, key_totals: np.ndarray) -> np.ndarray:
        """Run the model on ``ids`` (batch, seq), row b's tokens ending at position
        key_totals[b]; the logits (batch, seq, vocab) in the model's type, in ORT's buffer
        (a prompt's are hundreds of MB: convert only the rows you read)."""
        batch, seq = ids.shape
        width = int(key_totals.max())
        mask = (np.arange(width)[None, :] < key_totals[:, None]).astype(np.int64)
        ids_dtype, mask_dtype, positions_dtype = self.io.id_dtypes
        binding = self._binding
        binding.bind_cpu_input(INPUT_IDS, np.ascontiguousarray(ids, ids_dtype))
        binding.bind_cpu_input(ATTENTION_MASK, mask.astype(mask_dtype))
        if self.io.has_position_ids:
            # A prompt's tokens sit at 0..seq-1 (padding included); later tokens end at key_totals - 1.
            first = np.zeros_like(key_totals) if width == seq else key_totals - seq
            positions = first[:, None] + np.arange(seq)[None, :]
            binding.bind_cpu_input(POSITION_IDS, positions.astype(positions_dtype))
        if self.io.last_logits:
            binding.bind_cpu_input(LOGITS_POSITIONS, _logits_positions(self._ends(seq, key_totals)))
        binding.bind_output(LOGITS)  # ORT allocates it: its shape changes between prompt and decode
        self.session.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy()

    def last(self, ids: np.ndarray, key_totals: np.ndarray) -> np.ndarray:
        """:meth:`step`, keeping the logits of each row's last token: float32 (batch, vocab)."""
        logits = self.step(ids, key_totals)
        rows = np.arange(len(ids))
        if self.io.last_logits:  # one listed position for all rows, or row b's at [b, b] (_logits_positions)
            return logits[rows, rows if logits.shape[1] > 1 else 0].astype(np.float32)
        return logits[rows, self._ends(ids.shape[1], key_totals)].astype(np.float32)

    @staticmethod
    def _ends(seq: int, key_totals: np.ndarray) -> np.ndarray:
        """Each row's last token within a call of ``seq`` tokens: a prompt's ends at
        key_totals - 1, a later call's at its last token."""
        return key_totals - 1 if seq == int(key_totals.max()) else np.full(len(key_totals), seq - 1)


def _session(model, kv_check: str, ep: str, ep_options: dict | None) -> tuple[ort.InferenceSession, dict]:
    """(the session, hints: cache dims it may declare symbolic, the context length, the
    layers whose caches live on the EP's device)."""
    if isinstance(model, ort.InferenceSession):
        return model, {"device_layers": _device_layers(model)}
    from sparse_attention_op.ort.session import create_session

    if isinstance(model, (str, os.PathLike)) and os.path.isdir(model):
        from sparse_attention_op.generation.model_files import resolve

        model = resolve(model).onnx_path  # an ORT GenAI folder: its decoder
    proto, _ = load_for_session(model)  # the weights stay in their files
    kv_heads, head_size = cache_dims_of(proto)
    source = model if isinstance(model, (str, os.PathLike)) else proto
    # The logits generate reads, where the model's head allows: a prompt's whole logits are hundreds of MB.
    trim = logits_head(proto) is not None
    session = create_session(source, kv_check=kv_check, ep=ep, ep_options=ep_options, last_logits=trim)
    hints = {
        "kv_heads": kv_heads,
        "head_size": head_size,
        "context_length": context_length_of(proto),
        "device_layers": device_layers_of(proto) if ep == "webgpu" else frozenset(),
    }
    return session, hints


def _device_layers(session: ort.InferenceSession) -> frozenset:
    """The layers whose caches live on the session's EP device (none unless it runs the WebGPU EP)."""
    if session_ep(session) != "webgpu":
        return frozenset()
    source = getattr(session, "_model_bytes", None) or getattr(session, "_model_path", None)
    if source is None:
        raise GenerationError("cannot tell where this session's caches belong: make it from a model path or bytes")
    proto = onnx.load_from_string(source) if isinstance(source, bytes) else onnx.load(source, load_external_data=False)
    return device_layers_of(proto)


def device_layers_of(model: onnx.ModelProto) -> frozenset:
    """The layers whose pasts live on the WebGPU EP's device (io_binding.device_pasts)."""
    return frozenset(int(match.group(1)) for match in map(_PAST.match, device_pasts(model)) if match)


def context_length_of(model: onnx.ModelProto) -> int | None:
    """The most tokens the model's SparseAttention nodes accept, where constants fix it: the
    rows of a constant cos_cache (with rotary) and a constant layout's block rows times the
    block size. None where nothing constant bounds it."""

    constants = {init.name: init for init in model.graph.initializer}
    bounds = []
    for node in model.graph.node:
        if not is_sparse_attention(node):
            continue
        named = dict(zip(INPUT_NAMES, node.input))
        attributes = node_attributes(node)
        rows = constants.get(named.get("block_row_indices", ""))
        if rows is not None and len(rows.dims) == 2:
            bounds.append((rows.dims[1] - 1) * int(attributes.get("sparse_block_size", 0)))
        cos = constants.get(named.get("cos_cache", ""))
        if attributes.get("do_rotary") and cos is not None and cos.dims:
            bounds.append(int(cos.dims[0]))
    return min(bounds) if bounds else None


def cache_dims_of(model: onnx.ModelProto) -> tuple[int | None, int | None]:
    """(kv_heads, head_size) of the model's caches: as the pasts declare them, else from the
    first attention node that reads a past (its kv_num_heads, and the head size the shapes
    ONNX can infer give); None where neither says."""

    for graph_input in model.graph.input:
        if _PAST.match(graph_input.name) and graph_input.type.tensor_type.HasField("shape"):
            dims = graph_input.type.tensor_type.shape.dim
            if len(dims) == 4 and dims[1].HasField("dim_value") and dims[3].HasField("dim_value"):
                return dims[1].dim_value, dims[3].dim_value
    for node in model.graph.node:
        if (is_sparse_attention(node) or is_group_query_attention(node)) and len(node.input) > 3 and _PAST.match(node.input[3]):
            kv_heads = int(node_attributes(node).get("kv_num_heads", 0)) or None
            return kv_heads, declared_head_size(node, declared_tensors(model))
    return None, None


def _prompt_rows(prompts, attention_mask) -> list[list[int]]:
    """The prompts as lists of ids, padding removed (a mask's zeros on either side)."""
    if isinstance(prompts, np.ndarray) or attention_mask is not None:
        try:
            ids = np.asarray(prompts)
        except ValueError:
            raise GenerationError("prompts given with an attention_mask must be one padded 2-D array (batch, seq)") from None
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer) or ids.shape[0] < 1 or ids.shape[1] < 1:
            raise GenerationError(f"prompts given as an array must be 2-D integer (batch, seq), got shape {ids.shape} dtype {ids.dtype}")
        if attention_mask is None:
            return [list(map(int, row)) for row in ids]
        mask = np.asarray(attention_mask)
        if mask.shape != ids.shape:
            raise GenerationError(f"attention_mask must have the prompts' shape {ids.shape}, got shape {mask.shape}")
        if not np.isin(mask, (0, 1)).all():
            raise GenerationError(
                f"attention_mask must hold only 0 (padding) and 1 (token), got values {[int(v) for v in np.unique(mask) if v not in (0, 1)][:5]}"
            )
        rows = []
        for b, row_mask in enumerate(mask.astype(bool)):
            kept = np.flatnonzero(row_mask)
            if kept.size == 0:
                raise GenerationError(f"attention_mask row {b} masks every token: each prompt needs at least one")
            if kept[-1] - kept[0] + 1 != kept.size:
                raise GenerationError(f"attention_mask row {b} has padding between tokens; padding must be on the left or the right")
            rows.append(list(map(int, ids[b, kept])))
        return rows
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise GenerationError("prompts must be a non-empty list of token-id lists (or a 2-D array)")
    rows = []
    for b, row in enumerate(prompts):
        if isinstance(row, (int, np.integer)):
            raise GenerationError("prompts must be a list of rows (lists of token ids): wrap a single prompt as [[...]]")
        row = list(row)
        if not row or not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in row):
            raise GenerationError(f"prompt row {b} must be a non-empty list of int token ids, got {row!r}")
        rows.append([int(t) for t in row])
    return rows


def _token_set(tokens, name: str) -> set[int]:
    tokens = [tokens] if isinstance(tokens, (int, np.integer)) else list(tokens)
    if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in tokens):
        raise GenerationError(f"{name} must be int token ids, got {tokens!r}")
    return {int(t) for t in tokens}


def _check_ids(rows, stops, pad_token_id, vocab: int) -> None:
    for b, row in enumerate(rows):
        bad = [t for t in row if not 0 <= t < vocab]
        if bad:
            raise GenerationError(f"prompt row {b}: token id(s) {bad[:5]} outside the vocabulary [0, {vocab})")
    bad = sorted(t for t in stops if not 0 <= t < vocab)
    if bad:
        raise GenerationError(f"stop_tokens {bad} lie outside the vocabulary [0, {vocab})")
    if not 0 <= pad_token_id < vocab:
        raise GenerationError(f"pad_token_id {pad_token_id} lies outside the vocabulary [0, {vocab})")


def _choose(logits: np.ndarray, sampling: Sampling, rng: np.random.Generator | None) -> np.ndarray:
    """The next token of every row from its logits (batch, vocab)."""
    finite = np.isfinite(logits).all(axis=-1)
    if not finite.all():
        raise GenerationError(f"the model's logits of row(s) {[int(b) for b in np.flatnonzero(~finite)]} are not finite (NaN or inf)")
    if not sampling.do_sample:
        return np.argmax(logits, axis=-1)
    scores = logits.astype(np.float64) / sampling.temperature
    chosen = np.empty(len(scores), np.int64)
    for b, row in enumerate(scores):
        order = np.argsort(-row, kind="stable")
        if sampling.top_k:
            order = order[: sampling.top_k]
        probabilities = np.exp(row[order] - row[order[0]])
        probabilities /= probabilities.sum()
        if sampling.top_p < 1:
            # The smallest prefix (in falling probability) whose mass reaches top_p.
            keep = int(np.searchsorted(np.cumsum(probabilities), sampling.top_p) + 1)
            order, probabilities = order[:keep], probabilities[:keep] / probabilities[:keep].sum()
        chosen[b] = order[rng.choice(len(order), p=probabilities)]
    return chosen


@dataclass(frozen=True)
class Divergence:
    """Where two greedy generations of the same prompts first differ, judged by one model's logits.

    ``gap`` is how much higher that model (the reference) scores its own token than the other
    run's token, after the common prefix; ``resolution`` is what the logits' dtype resolves
    there (two float16 ulps at the top logit, or 1e-4 of it in float32). A gap within the
    resolution is a near-tie: either pick is right, and the runs follow different paths from
    there. A larger gap means one run computed something else.
    """

    row: int
    step: int
    ours: int | None  # None: that run had stopped
    theirs: int | None
    gap: float
    resolution: float

    @property
    def near_tie(self) -> bool:
        return self.ours is not None and self.theirs is not None and self.gap <= self.resolution

    def describe(self) -> str:
        if self.ours is None or self.theirs is None:
            return f"row {self.row}: one run stopped at new token {self.step}, the other did not"
        kind = "a near-tie" if self.near_tie else "a real difference"
        return (
            f"row {self.row}, new token {self.step}: {self.ours} here, {self.theirs} there; the reference scores its own "
            f"token {self.gap:.3g} higher (its logits resolve {self.resolution:.3g} there): {kind}"
        )


def divergences(
    reference: ort.InferenceSession,
    prompts: Sequence[Sequence[int]],
    ours: Sequence[Sequence[int]],
    theirs: Sequence[Sequence[int]],
    cache_dims: tuple[int, int] | None = None,
) -> list[Divergence]:
    """Per row whose greedy tokens ``ours`` and ``theirs`` differ, where they first do, judged
    by the ``reference`` session (the run that produced ``theirs``); empty when every row is
    identical. The runs agree when each entry is a near-tie. ``cache_dims`` as for :func:`generate`."""
    found = []
    hints = {} if cache_dims is None else {"kv_heads": cache_dims[0], "head_size": cache_dims[1]}
    io, device_layers = None, None  # the reference's convention and cache placement, read at the first divergence
    for row, (prompt, mine, other) in enumerate(zip(prompts, ours, theirs)):
        step = next((i for i, (a, b) in enumerate(zip(mine, other)) if a != b), None)
        if step is None:
            if len(mine) != len(other):
                step = min(len(mine), len(other))
                found.append(Divergence(row, step, mine[step] if step < len(mine) else None, other[step] if step < len(other) else None, 0.0, 0.0))
            continue
        context = list(prompt) + list(other[:step])
        if io is None:
            io, device_layers = _DecoderIO.of(reference, hints), _device_layers(reference)
        loop = _Loop(reference, io, 1, _capacity(io, None, len(context)), device_layers)
        logits = loop.last(np.array([context], np.int64), np.array([len(context)]))[0].astype(np.float64)
        top = float(np.abs(logits).max())
        if io.cache_dtype == np.float16:
            resolution = 2 * 2.0 ** (np.floor(np.log2(max(top, 2.0**-14))) - 10)
        else:
            resolution = 1e-4 * max(1.0, top)
        found.append(Divergence(row, step, int(mine[step]), int(other[step]), float(logits[other[step]] - logits[mine[step]]), float(resolution)))
    return found


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
