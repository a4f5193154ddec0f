"""The rest of the graph on ORT's WebGPU plugin EP, and models with a static KV cache.

Where the plugin finds a GPU, the end-to-end tests run: the tokens equal the CPU EP's,
ORT's profiler shows no cache-sized copy between host and device, and ORT GenAI runs a
prepared folder under the EP. Where it finds none (a CPU machine with lavapipe, which the
plugin does not use), those tests are skipped with that reason, and the tests of what a user
there gets run instead: one-line errors, before any session exists, that say what to do.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import sparse_attention_op as sao
from sparse_attention_op.cli import main
from sparse_attention_op.generation.loop import GenerationError, device_layers_of
from sparse_attention_op.ort import providers
from sparse_attention_op.ort.providers import ExecutionProviderError
from sparse_attention_op.testing.decoder_models import BUNDLED_MODELS, build_decoder

MODEL = "models/phi3-small-tiny/model.onnx"
FOLDER = "models/phi3-small-tiny"


def plugin_devices() -> tuple:
    try:
        return providers.webgpu_plugin().devices
    except ExecutionProviderError:
        return ()


HAS_DEVICE = bool(plugin_devices())
needs_device = pytest.mark.skipif(not HAS_DEVICE, reason="ORT's WebGPU plugin EP found no GPU adapter here (it does not use lavapipe)")
needs_no_device = pytest.mark.skipif(HAS_DEVICE, reason="the plugin found a GPU adapter here: the no-adapter error cannot happen")


@pytest.fixture
def fresh_plugin(monkeypatch):
    """The plugin's process-wide registration forgotten, as in a fresh process."""
    monkeypatch.setattr(providers, "_plugin", None)


def test_an_unknown_ep_is_refused():
    with pytest.raises(ValueError, match=r"ep must be one of \('cpu', 'webgpu'\), got 'gpu'"):
        sao.create_session(MODEL, ep="gpu")
    with pytest.raises(ValueError, match="ep must be one of"):
        sao.generate(MODEL, [[1, 2]], 2, ep="cuda")


def test_providers_and_the_webgpu_ep_are_not_both_taken():
    with pytest.raises(ValueError, match="pass either providers or ep='webgpu', not both"):
        sao.create_session(MODEL, providers=["CPUExecutionProvider"], ep="webgpu")


def test_a_missing_plugin_says_what_to_install(monkeypatch, fresh_plugin):
    monkeypatch.setitem(sys.modules, "onnxruntime_ep_webgpu", None)  # import fails as if not installed
    with pytest.raises(ExecutionProviderError, match=r"not installed: pip install onnxruntime-ep-webgpu"):
        sao.create_session(MODEL, ep="webgpu")


def test_an_onnxruntime_without_plugin_eps_says_which_it_needs(monkeypatch, fresh_plugin):
    monkeypatch.delattr(ort, "register_execution_provider_library")
    with pytest.raises(ExecutionProviderError, match=r"cannot load plugin EPs: the WebGPU plugin EP needs onnxruntime >= 1\.24\.4"):
        sao.create_session(MODEL, ep="webgpu")


@needs_no_device
def test_no_adapter_is_one_clear_error_and_cpu_sessions_still_work():
    with pytest.raises(ExecutionProviderError, match="found no GPU adapter on this machine .* run with ep='cpu'"):
        sao.create_session(MODEL, ep="webgpu")
    assert sao.generate(FOLDER, [[1, 2, 3]], 3).tokens == sao.generate(FOLDER, [[1, 2, 3]], 3, ep="cpu").tokens


@needs_no_device
def test_the_cli_reports_the_plugin_and_refuses_ep_webgpu_in_one_line(capsys, tmp_path):
    assert main(["info", "--json", str(tmp_path / "info.json")]) == 0
    plugin = json.loads((tmp_path / "info.json").read_text())["webgpu_plugin_ep"]
    assert plugin["installed"] and plugin["devices"] == [] and "found no GPU adapter" in plugin["problem"]
    capsys.readouterr()
    for argv in (
        ["inspect", FOLDER, "--ep", "webgpu"],
        ["generate", FOLDER, "--prompt-ids", "1,2", "--ep", "webgpu"],
        ["run", FOLDER, "--ep", "webgpu"],
    ):
        assert main(argv) == 1
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "found no GPU adapter" in err, err


def test_gqa_layers_are_the_ones_whose_caches_go_to_the_device():
    # The bundled decoders are dense (GroupQueryAttention) every second layer: 1 and 3 of 0..3.
    assert device_layers_of(onnx.load(MODEL)) == {1, 3}


