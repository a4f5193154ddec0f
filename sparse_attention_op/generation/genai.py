"""ORT GenAI model folders whose SparseAttention nodes run through the bridge.

:func:`prepare_genai_folder` writes a copy of a GenAI model folder (``genai_config.json``,
its ONNX models, tokenizer files, ...) in which every model holding SparseAttention went
through :func:`~sparse_attention_op.ort.model.prepare_model`, and :func:`load_genai_model`
registers the bridge and opens it with ``onnxruntime_genai.Model``. What ORT GenAI 0.18
imposes, as measured (docs/genai.md):

* It loads a ``custom_ops_library`` only from inside the model folder (or the current
  directory, or an EP library's folder), after resolving symbolic links: a link to
  onnxruntime-extensions' library elsewhere is refused.
* The library must be the very file this process already loaded: the bridge's op was added
  to that loaded copy. A hard link is the same file (the dynamic loader sees one library); a
  copy loads as a second library without the op, and the session fails to load.
* With ``past_present_share_buffer`` true it binds each past and present to one buffer of
  ``max_length`` rows, so the op writes only the new rows in
  place. With it false, the first step is fed a zero-length past, which the op refuses.

Each prepared folder carries one session token, recorded in ``sparse_attention_op.json``
and stamped into its nodes' identities as create_session stamps its own: models loaded
from the same folder share their nodes' GPU state, per thread (see load_genai_model).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import tempfile
import threading
import uuid
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path

import onnx
from onnxruntime_extensions import get_library_path

from sparse_attention_op.generation.model_files import GENAI_CONFIG
from sparse_attention_op.ort.bridge import BRIDGE_FORMAT, register
from sparse_attention_op.ort.graph import all_nodes, is_sparse_attention
from sparse_attention_op.ort.held_caches import hold_sparse_caches
from sparse_attention_op.ort.model import bridge_format, is_bridge_node, load_constant_layouts, prepare_model
from sparse_attention_op.ort.providers import WEBGPU_EP, ExecutionProviderError, require_ep, webgpu_plugin
from sparse_attention_op.settings import SessionSettings

#: What prepare_genai_folder did, for load_genai_model and for people reading the folder.
#: A separate file: GenAI's config parser rejects keys it does not know.
RECORD_FILE = "sparse_attention_op.json"
#: GenAI's name of the WebGPU EP in configs and Config.append_provider.
GENAI_WEBGPU = "WebGPU"
#: How GenAI names a layer's past key unless the config says otherwise (decoder.inputs.past_key_names).
PAST_KEY_NAMES = "past_key_values.%d.key"


#: Who holds the SparseAttention layers' caches in a prepared folder.
SPARSE_CACHES = ("graph", "op")


def prepare_genai_folder(source, target, *, kv_check: str = "fast", sparse_caches: str = "graph", overwrite: bool = False) -> Path:
    """Write ``target``: the GenAI model folder ``source`` with SparseAttention run by this package.

    * Every ONNX model ``genai_config.json`` names (any ``filename`` under ``model``) that
      holds SparseAttention is rewritten by ``prepare_model(kv_check=kv_check)``; its
      external data files are copied unchanged (weights are never loaded).
    * Every other file is copied.
    * onnxruntime-extensions' library is hard-linked into ``target`` and named as
      ``custom_ops_library`` in the session options of each rewritten model;
      ``search.past_present_share_buffer`` is set to true.

    ``kv_check``: ``"fast"`` (default; GenAI always feeds back what the model returned) or
    ``"exact"``; stamped into the models, so it holds whatever session loads them.
    ``sparse_caches``: ``"graph"`` (default) leaves every cache a graph input and output,
    which GenAI allocates and binds; ``"op"`` takes the SparseAttention layers' caches out of
    the graph and lets each node hold its own (ort/held_caches.py), so that GenAI binds only
    the other layers'. Under ORT's WebGPU EP, which GenAI gives every cache it binds, that
    spares copying the SparseAttention caches between device and host on each step; it
    gives up beam search, a caller's edits of those caches, and more than one live sequence
    per thread (every model loaded from the folder shares its nodes' held caches).
    ``overwrite``: replace an existing ``target`` (only a GenAI model folder or an empty
    folder). The folder appears complete or not at all. Before ``onnxruntime_genai.Model``
    opens it, the process must have called :func:`sparse_attention_op.register` (or use
    :func:`load_genai_model`). Returns ``target`` as a Path.
    """
    SessionSettings(kv_check=kv_check)  # raises SettingsError (a ValueError) naming the setting
    if sparse_caches not in SPARSE_CACHES:
        raise ValueError(f"sparse_caches must be one of {SPARSE_CACHES}, got {sparse_caches!r}")
    source, target = Path(source), Path(target)
    config = _read_config(source, "source")
    _check_target(source, target, overwrite)
    library = Path(get_library_path())
    token = uuid.uuid4().hex

    created = _missing_ancestors(target.parent)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside target and renamed into place: a failure leaves no half-written folder.
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _link_library(library, staging / library.name, target)
        rewritten = []
        for component, relative in _named_models(config):
            model_path = _inside(source, relative, "source")
            model = _load_structure(model_path)
            if not _holds(model, is_sparse_attention):
                continue
            # One token for the folder (its GPU state is freed as one), one scope per model:
            # two models' nodes of the same name and index must not share a cache.
            prepared = prepare_model(model, session_token=token, kv_check=kv_check, scope=f"{relative}#")
            if sparse_caches == "op":
                _hold_caches(prepared, relative, _past_key_names(component))
            destination = staging / relative
            destination.parent.mkdir(parents=True, exist_ok=True)
            onnx.save(prepared, str(destination))
            options = component.setdefault("session_options", copy.deepcopy(_decoder_options(config)))
            _set_library(options, library.name, relative)
            rewritten.append(relative)
        if not rewritten:
            raise ValueError(f"source: no model that {GENAI_CONFIG} names holds a SparseAttention node: nothing would run on WebGPU")
        skip = {Path(name) for name in rewritten} | {Path(GENAI_CONFIG), Path(RECORD_FILE), Path(library.name)}
        _copy_tree(source, staging, skip)
        config.setdefault("search", {})["past_present_share_buffer"] = True
        (staging / GENAI_CONFIG).write_text(json.dumps(config, indent=4) + "\n")
        record = {
            "session_token": token,
            "kv_check": kv_check,
            "sparse_caches": sparse_caches,
            "custom_ops_library": library.name,
            "models": rewritten,
            "bridge_format": BRIDGE_FORMAT,
        }
        (staging / RECORD_FILE).write_text(json.dumps(record, indent=4) + "\n")
        _replace(target, staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for folder in created:  # deepest first; only those this call made, and only if empty
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    return target


def _past_key_names(component: dict) -> str:
    return component.get("inputs", {}).get("past_key_names", PAST_KEY_NAMES)


def _hold_caches(model: onnx.ModelProto, relative: str, past_key_names: str) -> None:
    """sparse_caches="op" for one model: its SparseAttention nodes hold their caches."""
    if not hold_sparse_caches(model, is_bridge_node):
        raise ValueError(f"sparse_caches='op': no SparseAttention node of {relative} has pasts that are graph inputs of its own")
    prefix, _, suffix = past_key_names.partition("%d")
    if not any(i.name.startswith(prefix) and i.name.endswith(suffix) for i in model.graph.input):
        raise ValueError(
            f"sparse_caches='op' would leave {relative} no cache input, and ORT GenAI needs one: "
            "keep sparse_caches='graph' for a model without other attention layers"
        )


def _missing_ancestors(folder: Path) -> list[Path]:
    """The folders mkdir(parents=True) would create for ``folder``, deepest first."""
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def _replace(target: Path, staging: Path) -> None:
    """``staging`` renamed to ``target``; an old ``target`` is moved aside first and deleted
    only once the new folder is in place, so a failure between the two loses neither."""
    if not target.exists():
        staging.rename(target)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
    aside.rmdir()
    target.rename(aside)
    try:
        staging.rename(target)
    except BaseException:
        aside.rename(target)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def load_genai_model(folder, *, ep: str = "cpu", ep_options: dict | None = None):
    """``onnxruntime_genai.Model(folder)`` after :func:`register`, for a prepared folder.

    ``ep="webgpu"`` runs the model's other nodes on ORT's WebGPU plugin EP: the plugin is
    registered with GenAI (which carries its own onnxruntime), and the decoder's providers
    become that EP with ``ep_options``. GenAI then keeps every cache it binds on the EP's
    device: in a folder prepared with ``sparse_caches="graph"``, the SparseAttention layers'
    too, which ORT then copies to the host and back around this package's op on every step
    (a warning says so; docs/genai.md measures what that costs). ``sparse_caches="op"``
    folders leave those caches to the op, in host memory.

    Checks first that the folder's library link is still the library this process loads (a
    folder copied with ``cp -r`` or moved to another filesystem holds a copy instead, which
    GenAI would load as a second library without the bridge's ops). The nodes' GPU state is
    freed when the last model loaded from a folder with this token is garbage-collected.
    Models from one folder share that state per thread: in a ``sparse_caches="graph"``
    folder, generators interleaved on one thread make each node's cache check fail and
    re-upload history (``"fast"``) or compare every row (``"exact"``), and results stay
    those of each generator's own past; in an ``"op"`` folder they share the held caches
    (one live sequence per thread, docs/genai.md).
    """
    folder = Path(folder)
    config = _read_config(folder, "folder")
    record_path = folder / RECORD_FILE
    if not record_path.is_file():
        raise FileNotFoundError(f"folder {folder}: no {RECORD_FILE}; prepare it with prepare_genai_folder first")
    record = json.loads(record_path.read_text())
    found = record.get("bridge_format", 1)  # folders prepared before it was recorded are format 1
    if found != BRIDGE_FORMAT:
        raise RuntimeError(
            f"folder {folder}: prepared by a sparse_attention_op with bridge format {found}; this version runs format "
            f"{BRIDGE_FORMAT}: prepare the folder again with prepare_genai_folder"
        )
    library = folder / record["custom_ops_library"]
    if not (library.is_file() and os.path.samefile(library, get_library_path())):
        raise RuntimeError(
            f"folder {folder}: {library.name} must be a hard link to onnxruntime-extensions' library {get_library_path()} "
            "(GenAI needs the very library this process loaded; a copy lacks the registered ops): "
            "prepare the folder again with prepare_genai_folder, on the library's filesystem"
        )
    for _, relative in _named_models(config):
        if relative in record["models"] and not (folder / relative).is_file():
            raise FileNotFoundError(f"folder {folder}: model {relative} named by {GENAI_CONFIG} is missing")
    require_ep(ep)
    try:
        import onnxruntime_genai as og
    except ImportError as error:
        raise ImportError("load_genai_model needs onnxruntime-genai: pip install 'sparse-attention-op[genai]'") from error
    register()
    if ep == "cpu":
        model = og.Model(str(folder))
    else:
        if record.get("sparse_caches", "graph") == "graph":
            warnings.warn(
                f"folder {folder}: its SparseAttention layers' caches are graph tensors, which GenAI keeps on the {ep} EP's "
                "device: each step copies them to the host and back; prepare the folder with sparse_caches='op' to keep them "
                "with the op",
                stacklevel=2,
            )
        model = og.Model(_webgpu_config(og, folder, ep_options))
    _track(model, record["session_token"])
    return model


_genai_plugin_lock = threading.Lock()
_genai_plugin_registered = False


def _webgpu_config(og, folder: Path, ep_options: dict | None):
    """GenAI's config of ``folder`` with ORT's WebGPU plugin EP as the decoder's provider."""
    global _genai_plugin_registered
    plugin = webgpu_plugin()  # the same checks and messages as a session's (no plugin, no adapter)
    with _genai_plugin_lock:
        if not _genai_plugin_registered:
            try:
                og.register_execution_provider_library(WEBGPU_EP, plugin.library)
            except RuntimeError as error:
                if "already registered" not in str(error):
                    raise ExecutionProviderError(f"ORT GenAI could not load the WebGPU plugin EP from {plugin.library}: {error}") from None
            _genai_plugin_registered = True
    config = og.Config(str(folder))
    config.clear_providers()
    config.append_provider(GENAI_WEBGPU)
    for key, value in (ep_options or {}).items():
        config.set_provider_option(GENAI_WEBGPU, str(key), str(value))
    return config


# -- the folder and its config ------------------------------------------------------------
def _read_config(folder: Path, argument: str) -> dict:
    if not folder.is_dir():
        raise NotADirectoryError(f"{argument} must be a GenAI model folder, {folder} is not a directory")
    path = folder / GENAI_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{argument} must be a GenAI model folder: no {GENAI_CONFIG} in {folder}")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{argument}: {path} is not valid JSON: {error}") from None
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise ValueError(f"{argument}: {path} has no 'model' section")
    return config


