"""create_session: an onnxruntime.InferenceSession whose SparseAttention nodes run on WebGPU."""

from __future__ import annotations

import uuid
import weakref

import onnxruntime as ort
from onnxruntime_extensions import get_library_path

from .bridge import call_errors, register
from .model import ModelLike, prepare_model

#: Marks SessionOptions that already carry the extensions library: registering it twice on
#: one options object makes session creation fail ("Conflicting with a registered kernel").
_REGISTERED_MARK = "sparse_attention_op.custom_ops_registered"


def _release_session_state(token: str) -> None:
    """Finaliser of a session: queue its nodes' GPU state for freeing (never blocks)."""
    from .webgpu import executor as executor_module

    executor = executor_module._executor.peek()
    if executor is not None:
        executor.release_later(token + "/")


def session_options(sess_options: ort.SessionOptions | None = None) -> ort.SessionOptions:
    """Options with the custom-op library registered once and sequential execution.

    Sequential execution keeps each node on the thread that called ``run``, which is how a
    refused call's error finds its way back to that ``run`` (see bridge.CallErrors).
    """
    options = sess_options if sess_options is not None else ort.SessionOptions()
    try:
        options.get_session_config_entry(_REGISTERED_MARK)
    except RuntimeError:  # the mark is absent: first use of these options
        options.register_custom_ops_library(get_library_path())
        options.add_session_config_entry(_REGISTERED_MARK, "1")
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return options


class SparseAttentionSession(ort.InferenceSession):
    """A genuine InferenceSession that re-raises errors refused inside SparseAttention nodes.

    Its SparseAttention nodes carry this session's own token, so its GPU state is never
    shared with another session, and is freed when the session is collected.
    """

    def __init__(self, model_bytes: bytes, sess_options, providers, token: str):
        super().__init__(model_bytes, sess_options=sess_options, providers=providers)
        self.sparse_attention_token = token
        self._finalizer = weakref.finalize(self, _release_session_state, token)

    def _checked(self, method, *args, **kwargs):
        call_errors.pop(self.sparse_attention_token)  # nothing stale from an earlier run
        try:
            result = method(*args, **kwargs)
        except Exception as failure:
            refused = call_errors.pop(self.sparse_attention_token)
            if refused is not None:
                raise refused from failure
            raise
        refused = call_errors.pop(self.sparse_attention_token)
        if refused is not None:
            raise refused
        return result

    def run(self, output_names, input_feed, run_options=None):
        return self._checked(super().run, output_names, input_feed, run_options)

    def run_with_ort_values(self, output_names, input_dict_ort_values, run_options=None):
        return self._checked(super().run_with_ort_values, output_names, input_dict_ort_values, run_options)

    def run_with_iobinding(self, iobinding, run_options=None):
        return self._checked(super().run_with_iobinding, iobinding, run_options)


def create_session(model: ModelLike, sess_options: ort.SessionOptions | None = None, providers=None) -> SparseAttentionSession:
    """Load ``model`` (path, bytes or ModelProto) into an InferenceSession with WebGPU SparseAttention.

    Every SparseAttention node runs on WebGPU through wgpu; every other node on ONNX
    Runtime's CPU kernels (or the given providers). Model-level faults raise
    :class:`~sparse_attention_op.spec.SparseAttentionError` here; call-level faults raise
    it from ``run``, and the session keeps working afterwards.
    """
    token = uuid.uuid4().hex
    prepared = prepare_model(model, session_token=token)
    register()
    return SparseAttentionSession(
        prepared.SerializeToString(),
        session_options(sess_options),
        providers or ["CPUExecutionProvider"],
        token,
    )
