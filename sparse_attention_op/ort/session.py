"""create_session: an onnxruntime.InferenceSession whose SparseAttention nodes run on WebGPU."""

from __future__ import annotations

import os
import threading
import uuid
import weakref

import onnxruntime as ort
from onnxruntime_extensions import get_library_path

from sparse_attention_op.op.spec import SparseAttentionError
from sparse_attention_op.ort.bridge import forget_session, records, register
from sparse_attention_op.ort.graph import ModelLike
from sparse_attention_op.ort.last_logits import trim_logits
from sparse_attention_op.ort.model import load_for_session, prepare_model
from sparse_attention_op.ort.providers import add_ep, require_ep, webgpu_plugin
from sparse_attention_op.settings import SessionSettings

#: Marks SessionOptions that already carry the extensions library: registering it twice on
#: one options object makes session creation fail ("Conflicting with a registered kernel").
_REGISTERED_MARK = "sparse_attention_op.custom_ops_registered"
#: Where ORT looks for the external weights of a model given as bytes, and the mark of a folder
#: this module set there (options reused for another model must not keep it).
_EXTERNAL_FOLDER = "session.model_external_initializers_file_folder_path"
_EXTERNAL_FOLDER_MARK = "sparse_attention_op.external_folder"


def _close_session(token: str, kernels: bool = True) -> None:
    """Finaliser of a session: forget its records (and its nodes' kernels unless told not
    to: bridge.forget_session), queue its nodes' GPU state for freeing (never blocks)."""
    from sparse_attention_op.webgpu import executor as executor_module

    try:
        forget_session(token, kernels)
    finally:  # whatever happens above, the GPU state is freed
        executor = executor_module._executor.peek()
        if executor is not None:
            executor.release_later(token + "/")


def session_options(sess_options: ort.SessionOptions | None = None) -> ort.SessionOptions:
    """``sess_options`` (or new options) with the custom-op library registered once.

    Options that ask for ``ORT_PARALLEL`` execution are refused, before anything is
    registered on them: a node must run on the thread that called ``run`` (its GPU state
    is per thread, and a refused call's error finds its way back to that ``run``). Nothing
    else about the options changes. The bridge's ops are added to onnxruntime-extensions'
    library first: the library adds the ops it holds when it is registered on the options.
    """
    options = sess_options if sess_options is not None else ort.SessionOptions()
    if not isinstance(options, ort.SessionOptions):
        raise TypeError(f"sess_options must be an onnxruntime.SessionOptions or None, got {type(options).__name__}")
    if options.execution_mode != ort.ExecutionMode.ORT_SEQUENTIAL:
        raise SparseAttentionError(
            f"sess_options.execution_mode is {options.execution_mode.name}: SparseAttention's nodes must run "
            "on the thread that calls run, so only ORT_SEQUENTIAL (ONNX Runtime's default) is supported"
        )
    register()
    try:
        options.get_session_config_entry(_REGISTERED_MARK)
    except RuntimeError:  # the mark is absent: first use of these options
        options.register_custom_ops_library(get_library_path())
        options.add_session_config_entry(_REGISTERED_MARK, "1")
    return options


def _quiet_run_options() -> ort.RunOptions:
    """Run options whose log shows only fatal messages. When a call is refused, ORT logs the
    node's error in colour on stderr, and then raises it; the session raises the node's own
    exception, which names the input and the rule it broke."""
    options = ort.RunOptions()
    options.log_severity_level = 4
    # onnxruntime's Python run methods (1.32) look this entry up on every run with options,
    # and an absent entry costs a C++ exception turned into a Python one: 30 us a run on the
    # 2-core CPU machine, about a third of a decode step's ORT and bridge time. "0" is the value
    # they take when it is absent.
    options.add_run_config_entry("gpu_graph_id", "0")
    return options


#: The run options of calls that pass none (read-only after this, so shared by every thread).
_QUIET_RUN = _quiet_run_options()


class SparseAttentionSession(ort.InferenceSession):
    """A genuine InferenceSession that raises the errors refused inside SparseAttention nodes.

    Its nodes carry this session's own token, so its GPU state is never shared with another
    session, and is freed when the session is collected. Settings (``kv_check``,
    ``profile``, ``f16_cache``) belong to the session.
    """

    def __init__(self, model_bytes: bytes, sess_options, providers, token: str, settings: SessionSettings, ep: str):
        records.open(token)
        self.sparse_attention_token = token
        self.settings = settings
        #: Where the graph's other nodes run: "cpu" or "webgpu" (ORT's WebGPU plugin EP).
        self.ep = ep
        self._finalizer = weakref.finalize(self, _close_session, token)
        self._local = threading.local()
        super().__init__(model_bytes, sess_options=sess_options, providers=providers)

    @property
    def kv_check(self) -> str:
        return self.settings.kv_check

    def last_stats(self) -> dict:
        """Per SparseAttention node, what its call did in this thread's last run:
        :class:`~sparse_attention_op.webgpu.executor.CallStats` (GPU times only with
        ``profile=True``). Keys are ``"<index>:<node name>"``, the index counting the model's
        SparseAttention nodes from 0 (names may repeat or be empty), e.g. ``"0:sparse_attention"``."""
        return getattr(self._local, "stats", {})

    def _checked(self, method, *args):
        """``method(*args)`` with the errors refused inside nodes raised as they were refused."""
        token = self.sparse_attention_token
        records.pop_error(token)  # nothing stale from an earlier run
        records.pop_stats(token)
        try:
            result = method(*args)
        except Exception as failure:
            refused = records.pop_error(token)
            if refused is not None:
                raise refused from failure
            raise
        finally:
            self._local.stats = records.pop_stats(token)
        return result

    def run(self, output_names, input_feed, run_options=None):
        return self._checked(super().run, output_names, input_feed, run_options or _QUIET_RUN)

    def run_with_ort_values(self, output_names, input_dict_ort_values, run_options=None):
        return self._checked(super().run_with_ort_values, output_names, input_dict_ort_values, run_options or _QUIET_RUN)

    def run_with_iobinding(self, iobinding, run_options=None):
        return self._checked(super().run_with_iobinding, iobinding, run_options or _QUIET_RUN)


