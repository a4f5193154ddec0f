"""create_session / prepare_model / register: the op inside real ONNX Runtime sessions."""

import gc
import threading

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import assert_close, assert_matches_reference, graph_feeds, node_kernels, run_in_threads, run_ort_cpu
from onnxruntime_extensions import get_library_path

import sparse_attention_op as sao
from sparse_attention_op.cli.demo import build_demo_model, reference_step
from sparse_attention_op.ort.bridge import BRIDGE_DOMAIN, BRIDGE_FORMAT, NODE_KEY_ATTRIBUTE, OP_TYPES, SETTINGS_ATTRIBUTE
from sparse_attention_op.ort.model import node_attributes
from sparse_attention_op.settings import SessionSettings
from sparse_attention_op.testing.graphs import sparse_attention_model
from sparse_attention_op.testing.inputs import CaseConfig, random_inputs
from sparse_attention_op.webgpu import get_executor

LAYOUT = ("block_row_indices", "block_col_indices")


def model_and_inputs(config, rng, constants=LAYOUT):
    inputs = random_inputs(config, rng)
    return sparse_attention_model(config.node_attributes(), inputs, constants=constants), inputs


# -- prepare_model (no GPU) ----------------------------------------------------------------
def bridge_nodes(model):
    return [n for n in model.graph.node if n.domain == BRIDGE_DOMAIN and n.op_type in OP_TYPES.values()]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_prepare_model_replaces_the_node_by_the_bridge_op(rng, dtype):
    config = CaseConfig(packed=True)
    inputs = {k: (v.astype(dtype) if v.dtype == np.float32 else v) for k, v in random_inputs(config, rng).items()}
    model = sparse_attention_model(config.node_attributes(), inputs, constants=LAYOUT, float_dtype=dtype)
    node = model.graph.node[0]
    del node.attribute[:]
    node.attribute.extend([onnx.helper.make_attribute(k, v) for k, v in dict(num_heads=4, kv_num_heads=2, sparse_block_size=8).items()])
    prepared = sao.prepare_model(model, kv_check="fast")
    (kernel,) = bridge_nodes(prepared)
    assert [n.op_type for n in prepared.graph.node] == [OP_TYPES[np.dtype(dtype)]], "one node, nothing around it"
    attrs = node_attributes(kernel)
    assert attrs["scale"] == 0.0 and attrs["do_rotary"] == 0 and attrs["rotary_interleaved"] == 0
    assert SessionSettings.from_attribute(attrs[SETTINGS_ATTRIBUTE].decode()) == SessionSettings(kv_check="fast")
    assert attrs[NODE_KEY_ATTRIBUTE].decode().endswith(":sparse_attention")
    # The node's inputs and outputs, and the graph's interface, are unchanged.
    assert list(kernel.input) == list(node.input) and list(kernel.output) == list(node.output)
    assert [i.name for i in prepared.graph.input] == [i.name for i in model.graph.input]
    assert [o.name for o in prepared.graph.output] == [o.name for o in model.graph.output]
    # a fresh identity on each preparation, the original model untouched
    again = sao.prepare_model(model)
    assert node_attributes(bridge_nodes(again)[0])[NODE_KEY_ATTRIBUTE] != attrs[NODE_KEY_ATTRIBUTE]
    assert model.graph.node[0].op_type == "SparseAttention" and len(model.graph.node[0].input) == 9


def test_a_prepared_model_is_refused(rng):
    """Its nodes belong to another session or folder; one of another bridge format says so."""
    prepared = sao.prepare_model(model_and_inputs(CaseConfig(), rng)[0])
    assert {e.key: e.value for e in prepared.metadata_props}["sparse_attention_op.bridge_format"] == str(BRIDGE_FORMAT)
    for attempt in (sao.prepare_model, sao.create_session):
        with pytest.raises(sao.SparseAttentionError, match="the model is prepared already .* pass the original model"):
            attempt(prepared)
    del prepared.metadata_props[:]  # as models were prepared before the format was recorded
    with pytest.raises(sao.SparseAttentionError, match=f"bridge format 1; this version runs format {BRIDGE_FORMAT}: prepare the original model"):
        sao.create_session(prepared)
    # Format 2: PyOps of the package's own domain around native nodes.
    older = onnx.helper.make_model(
        onnx.helper.make_graph(
            [onnx.helper.make_node("SparseAttentionPlan", ["x"], ["y"], domain="ai.sparse_attention_op")],
            "g",
            [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.INT64, [1])],
            [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.INT64, [1])],
        )
    )
    older.metadata_props.add(key="sparse_attention_op.bridge_format", value="2")
    with pytest.raises(sao.SparseAttentionError, match=f"bridge format 2; this version runs format {BRIDGE_FORMAT}"):
        sao.prepare_model(older)


