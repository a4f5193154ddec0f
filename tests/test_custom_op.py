"""custom_op.py: ONNX Runtime custom ops whose kernel is Python, handed ORT's own tensors (no GPU)."""

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from sparse_attention_op.ort import custom_op
from sparse_attention_op.ort import extensions as _ortx_compat
from sparse_attention_op.ort.custom_op import FLOAT, INT64, OpDeclaration, Slot
from sparse_attention_op.ort.session import session_options


def define(name, inputs, outputs, compute, create=lambda attributes, constants: (attributes, constants), attributes=()):
    custom_op.define(OpDeclaration(name, inputs, outputs, attributes), create, compute, _ortx_compat.library())


def session(name, inputs, outputs, initializers=(), **attributes):
    """A session of one node of op ``name`` (graph inputs are the node's non-initializer inputs)."""
    constant = {tensor.name for tensor in initializers}
    node = helper.make_node(name, [n for n, _ in inputs], [n for n, _ in outputs], domain="ai.onnx.contrib", **attributes)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info(n, t, None) for n, t in inputs if n and n not in constant],
        [helper.make_tensor_value_info(n, t, None) for n, t in outputs if n],
        list(initializers),
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.contrib", 1)], ir_version=10)
    return ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])


def test_inputs_are_views_of_orts_memory_and_outputs_are_its_buffers():
    seen = {}

    def compute(kernel, context):
        x = context.input(0)
        seen["input"], seen["writeable"] = x.ctypes.data, x.flags.writeable
        y = context.output(0, x.shape)
        seen["output"] = y.ctypes.data
        y[...] = x + 1

    define("SaoTestAddOne", (Slot(FLOAT),), (Slot(FLOAT),), compute)
    sess = session("SaoTestAddOne", [("x", TensorProto.FLOAT)], [("y", TensorProto.FLOAT)])
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    y = np.zeros_like(x)
    binding = sess.io_binding()
    binding.bind_cpu_input("x", x)
    binding.bind_output("y", "cpu", 0, np.float32, y.shape, y.ctypes.data)
    sess.run_with_iobinding(binding)
    assert np.array_equal(y, x + 1)
    assert seen == {"input": x.ctypes.data, "writeable": False, "output": y.ctypes.data}, "no copy either way"
    assert np.array_equal(sess.run(None, {"x": x})[0], x + 1)  # plain run: ORT's own output buffer


def test_a_kernel_exception_is_an_ort_error_and_the_session_keeps_working():
    def compute(kernel, context):
        x = context.input(0)
        if x.size and x.reshape(-1)[0] < 0:
            raise ValueError("input 'x': must not start with a negative value")
        context.output(0, x.shape)[...] = x

    define("SaoTestRefuses", (Slot(FLOAT),), (Slot(FLOAT),), compute)
    sess = session("SaoTestRefuses", [("x", TensorProto.FLOAT)], [("y", TensorProto.FLOAT)])
    options = ort.RunOptions()
    options.log_severity_level = 4
    with pytest.raises(Exception, match="input 'x': must not start with a negative value"):
        sess.run(None, {"x": -np.ones(3, np.float32)}, options)
    assert np.array_equal(sess.run(None, {"x": np.ones(3, np.float32)})[0], np.ones(3))
    # ORT's own error inside the op (an output bound with another shape) comes back the same way.
    binding = sess.io_binding()
    binding.bind_cpu_input("x", np.ones(3, np.float32))
    binding.bind_ortvalue_output("y", ort.OrtValue.ortvalue_from_numpy(np.zeros(4, np.float32)))
    with pytest.raises(Exception, match=r"\{4\}.*\{3\}"):
        sess.run_with_iobinding(binding, options)


def test_only_the_ops_rule_errors_read_as_rule_violations():
    """An exception among the op's rule errors becomes ORT's message as it is (it names the
    input and the rule); any other keeps its type name, a ValueError too, so that an
    internal fault never reads as a broken rule."""

    class RuleError(ValueError):
        pass

    def compute(kernel, context):
        x = context.input(0)
        first = x.reshape(-1)[0]
        if first < 0:
            raise RuleError("input 'x': must not start with a negative value")
        if first == 0:
            raise ValueError("an internal fault")
        if first == 1:
            raise KeyError("missing")
        context.output(0, x.shape)[...] = x

    custom_op.define(
        OpDeclaration("SaoTestRuleErrors", (Slot(FLOAT),), (Slot(FLOAT),), ()),
        lambda attributes, constants: attributes,
        compute,
        _ortx_compat.library(),
        rule_errors=(RuleError,),
    )
    sess = session("SaoTestRuleErrors", [("x", TensorProto.FLOAT)], [("y", TensorProto.FLOAT)])
    options = ort.RunOptions()
    options.log_severity_level = 4
    messages = {}
    for first in (-1.0, 0.0, 1.0):
        with pytest.raises(Exception) as raised:
            sess.run(None, {"x": np.full(3, first, np.float32)}, options)
        messages[first] = str(raised.value)
    assert "Status Message: input 'x': must not start with a negative value" in messages[-1.0]
    assert "ValueError: an internal fault" in messages[0.0]
    assert "KeyError: 'missing'" in messages[1.0]
    assert np.array_equal(sess.run(None, {"x": np.full(3, 2.0, np.float32)})[0], np.full(3, 2.0))


