"""ORT GenAI end to end: prepare_genai_folder's output, generated tokens, and refused calls.

Token comparisons are exact: a greedy decode through GenAI on a prepared folder must give
the tokens of sparse_attention_op.generate and of ONNX Runtime's own CPU kernel (GenAI on
the unprepared folder, and a plain InferenceSession). Cases that could abort the process
(a refused call inside the op) run in a subprocess, so an abort fails the test instead of
killing pytest.
"""

from __future__ import annotations

import dataclasses
import errno
import gc
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnxruntime_extensions import get_library_path

import sparse_attention_op as sao
from sparse_attention_op.generation import genai as genai_module
from sparse_attention_op.ort.bridge import BRIDGE_DOMAIN, BRIDGE_FORMAT, SETTINGS_ATTRIBUTE
from sparse_attention_op.settings import SessionSettings
from sparse_attention_op.testing.decoder_models import DecoderConfig, write_model_folder

# Three layers, the last a dense GroupQueryAttention one (Phi-3-small's mix); blocks of 16
# with 2 local blocks and a stride of 2, so sparsity bites from 32 tokens on.
CONFIG = DecoderConfig(
    vocab_size=128,
    hidden=64,
    layers=3,
    num_heads=4,
    kv_num_heads=2,
    head_size=16,
    sparse_block_size=16,
    local_blocks=2,
    vert_stride=2,
    max_position=128,
    dense_every=3,
    intermediate=128,
)
PROMPT_LEN, MAX_LENGTH = 24, 72  # 48 new tokens per row
NEW_TOKENS = MAX_LENGTH - PROMPT_LEN
LIBRARY = Path(get_library_path())


@pytest.fixture(scope="module")
def og():
    try:
        import onnxruntime_genai
    except ImportError as error:
        pytest.fail(f"these tests need onnxruntime-genai (pip install -e '.[test]'): {error}")
    return onnxruntime_genai


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A GenAI folder as the builder leaves it, with tokenizer-like files to be copied."""
    folder = tmp_path_factory.mktemp("genai") / "source"
    write_model_folder(CONFIG, folder)
    (folder / "tokenizer.json").write_text('{"model": "not a real tokenizer"}')
    (folder / "extra").mkdir()
    (folder / "extra" / "notes.txt").write_bytes(b"\x00\x01 copied as is")
    return folder


@pytest.fixture(scope="module")
def prepared(source) -> Path:
    return sao.prepare_genai_folder(source, source.parent / "prepared")


@pytest.fixture(scope="module")
def prompts() -> np.ndarray:
    return np.random.default_rng(1).integers(2, CONFIG.vocab_size, (2, PROMPT_LEN)).astype(np.int32)


def genai_generate(og, model, prompts, generator_out: list | None = None) -> list[list[int]]:
    """Greedy new tokens per row, as GenAI produces them (max_length: MAX_LENGTH)."""
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=MAX_LENGTH, batch_size=len(prompts))
    generator = og.Generator(model, params)
    generator.append_tokens(prompts)
    while not generator.is_done():
        generator.generate_next_token()
    if generator_out is not None:
        generator_out.append(generator)
    return [[int(t) for t in generator.get_sequence(row)][PROMPT_LEN:] for row in range(len(prompts))]


def run_script(script: str, *args) -> subprocess.CompletedProcess:
    """Run ``script`` in a fresh interpreter; a signal (an abort) fails the test with the output."""
    env = dict(os.environ, XDG_RUNTIME_DIR=os.environ.get("XDG_RUNTIME_DIR", "/tmp"))
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *map(str, args)], capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode >= 0, f"the process was killed by signal {-done.returncode} (an abort)\n{done.stdout}\n{done.stderr}"
    assert done.returncode == 0, f"exit status {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


def bridge_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [node for node in model.graph.node if node.domain == BRIDGE_DOMAIN]


# -- the folder -------------------------------------------------------------------------------
def test_prepared_folder_links_the_loaded_library_and_shares_buffers(source, prepared):
    assert os.path.samefile(prepared / LIBRARY.name, LIBRARY), "the library must be a hard link, not a copy"
    config = json.loads((prepared / "genai_config.json").read_text())
    assert config["model"]["decoder"]["session_options"]["custom_ops_library"] == LIBRARY.name
    assert config["search"]["past_present_share_buffer"] is True
    # Nothing else in the config changes.
    original = json.loads((source / "genai_config.json").read_text())
    original["model"]["decoder"]["session_options"]["custom_ops_library"] = LIBRARY.name
    assert config == original
    record = json.loads((prepared / genai_module.RECORD_FILE).read_text())
    assert record["models"] == ["model.onnx"] and record["kv_check"] == "fast"


def test_prepared_folder_copies_other_files_and_rewrites_the_model(source, prepared):
    for name in ("tokenizer.json", "extra/notes.txt"):
        assert (prepared / name).read_bytes() == (source / name).read_bytes(), name
    model = onnx.load(str(prepared / "model.onnx"))
    assert not [n for n in model.graph.node if n.op_type == "SparseAttention"]
    stamped = {
        SessionSettings.from_attribute(dict((a.name, a.s.decode()) for a in node.attribute)[SETTINGS_ATTRIBUTE]) for node in bridge_nodes(model)
    }
    assert stamped == {SessionSettings(kv_check="fast")}
    # The dense layer stays ORT's GroupQueryAttention.
    assert [n.op_type for n in model.graph.node if n.op_type == "GroupQueryAttention"] == ["GroupQueryAttention"]


# -- tokens -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ort_kernel_tokens(og, source, prompts) -> list[list[int]]:
    """GenAI on the unprepared folder: ONNX Runtime's own CPU SparseAttention kernel."""
    return genai_generate(og, og.Model(str(source)), prompts)