@pytest.mark.gpu
def test_constant_inputs_are_located_once_per_node(executor, rng):
    """Inputs that are initializers are located when the session makes the node's kernel
    (the session owns them: they neither move nor change); graph inputs on every call."""
    config = CaseConfig(seq_len=3, do_rotary=True)
    for constants, expected in ((LAYOUT + ("cos_cache", "sin_cache"), [5, 6, 9, 10]), ((), [])):
        model, inputs = model_and_inputs(config, rng, constants=constants)
        session = sao.create_session(model)
        ((kernel, located),) = [entry for entry in node_kernels() if entry[0].token == session.sparse_attention_token]
        assert sorted(located) == expected and kernel.constant_layout == bool(expected)
        for index in expected:
            name = ("block_row_indices", "block_col_indices", "cos_cache", "sin_cache")[expected.index(index)]
            assert np.array_equal(located[index], inputs[name]) and not located[index].flags.writeable
        assert_matches_reference(session.run(None, graph_feeds(session, inputs)), inputs, config.node_attributes())


def test_prepare_model_refuses_a_bad_constant_layout(rng):
    model, _ = model_and_inputs(CaseConfig(), rng)
    rows = next(i for i in model.graph.initializer if i.name == "block_row_indices")
    array = onnx.numpy_helper.to_array(rows).copy()
    array[0, 0] = 1
    rows.CopyFrom(onnx.numpy_helper.from_array(array, "block_row_indices"))
    with pytest.raises(sao.SparseAttentionError, match="block_row_indices.*start at offset 0"):
        sao.prepare_model(model)


def test_prepare_model_leaves_other_nodes_alone():
    model = build_demo_model()
    prepared = sao.prepare_model(model)
    others = [n for n in model.graph.node if n.op_type != "SparseAttention"]
    assert others and all(node in prepared.graph.node for node in others)


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(num_heads=6, kv_num_heads=4), "num_heads"),
        (dict(sparse_block_size=12), "sparse_block_size"),
        (dict(do_rotary=1), "cos_cache"),
        (dict(kv_num_heads=0), "kv_num_heads"),
    ],
)
def test_prepare_model_refuses_model_level_faults(rng, change, message):
    model, _ = model_and_inputs(CaseConfig(), rng)
    node = model.graph.node[0]
    for name, value in change.items():
        for attribute in node.attribute:
            if attribute.name == name:
                node.attribute.remove(attribute)
                break
        node.attribute.append(onnx.helper.make_attribute(name, value))
    with pytest.raises(sao.SparseAttentionError, match=message):
        sao.create_session(model)


def test_key_without_value_is_refused(rng):
    model, _ = model_and_inputs(CaseConfig(), rng)
    model.graph.node[0].input[2] = ""
    with pytest.raises(sao.SparseAttentionError, match="'key' and 'value'"):
        sao.prepare_model(model)


def test_register_is_idempotent():
    from sparse_attention_op.ort import custom_op

    sao.register()
    registered = dict(custom_op._defined)
    sao.register()  # a second definition of an op would raise
    assert custom_op._defined == registered and set(registered) >= set(OP_TYPES.values())


# -- sessions (GPU) -------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("source", ["proto", "bytes", "path"])
def test_create_session_runs_on_webgpu(executor, rng, tmp_path, source):
    config = CaseConfig(seq_len=7)
    model, inputs = model_and_inputs(config, rng)
    arg = {"proto": model, "bytes": model.SerializeToString(), "path": tmp_path / "m.onnx"}[source]
    if source == "path":
        onnx.save(model, str(arg))
    session = sao.create_session(arg)
    assert isinstance(session, ort.InferenceSession)
    outputs = session.run(None, graph_feeds(session, inputs))
    assert_matches_reference(outputs, inputs, config.node_attributes())


@pytest.mark.gpu
def test_profile_times_each_dispatch_or_the_calls_one_pass(executor, rng):
    """profile=True / "dispatches": one GPU time per dispatch; "pass": the call's one pass."""
    if "timestamp-query" not in executor.context.features:
        pytest.skip("the adapter has no timestamp queries")
    config = CaseConfig(seq_len=7)
    model, inputs = model_and_inputs(config, rng)
    for profile in (True, "dispatches", "pass"):
        session = sao.create_session(model, profile=profile)
        outputs = session.run(None, graph_feeds(session, inputs))
        assert_matches_reference(outputs, inputs, config.node_attributes(), what=f"profile={profile!r}")
        (stats,) = session.last_stats().values()
        assert all(seconds > 0 for seconds in stats.gpu_seconds.values()), profile
        if profile == "pass":
            assert list(stats.gpu_seconds) == ["pass"]
        else:
            assert stats.gpu_seconds and "pass" not in stats.gpu_seconds