def test_absent_optional_inputs_and_outputs_are_none():
    seen = []

    def compute(kernel, context):
        seen.append((context.input(0) is None, context.input(1) is None, context.input_count()))
        second = context.output(1, (2,))
        context.output(0, (1,))[...] = 1.0
        if second is not None:
            second[...] = 2.0
        seen.append(second is None)

    define("SaoTestOptional", (Slot(FLOAT, optional=True), Slot(FLOAT, optional=True)), (Slot(FLOAT), Slot(FLOAT, optional=True)), compute)
    both = session("SaoTestOptional", [("a", TensorProto.FLOAT), ("b", TensorProto.FLOAT)], [("y", TensorProto.FLOAT), ("z", TensorProto.FLOAT)])
    assert [o.tolist() for o in both.run(None, {"a": np.ones(1, np.float32), "b": np.ones(1, np.float32)})] == [[1.0], [2.0, 2.0]]
    one = session("SaoTestOptional", [("a", TensorProto.FLOAT)], [("y", TensorProto.FLOAT)])
    assert one.run(None, {"a": np.ones(1, np.float32)})[0].tolist() == [1.0]
    middle = session("SaoTestOptional", [("", TensorProto.FLOAT), ("b", TensorProto.FLOAT)], [("y", TensorProto.FLOAT)])
    middle.run(None, {"b": np.ones(1, np.float32)})
    assert seen == [(False, False, 2), False, (False, True, 1), True, (True, False, 2), True]


def test_constants_are_located_once_and_attributes_read_once_per_node():
    made, seen = [], []

    def create(attributes, constants):
        made.append((attributes, constants))
        return len(made)

    def compute(kernel, context):
        table = context.input(1)
        seen.append((kernel, table.ctypes.data, table.tolist()))
        context.output(0, context.input(0).shape)[...] = context.input(0) * table[0]

    define(
        "SaoTestConstant",
        (Slot(FLOAT), Slot(INT64)),
        (Slot(FLOAT),),
        compute,
        create,
        attributes=(("factor", float), ("label", str), ("count", int), ("absent", int)),
    )
    table = numpy_helper.from_array(np.array([3, 4], np.int64), "table")
    sess = session(
        "SaoTestConstant",
        [("x", TensorProto.FLOAT), ("table", TensorProto.INT64)],
        [("y", TensorProto.FLOAT)],
        initializers=[table],
        factor=0.5,
        label="node one",
        count=7,
    )
    assert made == [({"factor": 0.5, "label": "node one", "count": 7}, {1})]
    for _ in range(2):
        assert sess.run(None, {"x": np.ones(2, np.float32)})[0].tolist() == [3.0, 3.0]
    assert seen[0] == seen[1] and seen[0][0] == 1 and seen[0][2] == [3, 4], "the session's own constant, the same memory every run"


def test_one_definition_per_name():
    define("SaoTestOnce", (Slot(FLOAT),), (Slot(FLOAT),), lambda kernel, context: None)
    with pytest.raises(ValueError, match="SaoTestOnce is defined already"):
        define("SaoTestOnce", (Slot(FLOAT),), (Slot(FLOAT),), lambda kernel, context: None)


def test_both_ways_of_locating_a_tensor_agree_and_the_owning_ort_is_known(monkeypatch):
    # ORT 1.24 on hands a tensor's shape in one call (slot 414); the kernels use it where
    # the ORT that created them is known to have it, and the five calls of API 17 elsewhere.
    # Both must read the same pointer and shape, for every rank (a scalar, an empty tensor).
    agreed = []

    def checked(api, value, index):
        located = api._locate_reference(value, index)
        assert located == api._locate_five_calls(value, index), index
        agreed.append(located[1])
        return located

    def compute(kernel, context):
        for index in range(3):
            context.input(index)
        context.output(0, (1,))[...] = 0

    define("SaoTestLocate", (Slot(FLOAT), Slot(FLOAT), Slot(INT64)), (Slot(FLOAT),), compute)
    sess = session("SaoTestLocate", [("a", TensorProto.FLOAT), ("b", TensorProto.FLOAT), ("c", TensorProto.INT64)], [("y", TensorProto.FLOAT)])
    version = tuple(int(part) for part in ort.__version__.split(".")[:2])
    apis = list(custom_op._apis.values())
    assert apis and all(api.version == version for api in apis), "the Python module's ORT is the one that created the kernels"
    if version < (1, 24):
        pytest.skip(f"onnxruntime {ort.__version__} predates the one-call shape (API 24): only the five calls exist")
    for api in apis:
        assert api.locate == api._locate_reference
        monkeypatch.setattr(api, "locate", lambda value, index, api=api: checked(api, value, index))
    sess.run(None, {"a": np.array(2.5, np.float32), "b": np.zeros((3, 0, 2), np.float32), "c": np.arange(24, dtype=np.int64).reshape(2, 3, 4)})
    assert agreed == [(), (3, 0, 2), (2, 3, 4)]


def test_an_ort_that_cannot_be_named_gets_the_five_calls():
    # Heap memory lies in no library: its "ORT" has no version, so a table there would be
    # read only up to the slots every supported ORT has.
    import ctypes

    from sparse_attention_op.ort.versions import _parse, ort_version_at

    assert ort_version_at(ctypes.addressof(ctypes.c_int64())) is None
    assert _parse("1.32.0") == (1, 32) and _parse("1.24.0.dev20260101") == (1, 24) and _parse("unknown") is None
