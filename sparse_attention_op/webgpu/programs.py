"""GPU programs: what a kernel declares, how its WGSL is rendered, and the pipeline cache.

Modelled on ONNX Runtime's WebGPU programs: a :class:`Program` declares its storage
bindings, its uniforms and its code-shaping constants. Shape-dependent values go in the
uniform block so one pipeline serves every shape; only values that change the generated
code (head size, tile sizes, rotary layout) are constants, and those constants together
with the declarations form the cache key. wgpu does not cache pipelines itself, and
compiling one costs milliseconds to seconds (lavapipe), so each is built once per device.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import jinja2
import numpy as np
import wgpu

from sparse_attention_op.webgpu import native

TEMPLATE_DIR = Path(__file__).parent / "templates"
#: WebGPU's guaranteed minimum of maxComputeWorkgroupsPerDimension.
MAX_WORKGROUPS_PER_DIM = 65535

_environment = jinja2.Environment(
    loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
    undefined=jinja2.StrictUndefined,  # a misspelt constant must fail loudly, not render as ''
    trim_blocks=True,
    lstrip_blocks=True,
    keep_trailing_newline=True,
)


@dataclass(frozen=True)
class Binding:
    """One storage buffer of a program: its WGSL name, element type and access."""

    name: str
    element: str  # "f32", "u32", "vec4<f32>", ...
    writable: bool = False
    #: Loads see other workgroups' stores of the same dispatch once a device-scope barrier
    #: orders them (``@coherent``: needs the device feature memory-decoration-coherent).
    coherent: bool = False


@dataclass(frozen=True)
class Program:
    """A kernel declaration: template, bindings, uniforms (name, "u32" | "f32") and constants."""

    template: str
    bindings: tuple[Binding, ...]
    uniforms: tuple[tuple[str, str], ...]
    constants: tuple[tuple[str, object], ...]

    @property
    def cache_key(self) -> tuple:
        return (self.template, self.bindings, self.uniforms, self.constants)

    def declarations(self) -> str:
        """WGSL for the bind group: the uniform block at binding 0, storage buffers after it."""
        fields = "\n".join(f"  {name}: {kind}," for name, kind in self.uniforms)
        lines = [f"struct Params {{\n{fields}\n}};", "@group(0) @binding(0) var<uniform> params: Params;"]
        if any("f16" in binding.element for binding in self.bindings):
            lines.insert(0, "enable f16;")  # needs the device feature shader-f16
        for index, binding in enumerate(self.bindings, start=1):
            access = "read_write" if binding.writable else "read"
            coherent = " @coherent" if binding.coherent else ""
            lines.append(f"@group(0) @binding({index}){coherent} var<storage, {access}> {binding.name}: array<{binding.element}>;")
        return "\n".join(lines)

    def render(self) -> str:
        template = _environment.get_template(self.template)
        return template.render(declarations=self.declarations(), **dict(self.constants))

    def pack_uniforms(self, values: dict) -> np.ndarray:
        """The uniform block as bytes, in declaration order, padded to 16 bytes."""
        missing = [name for name, _ in self.uniforms if name not in values]
        if missing:
            raise KeyError(f"{self.template}: uniforms not given: {missing}")
        words = np.zeros(-(-len(self.uniforms) // 4) * 4, dtype=np.uint32)
        for index, (name, kind) in enumerate(self.uniforms):
            if kind == "f32":
                words[index : index + 1] = np.array([values[name]], dtype=np.float32).view(np.uint32)
            else:
                value = int(values[name])
                if not 0 <= value < 2**32:
                    raise OverflowError(f"{self.template}: uniform {name} = {value} does not fit u32")
                words[index] = value
        return words


class BufferRange(NamedTuple):
    """What one binding binds: a GPU buffer, or a 256-byte aligned range of one.

    A tuple: cheap to make (a call builds about fifteen) and a cache key as it is: its
    buffer compares by identity (a key holding it keeps it alive, so a new buffer can never
    take a cached one's place), its offset and size by value."""

    buffer: object
    offset: int = 0
    size: int | None = None  # None: to the buffer's end

    @property
    def nbytes(self) -> int:
        return (self.buffer.size - self.offset) if self.size is None else self.size


@dataclass(frozen=True)
class Dispatch:
    """One kernel launch: a program, a buffer for each of its bindings, its uniform values
    and its grid. Construction checks the names against the program's declarations, so a
    binding or uniform named wrongly fails where the dispatch is declared."""

    label: str
    program: Program
    buffers: dict
    uniforms: dict
    workgroups: tuple[int, int, int]

    def __post_init__(self):
        declared = [binding.name for binding in self.program.bindings]
        if sorted(self.buffers) != sorted(declared):
            raise ValueError(f"{self.label} ({self.program.template}): bindings {sorted(self.buffers)} do not match the declared {sorted(declared)}")
        uniforms = [name for name, _ in self.program.uniforms]
        if sorted(self.uniforms) != sorted(uniforms):
            raise ValueError(f"{self.label} ({self.program.template}): uniforms {sorted(self.uniforms)} do not match the declared {sorted(uniforms)}")
        for name, limit in zip("xyz", self.workgroups):
            if not 0 < limit <= MAX_WORKGROUPS_PER_DIM:
                raise ValueError(f"{self.label}: {limit} workgroups along {name} (1..{MAX_WORKGROUPS_PER_DIM})")

    def bound(self) -> tuple[BufferRange, ...]:
        """The buffers in binding order (after the uniform block)."""
        return tuple(self.buffers[binding.name] for binding in self.program.bindings)


@dataclass
class CompiledProgram:
    program: Program
    pipeline: object
    bind_group_layout: object
    wgsl: str


class PipelineCache:
    """Compiled pipelines of one device, keyed by everything that shaped their WGSL."""

    def __init__(self, device, runtime_checks: bool = True):
        self._device = device
        #: Whether Naga's runtime checks stay in the shaders (Tuning.shader_runtime_checks).
        self.runtime_checks = runtime_checks or not native.UNCHECKED_SHADERS
        self._compiled: dict[tuple, CompiledProgram] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._compiled)

    def get(self, program: Program) -> CompiledProgram:
        key = program.cache_key
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is None:
                compiled = self._compile(program)
                self._compiled[key] = compiled
            return compiled

    def _compile(self, program: Program) -> CompiledProgram:
        wgsl = program.render()
        device = self._device
        if self.runtime_checks:
            module = device.create_shader_module(code=wgsl, label=program.template)
        else:
            module = native.create_unchecked_shader_module(device, wgsl, program.template)
        storage = wgpu.BufferBindingType
        entries = [{"binding": 0, "visibility": wgpu.ShaderStage.COMPUTE, "buffer": {"type": storage.uniform}}]
        for index, binding in enumerate(program.bindings, start=1):
            kind = storage.storage if binding.writable else storage.read_only_storage
            entries.append({"binding": index, "visibility": wgpu.ShaderStage.COMPUTE, "buffer": {"type": kind}})
        # An explicit layout (not "auto") so a binding the compiler finds unused still binds.
        layout = device.create_bind_group_layout(entries=entries)
        pipeline = device.create_compute_pipeline(
            layout=device.create_pipeline_layout(bind_group_layouts=[layout]),
            compute={"module": module, "entry_point": "main"},
            label=program.template,
        )
        return CompiledProgram(program, pipeline, layout, wgsl)
