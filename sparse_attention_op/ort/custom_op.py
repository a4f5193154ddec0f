"""ONNX Runtime custom ops whose kernel is a Python function, with no tensor copied.

ONNX Runtime's C ABI for custom ops (``OrtCustomOp``, ``onnxruntime_c_api.h``) is a struct of
function pointers; here those functions are ctypes callbacks. onnxruntime-extensions adds
such a struct to the ops its library registers (its exported ``AddExternalCustomOp``), so a
session, or ORT GenAI, that registers that library (``register_custom_ops_library``) runs the
op, under the library's ``ai.onnx.contrib`` domain. The kernel is handed ORT's own tensors:
an input is a numpy view of the memory ORT holds it in, an output is ORT's buffer for it,
asked for with the shape the kernel decides, so no tensor is copied to cross into Python
(docs/design.md section 2). Nothing a kernel raises escapes into ORT: it becomes an
ordinary ORT error status, whose message is the exception's text, after its type name
unless it is one of the op's rule errors (an input that breaks the operator's contract).

What ORT calls, and when:

* ``CreateKernelV2``, once per node when a session is created: the op's ``create`` function
  turns the node's attributes into a kernel object (its exception fails the session), and
  the inputs that are constants of the model are located once for all its calls.
* ``KernelComputeV2``, per run: ``compute(kernel, context)``, where the
  :class:`KernelContext` reads inputs and allocates outputs. A kernel calls the function
  table (``OrtApi``) of the ORT that created it: a process can hold two copies of ORT (the
  Python module's own, and the shared library ORT GenAI loads), each with its own table.
* ``KernelDestroy`` with the session: libc's ``free`` of the handle, a native function, so no
  Python runs when ORT tears a session down (possibly while the interpreter exits). The
  struct ORT reads it from is in memory of its own that is never freed, and the callbacks
  it points to are never collected: a session left to the interpreter's exit is destroyed
  after Python's modules are.

The ABI facts used (slot numbers of ``OrtApi``, the ``OrtCustomOp`` layout of API version
17) are append-only in ORT's header: every later release keeps them. docs/design.md
section 2 records how they were checked.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from sparse_attention_op.ort.versions import ort_version_at

#: ``OrtCustomOp.version`` this module fills in: the struct as of ORT API 17 (onnxruntime
#: 1.17), the first with every member below. ORT refuses a version above its own.
OP_VERSION = 17

#: ONNXTensorElementDataType values, and the numpy type of each.
FLOAT, INT32, INT64, FLOAT16 = 1, 6, 7, 10
NUMPY_TYPES = {FLOAT: np.dtype(np.float32), INT32: np.dtype(np.int32), INT64: np.dtype(np.int64), FLOAT16: np.dtype(np.float16)}
_ORT_FAIL = 1  # OrtErrorCode
_REQUIRED, _OPTIONAL = 0, 1  # OrtCustomOpInputOutputCharacteristic
_MAX_RANK = 16

_P = ctypes.c_void_p
_SIZE = ctypes.c_size_t


class _Api:
    """The ``OrtApi`` functions the kernels call, by their slot in ORT's function table.

    PYFUNCTYPE: each call keeps the GIL (they are short, and a decode step makes dozens;
    releasing and taking the GIL around each would cost more than the call)."""

    _SLOTS = {  # slot: (name, result, argument types); slots from onnxruntime_c_api.h
        0: ("CreateStatus", _P, (ctypes.c_int, ctypes.c_char_p)),
        51: ("GetTensorMutableData", _P, (_P, _P)),
        61: ("GetDimensionsCount", _P, (_P, _P)),
        62: ("GetDimensions", _P, (_P, _P, _SIZE)),
        65: ("GetTensorTypeAndShape", _P, (_P, _P)),
        85: ("KernelInfoGetAttribute_float", _P, (_P, ctypes.c_char_p, _P)),
        86: ("KernelInfoGetAttribute_int64", _P, (_P, ctypes.c_char_p, _P)),
        87: ("KernelInfoGetAttribute_string", _P, (_P, ctypes.c_char_p, _P, _P)),
        88: ("KernelContext_GetInputCount", _P, (_P, _P)),
        89: ("KernelContext_GetOutputCount", _P, (_P, _P)),
        90: ("KernelContext_GetInput", _P, (_P, _SIZE, _P)),
        91: ("KernelContext_GetOutput", _P, (_P, _SIZE, _P, _SIZE, _P)),
        93: ("ReleaseStatus", None, (_P,)),
        99: ("ReleaseTensorTypeAndShapeInfo", None, (_P,)),
        2: ("GetErrorMessage", ctypes.c_char_p, (_P,)),
        230: ("KernelInfo_GetInputCount", _P, (_P, _P)),  # API 14 on
        249: ("KernelInfoGetConstantInput_tensor", _P, (_P, _SIZE, _P, _P)),  # API 15 on
    }
    #: API 24 (onnxruntime 1.24) on: a tensor's element type and a pointer to its shape in
    #: one call, in place of the five calls of GetTensorTypeAndShape .. Release.
    _SHAPE_REFERENCE = (414, "GetTensorElementTypeAndShapeDataReference", _P, (_P, _P, _P, _P))

    def __init__(self, address: int):
        table = ctypes.cast(address, ctypes.POINTER(_P))
        for slot, (name, result, arguments) in self._SLOTS.items():
            setattr(self, name, ctypes.PYFUNCTYPE(result, *arguments)(table[slot]))
        #: The ORT version that owns the table, where it can be told (ort_versions.py).
        self.version = ort_version_at(address)
        one_call = self.version is not None and self.version >= (1, 24)
        if one_call:  # (a slot beyond an older table's end must never be read)
            slot, name, result, arguments = self._SHAPE_REFERENCE
            setattr(self, name, ctypes.PYFUNCTYPE(result, *arguments)(table[slot]))
        #: locate(value, index) -> (data pointer, shape) of a tensor OrtValue.
        self.locate = self._locate_reference if one_call else self._locate_five_calls

    def _locate_reference(self, value: int, index: int) -> tuple[int, tuple[int, ...]]:
        """Where a tensor OrtValue's data lies, and its shape: two ORT calls."""
        s = _scratch
        status = self.GetTensorElementTypeAndShapeDataReference(value, s.element_address, s.shape_address, s.count_address)
        if status:
            _raise(self, status)
        rank = s.count.value
        if rank > _MAX_RANK:
            raise OrtStatusError(f"input {index} has rank {rank}, more than {_MAX_RANK}")
        if rank:
            ctypes.memmove(s.dims, s.shape.value, 8 * rank)  # ORT's own shape array: read, never kept
        status = self.GetTensorMutableData(value, s.data_address)
        if status:
            _raise(self, status)
        return s.data.value, tuple(s.dims[:rank])

    def _locate_five_calls(self, value: int, index: int) -> tuple[int, tuple[int, ...]]:
        """The same through the calls every ORT of API 17 has: six ORT calls."""
        s = _scratch
        _check(self, self.GetTensorTypeAndShape(value, s.info_address))
        try:
            _check(self, self.GetDimensionsCount(s.info.value, s.count_address))
            rank = s.count.value
            if rank > _MAX_RANK:
                raise OrtStatusError(f"input {index} has rank {rank}, more than {_MAX_RANK}")
            _check(self, self.GetDimensions(s.info.value, s.dims, rank))
            shape = tuple(s.dims[:rank])
        finally:
            self.ReleaseTensorTypeAndShapeInfo(s.info.value)
        _check(self, self.GetTensorMutableData(value, s.data_address))
        return s.data.value, shape