def test_an_unknown_profile_choice_is_refused(rng):
    model, _ = model_and_inputs(CaseConfig(seq_len=3), rng)
    with pytest.raises(ValueError, match=r"profile must be True, False or one of \('off', 'dispatches', 'pass'\), got 'sometimes'"):
        sao.create_session(model, profile="sometimes")
    with pytest.raises(ValueError, match="got 1"):  # an int is not a bool: no silent "dispatches"
        sao.create_session(model, profile=1)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "config",
    [
        CaseConfig(seq_len=12, num_heads=8, kv_num_heads=2, num_layout=4, head_size=32),
        CaseConfig(seq_len=1, past_lengths=(30,), head_size=64, max_cache_len=40),
        CaseConfig(seq_len=5, past_lengths=(11,), packed=True, do_rotary=True, head_size=32),
        CaseConfig(batch=2, seq_len=1, past_lengths=(25, 25), do_rotary=True, rotary_interleaved=True, head_size=32, rotary_dim=16),
    ],
    ids=["prompt-gqa", "decode", "chunked-packed-rotary", "batch-decode-interleaved-partial"],
)
def test_session_matches_ort_cpu_kernel(executor, rng, config):
    model, inputs = model_and_inputs(config, rng, constants=())
    expected = run_ort_cpu(model, inputs)
    session = sao.create_session(model)
    outputs = session.run(None, graph_feeds(session, inputs))
    assert_close(outputs[0], expected[0], "output vs ORT CPU")
    live = int(inputs["key_total_sequence_lengths"].max())
    for index, name in ((1, "present_key"), (2, "present_value")):
        assert_close(outputs[index][:, :, :live], expected[index][:, :, :live], f"{name} vs ORT CPU")


@pytest.mark.gpu
def test_demo_graph_with_other_nodes(executor):
    model = build_demo_model()
    session = sao.create_session(model)
    rng = np.random.default_rng(3)
    feeds = {
        "hidden_states": rng.standard_normal((1, 20, 256), dtype=np.float32),
        "past_key": np.zeros((1, 2, 256, 32), np.float32),
        "past_value": np.zeros((1, 2, 256, 32), np.float32),
        "total_sequence_length": np.array([20], np.int32),
        "key_total_sequence_lengths": np.array([20], np.int32),
    }
    outputs = session.run(None, feeds)
    for got, want, name in zip(outputs, reference_step(model, feeds), ("output", "present_key", "present_value")):
        assert_close(got[..., :20, :] if name != "output" else got, want[..., :20, :] if name != "output" else want, name)


def decode_session(rng):
    """A one-node decode session, its config, inputs and feeds."""
    config = CaseConfig(seq_len=1, past_lengths=(10,))
    model, inputs = model_and_inputs(config, rng)
    session = sao.create_session(model)
    return config, session, inputs, graph_feeds(session, inputs)


@pytest.mark.gpu
def test_bad_call_raises_naming_the_input_and_session_recovers(executor, rng, capfd):
    config, session, inputs, feeds = decode_session(rng)
    bad = dict(feeds, key_total_sequence_lengths=np.array([99], np.int32))
    capfd.readouterr()
    with pytest.raises(sao.SparseAttentionInputError, match="key_total_sequence_lengths"):
        session.run(None, bad)
    # The exception says it all: ORT's log line about the node that stopped after the
    # refusal (written by its C++ code to the process's stderr) stays quiet.
    assert "onnxruntime" not in capfd.readouterr().err
    outputs = session.run(None, feeds)
    assert_matches_reference(outputs, inputs, config.node_attributes())


@pytest.mark.gpu
def test_a_refused_calls_exception_keeps_no_view_of_orts_tensors(executor, rng):
    """The session raises the op's exception after the run, when ORT has freed the run's
    tensors: no frame of its traceback may still hold views of them (a debugger or a
    traceback printer would read freed memory)."""
    config, session, inputs, feeds = decode_session(rng)
    with pytest.raises(sao.SparseAttentionInputError) as raised:
        session.run(None, dict(feeds, key_total_sequence_lengths=np.array([99], np.int32)))
    frames, tb = [], raised.value.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    assert any(frame.f_code.co_name == "_compute" for frame in frames), "the op's frame is in the traceback"
    for frame in frames:
        if frame.f_code.co_name != "_compute":
            continue
        assert not {name: value for name, value in frame.f_locals.items() if isinstance(value, (np.ndarray, list))}