def test_genai_tokens_match_ort_cpu_kernel(og, prepared, prompts, ort_kernel_tokens):
    generators = []
    ours = genai_generate(og, sao.load_genai_model(prepared), prompts, generators)
    assert [len(row) for row in ours] == [NEW_TOKENS] * len(prompts)
    assert ours == ort_kernel_tokens, "GenAI: this op against ORT's CPU kernel"
    # Shared buffers: the present GenAI hands back is the max_length-row buffer it binds as past.
    present = generators[0].get_output("present.0.key")
    assert present.shape == (len(prompts), CONFIG.kv_num_heads, MAX_LENGTH, CONFIG.head_size)


def test_genai_tokens_match_generate(source, prompts, ort_kernel_tokens):
    """sparse_attention_op.generate, on this op and on ORT's kernel in a plain session, gives GenAI's tokens."""
    from sparse_attention_op.generation.loop import generate

    plain = ort.InferenceSession(str(source / "model.onnx"), providers=["CPUExecutionProvider"])
    for label, model, options in (("ORT's kernel in a plain session", plain, {}), ("this op", source / "model.onnx", {"kv_check": "fast"})):
        tokens = generate(model, prompts.tolist(), NEW_TOKENS, **options).tokens
        assert [list(map(int, row)) for row in tokens] == ort_kernel_tokens, f"generate with {label} against GenAI"


def test_exact_check_and_external_data_under_genai(og, source, prompts, tmp_path):
    """kv_check="exact" is stamped and honoured; a source with external data keeps it."""
    external = tmp_path / "external"
    shutil.copytree(source, external)
    model = onnx.load(str(external / "model.onnx"))
    # The layouts go external too (prepare must read them from the data file); ORT wants the
    # few-byte shape constants inline (it refuses external ones in shape inference).
    onnx.save(model, str(external / "model.onnx"), save_as_external_data=True, location="model.onnx.data", size_threshold=64)
    stored = onnx.load(str(external / "model.onnx"), load_external_data=False)
    external_names = {t.name for t in stored.graph.initializer if onnx.external_data_helper.uses_external_data(t)}
    assert {"block_row_indices", "block_col_indices"} <= external_names
    target = sao.prepare_genai_folder(external, tmp_path / "prepared", kv_check="exact")
    assert (target / "model.onnx.data").read_bytes() == (external / "model.onnx.data").read_bytes()
    prepared = onnx.load(str(target / "model.onnx"), load_external_data=False)
    assert any(onnx.external_data_helper.uses_external_data(t) for t in prepared.graph.initializer)
    stamped = {
        SessionSettings.from_attribute(dict((a.name, a.s.decode()) for a in node.attribute)[SETTINGS_ATTRIBUTE]) for node in bridge_nodes(prepared)
    }
    assert stamped == {SessionSettings(kv_check="exact")}
    ours = genai_generate(og, sao.load_genai_model(target), prompts)
    assert ours == genai_generate(og, og.Model(str(external)), prompts), "ORT's kernel on the external-data source"