#: ORT's function tables by address. One process can hold several copies of ORT (the Python
#: module's own, and the shared library ORT GenAI loads): each kernel calls the table of the
#: ORT that created it, handed to CreateKernelV2.
_apis: dict[int, _Api] = {}
_api_lock = threading.Lock()


def _api_at(address: int) -> _Api:
    api = _apis.get(address)
    if api is None:
        with _api_lock:
            api = _apis.setdefault(address, _Api(address))
    return api


def _error_text(api: _Api, status: int) -> str:
    message = api.GetErrorMessage(status)
    api.ReleaseStatus(status)
    return message.decode(errors="replace") if message else "unknown error"


class OrtStatusError(RuntimeError):
    """An ORT function called by a kernel returned an error (its message is ORT's)."""


def _check(api: _Api, status) -> None:
    if status:
        _raise(api, status)


def _raise(api: _Api, status) -> None:
    raise OrtStatusError(_error_text(api, status))


class _Scratch(threading.local):
    """Out-parameters of the ORT calls, per thread (ORT may run sessions on many threads),
    with their addresses (taken once: ctypes.addressof is a call too)."""

    def __init__(self):
        self.value, self.info, self.count, self.data, self.shape, self.element = _P(), _P(), _SIZE(), _P(), _P(), ctypes.c_int()
        self.dims = (ctypes.c_int64 * _MAX_RANK)()
        self.value_address, self.info_address, self.count_address, self.data_address, self.shape_address, self.element_address = (
            ctypes.addressof(x) for x in (self.value, self.info, self.count, self.data, self.shape, self.element)
        )