# -- static KV caches -----------------------------------------------------------------------


def static_model(rows: int) -> onnx.ModelProto:
    """The bundled decoder with every past declaring ``rows`` rows, as a static-cache export does."""
    return build_decoder(dataclasses.replace(BUNDLED_MODELS["phi3-small-tiny"], static_cache=rows))


def test_a_static_cache_generates_with_its_own_capacity():
    model = static_model(64)
    prompts = [[5, 17, 33, 2, 9]]
    ours = sao.generate(model, prompts, 8)
    assert ours.tokens == sao.generate(MODEL, prompts, 8, capacity=64).tokens
    plain = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert sao.generate(plain, prompts, 8).tokens == ours.tokens  # ORT's own kernels, same fixed buffers


def test_a_static_cache_names_its_limits():
    model = static_model(16)
    with pytest.raises(GenerationError, match="capacity=32 differs from the 16 rows the model's pasts declare"):
        sao.generate(model, [[1, 2]], 4, capacity=32)
    with pytest.raises(GenerationError, match="is 22 positions, more than the 16 rows of the model's static KV cache"):
        sao.generate(model, [[1, 2]], 20)


def test_the_cli_generates_with_a_static_cache(tmp_path, capsys):
    path = tmp_path / "static.onnx"
    onnx.save(static_model(48), str(path))
    assert main(["generate", str(path), "--prompt-ids", "3,4,5", "--max-new-tokens", "6", "--compare-ort", "--no-progress"]) == 0
    assert "identical tokens" in capsys.readouterr().out


# -- on a GPU, through the plugin -------------------------------------------------------------


def memcpy_bytes(session) -> list[int]:
    """Bytes of every copy ORT ran between devices in the profiled runs (its Memcpy nodes)."""
    events = json.load(open(session.end_profiling()))
    return [
        int(e["args"].get("output_size", 0))
        for e in events
        if e.get("cat") == "Node" and e["args"].get("op_name") in ("MemcpyToHost", "MemcpyFromHost")
    ]


@needs_device
def test_the_webgpu_ep_generates_the_cpu_eps_tokens_and_moves_no_cache():
    prompts = [[5, 17, 33, 2, 9, 40, 41]]
    cpu = sao.generate(FOLDER, prompts, 16)
    options = ort.SessionOptions()
    options.enable_profiling = True
    session = sao.create_session(MODEL, options, kv_check="fast", ep="webgpu")
    assert session.ep == "webgpu" and "WebGpuExecutionProvider" in session.get_providers()
    capacity = 64
    webgpu = sao.generate(session, prompts, 16, capacity=capacity)
    assert webgpu.tokens == cpu.tokens
    config = json.loads(open(f"{FOLDER}/genai_config.json").read())["model"]["decoder"]
    cache_bytes = capacity * config["num_key_value_heads"] * config["head_size"] * 4
    copies = memcpy_bytes(session)
    assert copies, "the op's query and output cross between devices: the profile must show those copies"
    assert max(copies) < cache_bytes, f"a copy of {max(copies)} bytes: a cache ({cache_bytes} bytes) crossed"


@needs_device
def test_inspect_shows_what_the_webgpu_ep_takes(capsys):
    assert main(["inspect", FOLDER, "--ep", "webgpu"]) == 0
    out = capsys.readouterr().out
    assert "ONNX Runtime WebGPU EP" in out and "com.microsoft.GroupQueryAttention" in out.split("ONNX Runtime WebGPU EP")[1]


@needs_device
@pytest.mark.parametrize("sparse_caches", ["graph", "op"])
def test_genai_runs_a_prepared_folder_under_the_webgpu_ep(tmp_path, sparse_caches):
    og = pytest.importorskip("onnxruntime_genai")
    folder = sao.prepare_genai_folder(FOLDER, tmp_path / "prepared", sparse_caches=sparse_caches)
    if sparse_caches == "graph":  # GenAI keeps those caches on the EP's device: the user is told what that costs
        with pytest.warns(UserWarning, match="sparse_caches='op'"):
            model = sao.load_genai_model(folder, ep="webgpu")
    else:
        model = sao.load_genai_model(folder, ep="webgpu")
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=24, do_sample=False)
    generator = og.Generator(model, params)
    prompt = [5, 17, 33, 2, 9]
    generator.append_tokens(np.array([prompt], np.int32))
    tokens = []
    while not generator.is_done():
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))
    expected = sao.generate(FOLDER, [prompt], len(tokens), stop_tokens=()).tokens[0]
    assert tokens == expected