@pytest.mark.gpu
def test_a_session_left_to_the_interpreters_exit(executor, tmp_path):
    """A session that lives until the interpreter exits (held in a reference cycle) is
    destroyed after Python's modules: ORT then reads the op's struct, which must still be
    there (it once was freed memory: a crash under PYTHONMALLOC=debug)."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import numpy as np, sparse_attention_op as sao
        from sparse_attention_op.testing.graphs import sparse_attention_model
        from sparse_attention_op.testing.inputs import CaseConfig, random_inputs
        config = CaseConfig()
        inputs = random_inputs(config, np.random.default_rng(0))
        model = sparse_attention_model(config.node_attributes(), inputs, constants=("block_row_indices", "block_col_indices"))
        class Holder:
            def __init__(self):
                self.session = sao.create_session(model)
                self.me = self
        holder = Holder()
        print(holder.session.run(None, {i.name: inputs[i.name] for i in holder.session.get_inputs()})[0].shape)
    """)
    import os

    env = dict(os.environ, PYTHONMALLOC="debug", XDG_RUNTIME_DIR=os.environ.get("XDG_RUNTIME_DIR", "/tmp"))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, f"exit status {done.returncode}\n{done.stdout}\n{done.stderr}"


@pytest.mark.gpu
def test_two_sessions_of_one_model_do_not_share_state(executor, rng):
    config = CaseConfig(seq_len=1, past_lengths=(12,))
    model, first = model_and_inputs(config, rng)
    second = random_inputs(config, rng)
    a, b = sao.create_session(model), sao.create_session(model)
    assert a.sparse_attention_token != b.sparse_attention_token
    for _ in range(2):
        out_a = a.run(None, graph_feeds(a, first))
        out_b = b.run(None, graph_feeds(b, second))
        assert_matches_reference(out_a, first, config.node_attributes(), "session a")
        assert_matches_reference(out_b, second, config.node_attributes(), "session b")


@pytest.mark.gpu
def test_one_session_from_several_threads(executor, rng):
    config = CaseConfig(batch=2, seq_len=3, past_lengths=(7, 20))
    model, _ = model_and_inputs(config, rng)
    session = sao.create_session(model)
    cases = [random_inputs(config, np.random.default_rng(seed)) for seed in range(4)]
    failures = []

    def worker(inputs):
        try:
            for _ in range(3):
                outputs = session.run(None, graph_feeds(session, inputs))
                assert_matches_reference(outputs, inputs, config.node_attributes())
        except Exception as error:  # collected: pytest does not see thread exceptions
            failures.append(error)

    run_in_threads([lambda inputs=inputs: worker(inputs) for inputs in cases])
    assert not failures, failures[0]


@pytest.mark.gpu
def test_thread_errors_stay_with_their_thread(executor, rng):
    config, session, inputs, feeds = decode_session(rng)
    bad = dict(feeds, total_sequence_length=np.array([500], np.int32))
    results = {}

    def good_worker():
        try:
            for _ in range(5):
                assert_matches_reference(session.run(None, feeds), inputs, config.node_attributes())
            results["good"] = "ok"
        except Exception as error:
            results["good"] = error

    def bad_worker():
        errors = 0
        for _ in range(5):
            try:
                session.run(None, bad)
            except sao.SparseAttentionInputError:
                errors += 1
        results["bad"] = errors

    run_in_threads([good_worker, bad_worker])
    assert results == {"good": "ok", "bad": 5}


def session_that_ran(rng):
    """A session that has run once (so its node holds GPU state), and its token."""
    model, inputs = model_and_inputs(CaseConfig(seq_len=2), rng)
    session = sao.create_session(model)
    session.run(None, graph_feeds(session, inputs))
    return session, session.sparse_attention_token


@pytest.mark.gpu
def test_session_state_is_freed_with_the_session(executor, rng):
    session, token = session_that_ran(rng)
    assert any(key.startswith(token) for key in get_executor().node_keys())
    del session
    gc.collect()
    assert not any(key.startswith(token) for key in get_executor().node_keys())