def _check_target(source: Path, target: Path, overwrite: bool) -> None:
    source_real, target_real = source.resolve(), target.resolve()
    if target_real == source_real or source_real in target_real.parents or target_real in source_real.parents:
        raise ValueError(f"target must lie outside source and not contain it, got source {source} and target {target}")
    if not target.exists():
        return
    if not overwrite:
        raise FileExistsError(f"target {target} exists; pass overwrite=True to replace it")
    if not target.is_dir() or target.is_symlink():
        raise FileExistsError(f"target {target} exists and is not a directory; overwrite replaces only a folder")
    if any(target.iterdir()) and not (target / GENAI_CONFIG).is_file():
        raise FileExistsError(f"target {target} is a non-empty folder without {GENAI_CONFIG}; overwrite replaces only a GenAI model folder")


def _named_models(config: dict) -> Iterator[tuple[dict, str]]:
    """(the config object naming it, relative path) for every ONNX model under 'model'.

    GenAI names each model by a ``filename`` next to its own ``session_options``: the
    decoder, the embedding/vision/speech parts, and every stage of a decoder pipeline.
    """
    stack = [config["model"]]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            filename = node.get("filename")
            if isinstance(filename, str) and filename.endswith(".onnx"):
                yield node, filename
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _decoder_options(config: dict) -> dict:
    decoder = config["model"].get("decoder")
    return decoder.get("session_options", {}) if isinstance(decoder, dict) else {}