_scratch = _Scratch()


#: Views made, by (pointer, shape, dtype, writeable): a decode loop hands the same buffers
#: (bound caches, ORT's reused allocations) every step, and a view is the same whenever its
#: pointer and shape are. One of memory freed since is never read: it is handed out only
#: for a tensor that lies at that address, with that shape, in the run at hand.
_views: dict[tuple, np.ndarray] = {}


def view(pointer: int, shape: tuple[int, ...], dtype: np.dtype, writeable: bool) -> np.ndarray:
    """A numpy array over ``pointer`` (no copy)."""
    key = (pointer, shape, dtype, writeable)
    array = _views.get(key)
    if array is not None:
        return array
    count = 1
    for dim in shape:
        count *= dim
    if count == 0 or not pointer:
        array = np.empty(shape, dtype)
    else:
        array = np.frombuffer((ctypes.c_char * (count * dtype.itemsize)).from_address(pointer), dtype).reshape(shape)
    if not writeable:
        array.flags.writeable = False
    if len(_views) >= 1024:
        _views.clear()
    _views[key] = array
    return array


class KernelContext:
    """One run of one node: its inputs as read-only views of ORT's tensors, its outputs as
    writable views of the buffers ORT allocates (or the caller bound) for them. Constant
    inputs (initializers) were located once, when the node's kernel was created."""

    __slots__ = ("_api", "_context", "_scratch", "_declaration", "_constants", "_inputs", "_outputs")

    def __init__(self, api: _Api, context: int, declaration: OpDeclaration, constants: dict[int, np.ndarray]):
        self._api, self._context, self._scratch, self._declaration, self._constants = api, context, _scratch, declaration, constants
        self._inputs = self._outputs = None

    def input_count(self) -> int:
        """Inputs the node has (trailing optional ones it leaves out do not count)."""
        if self._inputs is None:
            _check(self._api, self._api.KernelContext_GetInputCount(self._context, self._scratch.count_address))
            self._inputs = self._scratch.count.value
        return self._inputs

    def output_count(self) -> int:
        """Outputs the node has (trailing optional ones it leaves out do not count)."""
        if self._outputs is None:
            _check(self._api, self._api.KernelContext_GetOutputCount(self._context, self._scratch.count_address))
            self._outputs = self._scratch.count.value
        return self._outputs

    def input(self, index: int) -> np.ndarray | None:
        """Input ``index`` as a read-only view, or None where the node leaves it out."""
        return self._input(index, self._declaration.input_dtypes[index], self.input_count())

    def inputs(self) -> list[np.ndarray | None]:
        """Every declared input, each as :meth:`input` gives it, in one pass: a kernel that
        reads them all (the bridge's, every decode step) makes one call, not one per input."""
        count = self.input_count()
        return [self._input(index, dtype, count) for index, dtype in enumerate(self._declaration.input_dtypes)]

    def _input(self, index: int, dtype: np.dtype, count: int) -> np.ndarray | None:
        """input(), given the input's dtype and the node's input count."""
        constant = self._constants.get(index)
        if constant is not None:
            return constant
        located = self._locate(index) if index < count else None
        return None if located is None else view(*located, dtype, writeable=False)

    def _locate(self, index: int) -> tuple[int, tuple[int, ...]] | None:
        """Where input ``index`` (below the input count) lies and its shape, or None where the
        node leaves it out."""
        api = self._api
        status = api.KernelContext_GetInput(self._context, index, self._scratch.value_address)
        if status:
            _raise(api, status)
        value = self._scratch.value.value
        return None if not value else api.locate(value, index)

    def output(self, index: int, shape: tuple[int, ...]) -> np.ndarray | None:
        """ORT's buffer for output ``index`` with ``shape`` (a bound output is that buffer,
        if its shape is this one: ORT raises otherwise), or None where the node leaves the
        output out. Contents are whatever the buffer held: write every element."""
        if index >= self.output_count():
            return None
        s, api = self._scratch, self._api
        rank = len(shape)
        s.dims[:rank] = shape
        status = api.KernelContext_GetOutput(self._context, index, ctypes.addressof(s.dims), rank, s.value_address)
        if status:
            _raise(api, status)
        if not s.value.value:
            return None
        status = api.GetTensorMutableData(s.value.value, s.data_address)
        if status:
            _raise(api, status)
        return view(s.data.value, shape, NUMPY_TYPES[self._declaration.outputs[index].element_type], writeable=True)