@pytest.mark.gpu
def test_finaliser_never_blocks_on_a_call_in_flight(executor, rng):
    # The garbage collector may finalise a session while another call holds the executor's
    # lock (seen as a deadlock once): the finaliser must only queue the release.
    from sparse_attention_op.ort.session import _close_session

    session, token = session_that_ran(rng)
    done = threading.Event()
    with executor._lock:  # a call in flight
        finaliser = threading.Thread(target=lambda: (_close_session(token), done.set()), daemon=True)
        finaliser.start()
        assert done.wait(timeout=10), "the finaliser blocked on the executor lock"
    assert not any(key.startswith(token) for key in executor.node_keys())


@pytest.mark.gpu
def test_other_pyops_keep_working_beside_the_bridge_op(executor, rng):
    from onnxruntime_extensions import PyCustomOpDef, onnx_op

    @onnx_op(op_type="SaoTestNegate", inputs=[PyCustomOpDef.dt_float], outputs=[PyCustomOpDef.dt_float])
    def negate(x):
        return -x

    sao.register()
    node = onnx.helper.make_node("SaoTestNegate", ["x"], ["y"], domain="ai.onnx.contrib")
    graph = onnx.helper.make_graph(
        [node],
        "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [3])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [3])],
    )
    model = onnx.helper.make_model(
        graph, opset_imports=[onnx.helper.make_opsetid("", 17), onnx.helper.make_opsetid("ai.onnx.contrib", 1)], ir_version=10
    )
    options = ort.SessionOptions()
    options.register_custom_ops_library(get_library_path())
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    x = np.array([1.0, -2.0, 3.5], np.float32)
    assert np.array_equal(session.run(None, {"x": x})[0], -x)


@pytest.mark.gpu
def test_user_session_options_are_kept_and_reusable(executor, rng):
    config = CaseConfig(seq_len=3)
    model, inputs = model_and_inputs(config, rng)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    first = sao.create_session(model, sess_options=options)
    second = sao.create_session(model, sess_options=options)  # registering twice would fail
    assert options.intra_op_num_threads == 1
    for session in (first, second):
        assert_matches_reference(session.run(None, graph_feeds(session, inputs)), inputs, config.node_attributes())


def test_options_that_register_the_extensions_library_already_are_named(rng):
    model, _ = model_and_inputs(CaseConfig(seq_len=3), rng)
    options = ort.SessionOptions()
    options.register_custom_ops_library(get_library_path())
    with pytest.raises(sao.SparseAttentionError, match="already register onnxruntime-extensions' library .* pass options without it"):
        sao.create_session(model, sess_options=options)
    with pytest.raises(TypeError, match="sess_options must be an onnxruntime.SessionOptions or None, got dict"):
        sao.create_session(model, sess_options={})


def test_parallel_execution_is_refused_at_session_creation(rng):
    """Refused before the session exists (no GPU work), and the options are left as they were."""
    model, _ = model_and_inputs(CaseConfig(seq_len=3), rng)
    options = ort.SessionOptions()
    options.execution_mode = ort.ExecutionMode.ORT_PARALLEL
    for attempt in (lambda: sao.create_session(model, sess_options=options), lambda: sao.session_options(options)):
        with pytest.raises(sao.SparseAttentionError, match="execution_mode is ORT_PARALLEL.*only ORT_SEQUENTIAL"):
            attempt()
    assert options.execution_mode == ort.ExecutionMode.ORT_PARALLEL
    with pytest.raises(RuntimeError):  # nothing was registered on them either
        options.get_session_config_entry("sparse_attention_op.custom_ops_registered")


def test_a_closed_session_leaves_no_kernels(executor, rng):
    """The bridge's kernel objects of a session's nodes go with the session."""
    config = CaseConfig(seq_len=3, max_cache_len=16)
    model, inputs = model_and_inputs(config, rng)
    session = sao.create_session(model)
    session.run(None, graph_feeds(session, inputs))
    token = session.sparse_attention_token
    assert any(kernel.token == token for kernel, _ in node_kernels())
    del session
    gc.collect()
    assert not any(kernel.token == token for kernel, _ in node_kernels())


def test_models_prepared_under_one_token_keep_their_nodes_apart(rng):
    from sparse_attention_op.ort.bridge import NODE_KEY_ATTRIBUTE

    model = onnx.load("models/phi3-small-tiny/model.onnx")
    keys = []
    for scope in ("decoder.onnx#", "vision.onnx#"):
        prepared = sao.prepare_model(model, session_token="folder", scope=scope)
        keys.append({node_attributes(n)[NODE_KEY_ATTRIBUTE].decode() for n in bridge_nodes(prepared)})
    assert all(key.startswith("folder/") for key in keys[0] | keys[1])  # one token: freed together
    assert len(keys[0]) == 2 and not keys[0] & keys[1]