def _set_library(options: dict, library_name: str, model: str) -> None:
    present = options.get("custom_ops_library")
    if present and Path(present).name != library_name:
        raise ValueError(
            f"source: the session options of {model} already name custom_ops_library {present!r}; "
            "GenAI loads one custom-op library per model, and this one must be onnxruntime-extensions'"
        )
    options["custom_ops_library"] = library_name


def _inside(folder: Path, relative: str, argument: str) -> Path:
    # The name as written must stay in the folder; a symbolic link there may point anywhere
    # (a Hugging Face snapshot's files link to its blobs), and the copy follows it.
    normal = os.path.normpath(relative)
    if os.path.isabs(relative) or normal == os.pardir or normal.startswith(os.pardir + os.sep):
        raise ValueError(f"{argument}: {GENAI_CONFIG} names {relative!r}, outside the folder")
    path = folder / relative
    if not path.is_file():
        raise FileNotFoundError(f"{argument}: {GENAI_CONFIG} names {relative!r}, which is not in {folder}")
    return path


def _copy_tree(source: Path, destination: Path, skip: set[Path]) -> None:
    """Every file below ``source`` but ``skip``, symbolic links followed (files and folders
    alike), so that the copy stands alone. A link back to a folder it lies in (a cycle) is
    not entered; two links to one folder elsewhere give two copies, as ``cp -rL`` does."""
    for folder, subfolders, files in os.walk(source, followlinks=True):
        subfolders[:] = sorted(name for name in subfolders if not _loops_back(Path(folder) / name, source))
        for name in sorted(files):
            path = Path(folder) / name
            relative = path.relative_to(source)
            if relative in skip:
                continue
            (destination / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, destination / relative)