@dataclass(frozen=True)
class Slot:
    """One input or output of an op: its element type and whether a node may leave it out."""

    element_type: int
    optional: bool = False


@dataclass(frozen=True)
class OpDeclaration:
    """What ORT is told about an op: its name (under onnxruntime-extensions' domain
    ``ai.onnx.contrib``), inputs, outputs, and the attributes its kernels read (name ->
    int, float or str; an attribute the node lacks is left out of the mapping)."""

    name: str
    inputs: tuple[Slot, ...]
    outputs: tuple[Slot, ...]
    attributes: tuple[tuple[str, type], ...]

    @functools.cached_property
    def input_dtypes(self) -> tuple[np.dtype, ...]:
        """The numpy type of each input (a decode step looks them all up)."""
        return tuple(NUMPY_TYPES[slot.element_type] for slot in self.inputs)


# -- the ABI -------------------------------------------------------------------------------
_CreateKernel = ctypes.CFUNCTYPE(_P, _P, _P, _P)
_CreateKernelV2 = ctypes.CFUNCTYPE(_P, _P, _P, _P, ctypes.POINTER(_P))
_ComputeV2 = ctypes.CFUNCTYPE(_P, _P, _P)
_Compute = ctypes.CFUNCTYPE(None, _P, _P)
_Text = ctypes.CFUNCTYPE(_P, _P)  # const char*, as an address (a c_char_p result would leak)
_TypeAt = ctypes.CFUNCTYPE(ctypes.c_int, _P, _SIZE)
_Count = ctypes.CFUNCTYPE(_SIZE, _P)
_Int = ctypes.CFUNCTYPE(ctypes.c_int, _P)


class _OrtCustomOp(ctypes.Structure):
    """``struct OrtCustomOp`` of ORT API 17, member for member."""

    _fields_ = [
        ("version", ctypes.c_uint32),
        ("CreateKernel", _CreateKernel),
        ("GetName", _Text),
        ("GetExecutionProviderType", _Text),
        ("GetInputType", _TypeAt),
        ("GetInputTypeCount", _Count),
        ("GetOutputType", _TypeAt),
        ("GetOutputTypeCount", _Count),
        ("KernelCompute", _Compute),
        ("KernelDestroy", _P),
        ("GetInputCharacteristic", _TypeAt),
        ("GetOutputCharacteristic", _TypeAt),
        ("GetInputMemoryType", _TypeAt),
        ("GetVariadicInputMinArity", _Int),
        ("GetVariadicInputHomogeneity", _Int),
        ("GetVariadicOutputMinArity", _Int),
        ("GetVariadicOutputHomogeneity", _Int),
        ("CreateKernelV2", _CreateKernelV2),
        ("KernelComputeV2", _ComputeV2),
        ("InferOutputShapeFn", _P),
        ("GetStartVersion", _Int),
        ("GetEndVersion", _Int),
    ]


def _libc():
    library = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    library.malloc.restype, library.malloc.argtypes = _P, [_SIZE]
    return library