def test_gpu_state_freed_with_the_last_model_of_a_folder(og, prepared, prompts):
    from sparse_attention_op.webgpu import get_executor

    token = json.loads((prepared / genai_module.RECORD_FILE).read_text())["session_token"]
    first, second = sao.load_genai_model(prepared), sao.load_genai_model(prepared)
    genai_generate(og, first, prompts)
    executor = get_executor()
    assert any(key.startswith(token + "/") for key in executor.node_keys())
    del first
    gc.collect()
    assert any(key.startswith(token + "/") for key in executor.node_keys()), "freed while a model of the folder lives"
    del second
    gc.collect()
    assert not any(key.startswith(token + "/") for key in executor.node_keys())


def test_a_model_collected_while_its_generator_runs(og, prepared, prompts, ort_kernel_tokens):
    """The Python model goes (its finaliser frees the folder's GPU state) while a generator
    still holds GenAI's model and runs its sessions: the nodes keep their kernels, start
    their GPU state afresh and generate the same tokens."""
    import gc

    model = sao.load_genai_model(prepared)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=MAX_LENGTH, batch_size=len(prompts))
    generator = og.Generator(model, params)
    generator.append_tokens(prompts)
    generator.generate_next_token()
    del model, params
    gc.collect()
    while not generator.is_done():
        generator.generate_next_token()
    tokens = [[int(t) for t in generator.get_sequence(row)][PROMPT_LEN:] for row in range(len(prompts))]
    assert tokens == ort_kernel_tokens


# -- refused calls: raised and logged, never an abort ---------------------------------------------
def test_refused_call_under_genai_raises_and_logs(source, tmp_path):
    # With past_present_share_buffer false GenAI feeds a zero-length past to the prompt
    # step; the op refuses it, as ORT's own kernel does.
    target = sao.prepare_genai_folder(source, tmp_path / "prepared")
    for folder in (target, source):
        config = json.loads((folder / "genai_config.json").read_text())
        config["search"]["past_present_share_buffer"] = False
        (tmp_path / f"{folder.name}.json").write_text(json.dumps(config))
    unshared_source = tmp_path / "unshared_source"
    shutil.copytree(source, unshared_source)
    (unshared_source / "genai_config.json").write_text((tmp_path / "source.json").read_text())
    (target / "genai_config.json").write_text((tmp_path / "prepared.json").read_text())
    done = run_script(
        """
        import sys, numpy as np, onnxruntime_genai as og
        import sparse_attention_op as sao
        for label, load, folder in (("ort", og.Model, sys.argv[2]), ("sao", sao.load_genai_model, sys.argv[1])):
            model = load(folder)
            params = og.GeneratorParams(model)
            params.set_search_options(max_length=32)
            generator = og.Generator(model, params)
            try:
                generator.append_tokens(np.arange(2, 10, dtype=np.int32)[None])
            except RuntimeError as error:
                print(label, "RAISED", error)
            else:
                print(label, "NOT RAISED")
        """,
        target,
        unshared_source,
    )
    assert "ort RAISED" in done.stdout, done.stdout + done.stderr  # ORT's own kernel raises here
    raised = next(line for line in done.stdout.splitlines() if line.startswith("sao RAISED"))
    # The op's error reaches GenAI's exception as the node's status, and stderr through
    # logging, naming the node and the rule.
    assert "SparseAttentionWebGPU node" in raised and "'total_sequence_length': must be <= past_key's max_cache_len = 0" in raised, raised
    assert "SparseAttention node model.onnx#0:/model/layers.0/attn/SparseAttention refused a call" in done.stderr, done.stderr
    assert "'total_sequence_length': must be <= past_key's max_cache_len = 0" in done.stderr, done.stderr