def _loops_back(folder: Path, source: Path) -> bool:
    """Whether ``folder`` is, through links, the same folder as one it lies in below ``source``."""
    real = os.path.realpath(folder)
    ancestor = folder.parent
    while True:
        if os.path.realpath(ancestor) == real:
            return True
        if ancestor == source or ancestor == ancestor.parent:
            return False
        ancestor = ancestor.parent


# -- the models -----------------------------------------------------------------------------
def _load_structure(path: Path) -> onnx.ModelProto:
    """The model without its external weights, which stay in their files (copied as they are).

    prepare_model reads only a constant layout's values: those of a SparseAttention node
    are loaded (and so saved inline; they are small). External references keep their paths
    relative to the model, so the copied data files serve the rewritten model unchanged.
    """
    model = onnx.load(str(path), load_external_data=False)
    if bridge_format(model) is not None:
        # Its nodes carry another folder's token: prepare the original folder instead.
        raise ValueError(f"source: {path.name} is already prepared (it holds the bridge's ops); prepare the original folder")
    load_constant_layouts(model, path.parent)
    return model


def _holds(model: onnx.ModelProto, predicate) -> bool:
    return any(predicate(node) for node in all_nodes(model.graph))


# -- the library -----------------------------------------------------------------------------
def _link_library(library: Path, link: Path, target: Path) -> None:
    try:
        os.link(library, link)
    except OSError as error:
        raise OSError(
            error.errno,
            f"target {target}: cannot hard-link onnxruntime-extensions' library {library} into it ({error.strerror}). "
            "GenAI loads a custom-op library only from inside the model folder, resolving symbolic links, and it must "
            "be the very file this process loaded (a copy loads as a second library without the bridge's ops): "
            f"put target on the filesystem of {library.parent}",
        ) from None


# -- GPU state of loaded models ---------------------------------------------------------------
_live_models: dict[str, int] = {}
_live_lock = threading.Lock()


def _track(model, token: str) -> None:
    with _live_lock:
        _live_models[token] = _live_models.get(token, 0) + 1
    weakref.finalize(model, _forget, token)


def _forget(token: str) -> None:
    from sparse_attention_op.ort.session import _close_session  # frees a token's GPU state without blocking

    with _live_lock:
        _live_models[token] -= 1
        last = _live_models[token] == 0
        if last:
            del _live_models[token]
    if last:
        # GenAI's C++ model outlives the Python one while a generator runs: its sessions
        # keep their kernels (a few small objects per node). A call after this starts the
        # node's GPU state afresh (the exact check brings the history back).
        _close_session(token, kernels=False)