_LIBC = _libc()
_handles = itertools.count(1)
#: (op name, kernel object, constant inputs, the creating ORT's function table) by the number
#: a kernel's ORT handle holds. A session's go when it is closed (forget_kernels); ORT frees
#: the handles themselves.
_kernels: dict[int, tuple[str, object | None, dict[int, np.ndarray], _Api]] = {}
#: Every op defined, with its callbacks: ORT and onnxruntime-extensions keep pointers to
#: them for the life of the process (define() keeps them alive past module teardown too).
_defined: dict[str, tuple] = {}


def define(
    declaration: OpDeclaration,
    create: Callable[[dict, set], object],
    compute: Callable[[object, KernelContext], None],
    library,
    *,
    rule_errors: tuple[type[BaseException], ...] = (),
) -> None:
    """Add an op to onnxruntime-extensions' library (``library``: its loaded ctypes handle),
    so that every session registering that library from now on runs it. ``create(attributes)``
    makes a node's kernel object; ``compute(kernel, context)`` runs one call and raises on a
    bad input (the exception becomes ORT's error: its text alone for the op's
    ``rule_errors``, which name the input and the rule it breaks; anything else after its
    type name, so that a fault reads as one). ``create`` is also told which inputs are
    constants of the model (a set of input indices). One definition per name per process."""
    if declaration.name in _defined:
        raise ValueError(f"custom op {declaration.name} is defined already")
    name = declaration.name.encode()
    name_buffer = ctypes.create_string_buffer(name)

    def create_kernel(op, address, info, handle_out):
        api = _api_at(address)
        try:
            constants = _constant_inputs(api, info, declaration)
            kernel = create(_attributes(api, info, declaration.attributes), set(constants))
            number = next(_handles)
            handle = _LIBC.malloc(8)
            ctypes.c_int64.from_address(handle).value = number
            _kernels[number] = (declaration.name, kernel, constants, api)
            handle_out[0] = handle
            return None
        except BaseException as error:  # noqa: BLE001 - nothing may escape into ORT
            return _status(api, f"{declaration.name}: {_describe(error, rule_errors)}")

    def compute_kernel(handle, context):
        _, kernel, constants, api = _kernels[ctypes.c_int64.from_address(handle).value]
        if kernel is None:
            return _status(api, f"{declaration.name}: this node's kernel was forgotten (forget_kernels: its session was closed)")
        try:
            compute(kernel, KernelContext(api, context, declaration, constants))
            return None
        except BaseException as error:  # noqa: BLE001 - nothing may escape into ORT
            return _status(api, _describe(error, rule_errors))

    inputs, outputs = declaration.inputs, declaration.outputs
    callbacks = dict(
        CreateKernel=_CreateKernel(0),  # ORT calls CreateKernelV2 when it is set
        GetName=_Text(lambda op: ctypes.addressof(name_buffer)),
        GetExecutionProviderType=_Text(lambda op: None),  # the CPU execution provider
        GetInputType=_TypeAt(lambda op, i: inputs[i].element_type),
        GetInputTypeCount=_Count(lambda op: len(inputs)),
        GetOutputType=_TypeAt(lambda op, i: outputs[i].element_type),
        GetOutputTypeCount=_Count(lambda op: len(outputs)),
        KernelCompute=_Compute(0),  # ORT calls KernelComputeV2 when it is set
        GetInputCharacteristic=_TypeAt(lambda op, i: _OPTIONAL if inputs[i].optional else _REQUIRED),
        GetOutputCharacteristic=_TypeAt(lambda op, i: _OPTIONAL if outputs[i].optional else _REQUIRED),
        GetInputMemoryType=_TypeAt(lambda op, i: 0),  # OrtMemTypeDefault: CPU memory
        GetVariadicInputMinArity=_Int(lambda op: 1),
        GetVariadicInputHomogeneity=_Int(lambda op: 1),
        GetVariadicOutputMinArity=_Int(lambda op: 1),
        GetVariadicOutputHomogeneity=_Int(lambda op: 1),
        CreateKernelV2=_CreateKernelV2(create_kernel),
        KernelComputeV2=_ComputeV2(compute_kernel),
        GetStartVersion=_Int(lambda op: 1),
        GetEndVersion=_Int(lambda op: 2**31 - 1),
    )
    op = _OrtCustomOp(version=OP_VERSION, KernelDestroy=ctypes.cast(_LIBC.free, _P).value, InferOutputShapeFn=None, **callbacks)
    # ORT reads the struct (its KernelDestroy) whenever it destroys a kernel, also while the
    # interpreter exits, after Python may have torn this module down: the struct lives in
    # memory of its own, never freed, and what it points to is never collected.
    memory = _LIBC.malloc(ctypes.sizeof(_OrtCustomOp))
    ctypes.memmove(memory, ctypes.addressof(op), ctypes.sizeof(_OrtCustomOp))
    kept = (name_buffer, callbacks)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(kept))
    add = library.AddExternalCustomOp
    add.argtypes, add.restype = [_P], ctypes.c_bool
    if not add(memory):
        raise RuntimeError(f"onnxruntime-extensions refused custom op {declaration.name}")
    _defined[declaration.name] = kept