def test_refused_call_under_plain_session_raises_and_logs(source):
    done = run_script(
        """
        import sys, numpy as np, onnxruntime as ort
        import sparse_attention_op as sao
        from sparse_attention_op.ort.session import session_options
        path = sys.argv[1]
        feeds = {"input_ids": np.arange(2, 6, dtype=np.int64)[None], "attention_mask": np.ones((1, 4), np.int64)}
        for i in range(3):  # a zero-length past: no room for the prompt
            for kind in ("key", "value"):
                feeds[f"past_key_values.{i}.{kind}"] = np.zeros((1, 2, 0, 16), np.float32)
        prepared = sao.prepare_model(path).SerializeToString()
        for label, session in (("ort", ort.InferenceSession(path, providers=["CPUExecutionProvider"])),
                               ("sao", ort.InferenceSession(prepared, session_options(), providers=["CPUExecutionProvider"]))):
            try:
                session.run(None, feeds)
            except Exception as error:
                print(label, "RAISED", type(error).__name__, error)
            else:
                print(label, "NOT RAISED")
        """,
        source / "model.onnx",
    )
    assert "ort RAISED" in done.stdout and "sao RAISED" in done.stdout, done.stdout + done.stderr
    assert "must be <= past_key's max_cache_len = 0" in next(line for line in done.stdout.splitlines() if line.startswith("sao RAISED"))
    assert "/model/layers.0/attn/SparseAttention refused a call" in done.stderr, done.stderr
    assert "must be <= past_key's max_cache_len = 0" in done.stderr, done.stderr


def test_genai_without_register_fails_to_load(prepared):
    # The library is loaded (GenAI loads it), but the bridge did not add its op in this process.
    done = run_script(
        """
        import sys, onnxruntime_genai as og
        try:
            og.Model(sys.argv[1])
        except RuntimeError as error:
            print("RAISED", error)
        """,
        prepared,
    )
    assert "RAISED" in done.stdout and "SparseAttentionWebGPU" in done.stdout, done.stdout + done.stderr


# -- argument checks ---------------------------------------------------------------------------
def test_prepare_checks_its_arguments(source, prepared, tmp_path):
    with pytest.raises(ValueError, match="kv_check must be one of"):
        sao.prepare_genai_folder(source, tmp_path / "x", kv_check="probe")
    with pytest.raises(FileNotFoundError, match="source must be a GenAI model folder: no genai_config.json"):
        sao.prepare_genai_folder(tmp_path, tmp_path.parent / "x")
    with pytest.raises(ValueError, match="target must lie outside source"):
        sao.prepare_genai_folder(source, source / "inside")
    with pytest.raises(FileExistsError, match="pass overwrite=True"):
        sao.prepare_genai_folder(source, prepared)
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="overwrite replaces only a GenAI model folder"):
        sao.prepare_genai_folder(source, occupied, overwrite=True)
    assert (occupied / "keep.txt").read_text() == "mine"
    with pytest.raises(ValueError, match="already prepared"):
        sao.prepare_genai_folder(prepared, tmp_path / "again")