def _point_at_weights(options: ort.SessionOptions, folder) -> None:
    """Tell ORT where the external weights of the model handed over as bytes lie: a path's
    folder, or, for a model given as bytes or a ModelProto, ORT's own default (the working
    directory) again where these options still name a folder an earlier call of ours set."""
    ours = _config_entry(options, _EXTERNAL_FOLDER_MARK)
    wanted = str(folder) if folder is not None else (os.getcwd() if ours is not None else None)
    if wanted is not None and _config_entry(options, _EXTERNAL_FOLDER) != wanted:
        options.add_session_config_entry(_EXTERNAL_FOLDER, wanted)
        options.add_session_config_entry(_EXTERNAL_FOLDER_MARK, wanted)


def _config_entry(options: ort.SessionOptions, key: str) -> str | None:
    try:
        return options.get_session_config_entry(key)
    except RuntimeError:  # absent
        return None


def create_session(
    model: ModelLike,
    sess_options: ort.SessionOptions | None = None,
    providers=None,
    *,
    kv_check: str = "exact",
    profile: bool | str = False,
    f16_cache: bool = True,
    ep: str = "cpu",
    ep_options: dict | None = None,
    last_logits: bool = False,
) -> SparseAttentionSession:
    """Load ``model`` (path, bytes or ModelProto) into an InferenceSession with WebGPU SparseAttention.

    Every SparseAttention node runs on WebGPU through wgpu; every other node on ONNX
    Runtime's CPU kernels (or the given providers), or with ``ep="webgpu"`` on ORT's WebGPU
    plugin EP (``ep_options``: its provider options, e.g. ``{"validationMode": "disabled"}``;
    see providers.py). A model path's external weights are read where they lie. Each node keeps its KV cache on the GPU
    between calls and checks the past it is fed against what it holds:

    * ``kv_check="exact"`` (default): every history row is compared through per-chunk
      64-bit digests; only rows that differ are uploaded. Results are those of the past you
      feed, whatever it is. Cost follows the history, not the cache's capacity: the rows are
      read where ONNX Runtime holds the past, never copied.
    * ``kv_check="fast"``: the lengths and a few probe rows (each sequence's last rows and a
      few rows spread over its history) are compared with the GPU's cache, on the GPU; when
      they disagree the call runs again after the exact check. Cost per step depends on
      neither history nor capacity. It cannot see a change confined to rows it did not
      probe, such as an edit to one row in the middle of a history.

    ``profile=True`` (or ``"dispatches"``) times every dispatch with GPU timestamps, each in
    a timed pass of its own; ``profile="pass"`` times a call's dispatches as the one pass an
    untimed call records (``{"pass": seconds}``): each timed pass carries a few microseconds
    of its own, which per-dispatch times count once per dispatch (see
    :meth:`SparseAttentionSession.last_stats`).
    ``f16_cache`` keeps float16 models' GPU caches in f16 where the adapter allows (lossless).
    ``last_logits=True`` computes a decoder's ``logits`` only at the positions an added input
    lists (ort/last_logits.py): what :func:`generate` reads, without a prompt's whole logits
    (1.6 GB for 8k tokens of Phi-3-small) to compute and copy.
    Model-level faults raise :class:`~sparse_attention_op.op.spec.SparseAttentionError` here;
    call-level faults raise it from ``run``, and the session keeps working afterwards.
    """
    settings = SessionSettings.of(kv_check=kv_check, profile=profile, f16_cache=f16_cache)
    require_ep(ep)
    if ep != "cpu" and providers:
        raise ValueError(f"pass either providers or ep={ep!r}, not both")
    if ep == "webgpu":
        webgpu_plugin()  # its failures before anything touches the caller's options
    source, external_folder = load_for_session(model)
    token = uuid.uuid4().hex
    prepared = prepare_model(source, session_token=token, kv_check=settings.kv_check, profile=settings.profile, f16_cache=settings.f16_cache)
    if last_logits:
        trim_logits(prepared)
    options = session_options(sess_options)
    add_ep(options, ep, ep_options)
    _point_at_weights(options, external_folder)
    register()
    try:
        return SparseAttentionSession(
            prepared.SerializeToString(),
            options,
            None if ep != "cpu" else providers or ["CPUExecutionProvider"],
            token,
            settings,
            ep,
        )
    except Exception as error:
        if "Conflicting with a registered kernel" not in str(error):
            raise
        # The library registered on these options by the caller: ORT names only an op of it.
        raise SparseAttentionError(
            "sess_options already register onnxruntime-extensions' library (register_custom_ops_library), and "
            "create_session registers it too: pass options without it"
        ) from error