def kernels(op_name: str) -> list[tuple[object, dict[int, np.ndarray]]]:
    """The kernel objects of op ``op_name``'s nodes, each with its constant inputs (not those forgotten)."""
    return [(kernel, constants) for name, kernel, constants, _ in list(_kernels.values()) if name == op_name and kernel is not None]


def forget_kernels(op_name: str, predicate: Callable[[object], bool]) -> None:
    """Drop the kernel objects of op ``op_name`` that ``predicate`` selects, and their views
    of constant inputs: for sessions that are closed. (A few words per node stay behind, so
    that a session still running after all would fail with a message, not a crash.)"""
    for number, (name, kernel, _, api) in list(_kernels.items()):
        if name == op_name and kernel is not None and predicate(kernel):
            _kernels[number] = (name, None, {}, api)


def _describe(error: BaseException, rule_errors: tuple[type[BaseException], ...]) -> str:
    """An exception as ORT's status message: a rule error's text as it is (it names the input
    and the rule), anything else's after its type name (an internal error, a GPU failure)."""
    text = str(error)
    return text if isinstance(error, rule_errors) and text else f"{type(error).__name__}: {text}"


def _status(api: _Api, message: str) -> int:
    return api.CreateStatus(_ORT_FAIL, message.encode(errors="replace"))


def _constant_inputs(api: _Api, info: int, declaration: OpDeclaration) -> dict[int, np.ndarray]:
    """The node's inputs that are constants of the model (initializers), as read-only views
    of the tensors the session owns (they neither move nor change while it lives)."""
    count, is_constant, value = _SIZE(), ctypes.c_int(), _P()
    _check(api, api.KernelInfo_GetInputCount(info, ctypes.addressof(count)))
    constants = {}
    for index in range(min(count.value, len(declaration.inputs))):
        _check(api, api.KernelInfoGetConstantInput_tensor(info, index, ctypes.addressof(is_constant), ctypes.addressof(value)))
        if is_constant.value and value.value:
            pointer, shape = api.locate(value.value, index)
            constants[index] = view(pointer, shape, declaration.input_dtypes[index], writeable=False)
    return constants


def _attributes(api: _Api, info: int, wanted) -> dict:
    """The node's attributes among ``wanted`` (name, type); absent ones are left out."""
    found = {}
    for name, kind in wanted:
        key = name.encode()
        if kind is int:
            out = ctypes.c_int64()
            status = api.KernelInfoGetAttribute_int64(info, key, ctypes.addressof(out))
        elif kind is float:
            out = ctypes.c_float()
            status = api.KernelInfoGetAttribute_float(info, key, ctypes.addressof(out))
        else:
            size = _SIZE(0)
            status = api.KernelInfoGetAttribute_string(info, key, None, ctypes.addressof(size))
            if not status:
                out = ctypes.create_string_buffer(size.value)
                status = api.KernelInfoGetAttribute_string(info, key, ctypes.addressof(out), ctypes.addressof(size))
        if status:  # absent (or of another type: the caller's rules say what that means)
            api.ReleaseStatus(status)
            continue
        found[name] = out.value.decode() if kind is str else out.value
    return found