def test_prepare_refuses_another_custom_ops_library(source, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(source, other)
    config = json.loads((other / "genai_config.json").read_text())
    config["model"]["decoder"]["session_options"]["custom_ops_library"] = "libmine.so"
    (other / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="already name custom_ops_library 'libmine.so'"):
        sao.prepare_genai_folder(other, tmp_path / "target")
    assert not (tmp_path / "target").exists()


def test_overwrite_replaces_a_prepared_folder(source, tmp_path):
    target = sao.prepare_genai_folder(source, tmp_path / "target")
    (target / "stale.txt").write_text("from before")
    first = json.loads((target / genai_module.RECORD_FILE).read_text())["session_token"]
    sao.prepare_genai_folder(source, target, overwrite=True)
    assert not (target / "stale.txt").exists()
    assert json.loads((target / genai_module.RECORD_FILE).read_text())["session_token"] != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"], "no staging folder left behind"


def test_hard_link_failure_names_the_rule_and_leaves_nothing(source, tmp_path, monkeypatch):
    def cross_device(src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(genai_module.os, "link", cross_device)
    with pytest.raises(OSError, match="cannot hard-link onnxruntime-extensions' library") as raised:
        sao.prepare_genai_folder(source, tmp_path / "deep" / "er" / "target")
    assert raised.value.errno == errno.EXDEV
    assert "put target on the filesystem of" in str(raised.value)
    assert list(tmp_path.iterdir()) == [], "the parent folders it made are gone too"


def test_prepare_follows_symbolic_links_as_a_hub_snapshot_lays_them_out(source, tmp_path):
    """A Hugging Face snapshot: every file a link into ../blobs, a linked subfolder too."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshot"
    shutil.copytree(source, blobs)
    snapshot.mkdir()
    for path in blobs.iterdir():
        (snapshot / path.name).symlink_to(Path("..") / "blobs" / path.name)
    (snapshot / "loop").symlink_to(".")  # a cycle: not entered
    (snapshot / "extra_again").symlink_to(Path("..") / "blobs" / "extra")  # a second link to one folder: a second copy
    target = sao.prepare_genai_folder(snapshot, tmp_path / "target")
    for name in ("extra", "extra_again"):
        assert (target / name / "notes.txt").read_bytes() == (source / "extra" / "notes.txt").read_bytes()
    assert not (target / "extra").is_symlink() and (target / "model.onnx").is_file()
    assert not (target / "loop").exists()
    assert json.loads((target / genai_module.RECORD_FILE).read_text())["models"] == ["model.onnx"]


def test_prepare_refuses_a_folder_without_sparse_attention(source, tmp_path):
    other = tmp_path / "dense"
    other.mkdir()
    (other / "genai_config.json").write_text(json.dumps({"model": {"decoder": {"filename": "x.onnx"}}}))
    identity = onnx.helper.make_graph(
        [onnx.helper.make_node("Identity", ["a"], ["b"])],
        "g",
        [onnx.helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, [1])],
        [onnx.helper.make_tensor_value_info("b", onnx.TensorProto.FLOAT, [1])],
    )
    onnx.save(onnx.helper.make_model(identity, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=10), str(other / "x.onnx"))
    with pytest.raises(ValueError, match="no model that genai_config.json names holds a SparseAttention node"):
        sao.prepare_genai_folder(other, tmp_path / "target")
    assert not (tmp_path / "target").exists()


def test_load_refuses_a_copied_library(prepared, tmp_path):
    copied = tmp_path / "copied"
    shutil.copytree(prepared, copied)  # cp -r: the library becomes a copy
    with pytest.raises(RuntimeError, match="must be a hard link to onnxruntime-extensions' library"):
        sao.load_genai_model(copied)
    with pytest.raises(FileNotFoundError, match="prepare it with prepare_genai_folder"):
        sao.load_genai_model(prepared.parent / "source")


def test_load_refuses_a_folder_of_another_bridge_format(prepared, tmp_path):
    older = tmp_path / "older"
    shutil.copytree(prepared, older, copy_function=os.link)  # hard links: only the record differs
    record_path = older / "sparse_attention_op.json"
    record = json.loads(record_path.read_text())
    assert record["bridge_format"] == BRIDGE_FORMAT
    del record["bridge_format"]  # as folders were written before the format was recorded
    record_path.unlink()  # a hard link: replace it, do not write through to `prepared`
    record_path.write_text(json.dumps(record))
    with pytest.raises(RuntimeError, match=f"bridge format 1; this version runs format {BRIDGE_FORMAT}: prepare the folder again"):
        sao.load_genai_model(older)


# -- the bundled models ---------------------------------------------------------------------
@pytest.mark.parametrize("name", ["phi3-small-tiny", "phi3-small-tiny-f16"])
def test_bundled_models_under_genai(og, name, tmp_path):
    """models/ as GenAI folders: float32 and float16, four layers (two of them GroupQueryAttention)."""
    from sparse_attention_op.generation.loop import divergences, generate

    source = Path(__file__).resolve().parent.parent / "models" / name
    prepared = sao.prepare_genai_folder(source, tmp_path / "prepared")
    prompts = np.random.default_rng(5).integers(2, 512, (2, PROMPT_LEN)).astype(np.int32)
    ours = genai_generate(og, sao.load_genai_model(prepared), prompts)
    theirs = genai_generate(og, og.Model(str(source)), prompts)
    eos = json.loads((source / "genai_config.json").read_text())["model"]["eos_token_id"]
    mine = generate(source / "model.onnx", prompts.tolist(), NEW_TOKENS, stop_tokens=[eos]).tokens
    # GenAI pads a row that stopped early; generate's rows end at their stop token.
    assert [row[: len(mine[b])] for b, row in enumerate(ours)] == mine, f"{name}: GenAI against sparse_attention_op.generate"
    if name.endswith("f16"):
        # float16 logits tie often (one ulp is 0.008 at 10): ORT's float16 kernel rounds
        # differently from this op (docs/genai.md), so tokens may part at a near-tie, never elsewhere.
        plain = ort.InferenceSession(str(source / "model.onnx"), providers=["CPUExecutionProvider"])
        real = [d for d in divergences(plain, prompts.tolist(), ours, theirs) if not d.near_tie]
        assert not real, "; ".join(d.describe() for d in real)
    else:
        assert ours == theirs, f"{name}: GenAI with this op against ORT's kernel"


# -- caches the op holds (sparse_caches="op") --------------------------------------------------
@pytest.fixture(scope="module")
def held(source) -> Path:
    return sao.prepare_genai_folder(source, source.parent / "held", sparse_caches="op")


def test_held_folder_binds_only_the_dense_layers_caches(held):
    model = onnx.load(str(held / "model.onnx"))
    pasts = sorted(i.name for i in model.graph.input if i.name.startswith("past_key_values."))
    presents = sorted(o.name for o in model.graph.output if o.name.startswith("present."))
    # Layers 0 and 1 are SparseAttention, layer 2 GroupQueryAttention.
    assert pasts == ["past_key_values.2.key", "past_key_values.2.value"]
    assert presents == ["present.2.key", "present.2.value"]
    for node in bridge_nodes(model):
        assert list(node.input[3:5]) == ["", ""] and list(node.output) == [node.output[0]]
    assert json.loads((held / genai_module.RECORD_FILE).read_text())["sparse_caches"] == "op"


def test_held_caches_give_the_tokens_of_orts_kernel(og, held, prompts, ort_kernel_tokens):
    """Two rows, twice in a row (the second prompt starts each node's sequence over); then
    one row rewound into its history, which goes on from there."""
    model = sao.load_genai_model(held)
    assert genai_generate(og, model, prompts) == ort_kernel_tokens
    assert genai_generate(og, model, prompts) == ort_kernel_tokens
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=MAX_LENGTH, batch_size=1)
    generator = og.Generator(model, params)
    generator.append_tokens(prompts[:1])
    for _ in range(10):
        generator.generate_next_token()
    generator.rewind_to(PROMPT_LEN)
    generator.append_tokens(np.array([ort_kernel_tokens[0][:5]], np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    assert [int(t) for t in generator.get_sequence(0)][PROMPT_LEN:] == ort_kernel_tokens[0]


def test_held_caches_at_an_8k_prompt_give_the_tokens_of_orts_kernel(og, tmp_path):
    """A long context end to end on the host: a float16 decoder, a prompt of 8192 tokens, then
    greedy tokens through GenAI with the caches held, against GenAI on ORT's own kernels."""
    config = dataclasses.replace(CONFIG, dtype="float16", max_position=8256)
    source = tmp_path / "source"
    write_model_folder(config, source)
    held = sao.prepare_genai_folder(source, tmp_path / "held", sparse_caches="op")
    prompt = np.random.default_rng(8192).integers(2, config.vocab_size, (1, 8192)).astype(np.int32)

    def tokens(folder_model) -> list[int]:
        params = og.GeneratorParams(folder_model)
        params.set_search_options(max_length=8192 + 8)
        generator = og.Generator(folder_model, params)
        generator.append_tokens(prompt)
        while not generator.is_done():
            generator.generate_next_token()
        return [int(t) for t in generator.get_sequence(0)][8192:]

    expected = tokens(og.Model(str(source)))
    assert len(expected) == 8 and tokens(sao.load_genai_model(held)) == expected


def test_a_held_cache_refuses_a_sequence_it_does_not_hold(source, prompts, tmp_path):
    """A plain session over a fresh held folder's model: a decode step whose history the
    nodes never saw is refused, naming the input; the session then runs a prompt as ever."""
    held = sao.prepare_genai_folder(source, tmp_path / "held", sparse_caches="op")
    sao.register()
    session = ort.InferenceSession(str(held / "model.onnx"), sao.session_options())
    batch, past = 1, 10
    zeros = np.zeros((batch, CONFIG.kv_num_heads, past, CONFIG.head_size), np.float32)
    feeds = {
        "input_ids": np.array([[5]], np.int64),
        "attention_mask": np.ones((batch, past + 1), np.int64),
        "past_key_values.2.key": zeros,
        "past_key_values.2.value": zeros,
    }
    with pytest.raises(Exception, match=r"key_total_sequence_lengths.*holds 0 of them"):
        session.run(None, feeds)
    prompt = {
        "input_ids": prompts[:1, :past].astype(np.int64),
        "attention_mask": np.ones((batch, past), np.int64),
        "past_key_values.2.key": zeros[:, :, :0],
        "past_key_values.2.value": zeros[:, :, :0],
    }
    logits = session.run(["logits"], prompt)[0]
    assert np.isfinite(logits).all()


def test_held_caches_are_refused_without_another_cache(tmp_path):
    only_sparse = DecoderConfig(**{**CONFIG.__dict__, "dense_every": 0})
    source = tmp_path / "sparse-only"
    write_model_folder(only_sparse, source)
    with pytest.raises(ValueError, match="no cache input"):
        sao.prepare_genai_folder(source, tmp_path / "held", sparse_caches="op")
    assert not (tmp_path / "held").exists()
    with pytest.raises(ValueError, match="sparse_caches must be one of"):
        sao.prepare_genai_folder(source, tmp_path / "held", sparse_caches="device")


def test_generate_runs_a_held_model(source, prompts, ort_kernel_tokens, tmp_path):
    """sparse_attention_op.generate binds the caches a model has as inputs and no others."""
    from sparse_attention_op.generation.loop import generate

    held = sao.prepare_genai_folder(source, tmp_path / "held", sparse_caches="op")
    sao.register()
    session = ort.InferenceSession(str(held / "model.onnx"), sao.session_options())
    tokens = generate(session, prompts.tolist(), NEW_TOKENS).tokens
    assert [list(map(int, row)) for row in tokens] == ort_kernel_tokens


def test_a_held_node_keeps_its_sequence_through_a_refused_call_and_names_a_present(source, prompts, tmp_path):
    """A call refused on a held node (another batch, continuing a sequence the node lacks)
    leaves the sequence it holds in place; a held node asked for a present is refused by name."""
    held = sao.prepare_genai_folder(source, tmp_path / "held", sparse_caches="op")
    sao.register()
    session = ort.InferenceSession(str(held / "model.onnx"), sao.session_options())
    past = 10

    def feeds(ids, cache_rows):
        batch = len(ids)
        zeros = np.zeros((batch, CONFIG.kv_num_heads, cache_rows, CONFIG.head_size), np.float32)
        width = cache_rows + ids.shape[1]
        return {
            "input_ids": ids.astype(np.int64),
            "attention_mask": np.ones((batch, width), np.int64),
            "past_key_values.2.key": zeros,
            "past_key_values.2.value": zeros,
        }

    session.run(["logits"], feeds(prompts[:1, :past], 0))  # the node now holds 10 rows of one sequence
    with pytest.raises(Exception, match=r"key_total_sequence_lengths.*holds 0 of them"):
        session.run(["logits"], feeds(np.array([[5], [6]]), past))  # two rows: a sequence it does not hold
    logits = session.run(["logits"], feeds(np.array([[5]]), past))[0]  # the held sequence goes on
    assert np.isfinite(logits).all()

    model = onnx.load(str(held / "model.onnx"))
    node = bridge_nodes(model)[0]
    node.output.append("")
    node.output[1] = "asked_present"
    model.graph.output.append(onnx.helper.make_tensor_value_info("asked_present", onnx.TensorProto.FLOAT, None))
    asking = ort.InferenceSession(model.SerializeToString(), sao.session_options())
    with pytest.raises(Exception, match=r"present_key': must be absent when past_key and past_value are"):
        asking.run(["logits"], feeds(prompts[:1, :past], 0))


def test_a_held_node_names_its_capacity_when_a_sequence_outgrows_it(source, tmp_path):
    held = sao.prepare_genai_folder(source, tmp_path / "held", sparse_caches="op")
    sao.register()
    session = ort.InferenceSession(str(held / "model.onnx"), sao.session_options())
    too_long = CONFIG.max_position + 1
    zeros = np.zeros((1, CONFIG.kv_num_heads, 0, CONFIG.head_size), np.float32)
    feeds = {
        "input_ids": np.full((1, too_long), 5, np.int64),
        "attention_mask": np.ones((1, too_long), np.int64),
        "past_key_values.2.key": zeros,
        "past_key_values.2.value": zeros,
    }
    with pytest.raises(Exception, match=rf"the node holds its cache: its past_key is a buffer of the {CONFIG.max_position} rows"):
        session.run(["logits"], feeds)
