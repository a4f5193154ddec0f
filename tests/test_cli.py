"""The command line, as a user runs it: every command's output, exit status and error line.

Most cases call cli.main in this process (fast); the console script and ``python -m`` run
once each as real subprocesses.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from sparse_attention_op.cli import parser as cli
from sparse_attention_op.generation.loop import generate

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "models" / "phi3-small-tiny"
TINY_F16 = REPO / "models" / "phi3-small-tiny-f16"


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, *fragments: str) -> None:
    assert code == 1, err
    lines = [line for line in err.splitlines() if line.startswith("sparse-attention-op ")]
    assert len(lines) == 1, f"one error line expected, got:\n{err}"
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"


def test_console_script_and_module_print_help():
    script = Path(sys.executable).parent / "sparse-attention-op"
    for command in ([str(script), "--help"], [sys.executable, "-m", "sparse_attention_op", "generate", "--help"]):
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert "usage: sparse-attention-op" in done.stdout
    assert "--max-new-tokens" in done.stdout and "--compare-ort" in done.stdout


def test_info_reports_the_chosen_adapter(capsys):
    code, out, _ = run_cli(capsys, "info", "--json", "-")
    report = json.loads(out)
    assert code == 0 and report["versions"]["wgpu"] and report["adapters"]
    chosen = report["chosen"]
    assert chosen["description"] == report["adapters"][0]["description"]
    assert set(chosen["features"]) == {"shader-f16", "timestamp-query", "subgroup", "memory-decoration-coherent"}
    assert chosen["limits"]["max-storage-buffer-binding-size"] > 0 and chosen["routes"]
    code, out, _ = run_cli(capsys, "info")
    assert code == 0 and "chosen: " in out and "routes at Phi-3-small's shape" in out


def test_an_adapter_choice_that_matches_nothing_is_named(capsys, monkeypatch):
    """Not "install a driver": the driver is there, the environment's choice is what is wrong."""
    monkeypatch.setenv("SAO_ADAPTER", "no-such-adapter")
    named = "SAO_ADAPTER='no-such-adapter' matches none of wgpu's adapters"
    code, _, err = run_cli(capsys, "adapters")
    assert_one_line_error(code, err, "adapters: error:", named)
    code, out, _ = run_cli(capsys, "info")
    assert code == 1 and named in out and "apt-get" not in out
    monkeypatch.delenv("SAO_ADAPTER")
    code, out, _ = run_cli(capsys, "adapters", "--native")
    assert code == 0 and out.strip()


def test_inspect_a_genai_folder(capsys):
    code, out, _ = run_cli(capsys, "inspect", TINY, "--json", "-")
    report = json.loads(out)
    assert code == 0 and len(report["nodes"]) == 2  # layers 0 and 2; 1 and 3 are GroupQueryAttention
    assert report["nodes"][0]["attributes"]["sparse_block_size"] == 16
    [layout] = report["layouts"]
    assert layout["num_layout"] == 8 and len(layout["density"]) == 8 and all(0 < d < 1 for d in layout["density"])
    assert report["placement"]["ONNX Runtime CPU"]["com.microsoft.GroupQueryAttention"] == 2
    assert report["refused"] is None
    code, out, _ = run_cli(capsys, "inspect", TINY / "model.onnx")
    assert code == 0 and "SparseAttention nodes: 2" in out and "density (selected/causal blocks)" in out
    assert out.rstrip().endswith("create_session loads this model")


def test_inspect_says_when_create_session_would_refuse_the_model(capsys, tmp_path):
    """Every weight in external files (layouts included); then one layer's layout broken."""
    model = onnx.load(str(TINY / "model.onnx"))
    onnx.save(
        model, str(tmp_path / "external.onnx"), save_as_external_data=True, all_tensors_to_one_file=True, location="weights.bin", size_threshold=0
    )
    code, out, err = run_cli(capsys, "inspect", tmp_path / "external.onnx")
    assert code == 0 and out.rstrip().endswith("create_session loads this model"), out + err
    model = onnx.load(str(TINY / "model.onnx"))  # saving with external data rewrote the first copy's tensors
    layout = next(n for n in model.graph.node if n.op_type == "SparseAttention").input[5]  # block_row_indices
    rows = next(t for t in model.graph.initializer if t.name == layout)
    broken = onnx.numpy_helper.to_array(rows).copy()
    broken[0, 1] = broken[0, 2] + 1  # row offsets must not decrease
    rows.CopyFrom(onnx.numpy_helper.from_array(broken, layout))
    onnx.save(model, str(tmp_path / "broken_layout.onnx"))
    code, out, _ = run_cli(capsys, "inspect", tmp_path / "broken_layout.onnx", "--json", "-")
    assert code == 1 and "block_row_indices" in json.loads(out)["refused"]
    code, out, _ = run_cli(capsys, "inspect", tmp_path / "broken_layout.onnx")
    assert code == 1 and "create_session refuses this model: " in out
    # A prepared model belongs to its session or folder: inspect says so, run and generate refuse it.
    import sparse_attention_op as sao

    onnx.save(sao.prepare_model(TINY / "model.onnx"), str(tmp_path / "prepared.onnx"))
    code, out, _ = run_cli(capsys, "inspect", tmp_path / "prepared.onnx")
    assert code == 1 and "refuses this model: the model is prepared already" in out
    code, _, err = run_cli(capsys, "generate", tmp_path / "prepared.onnx", "--prompt-ids", "5", "--max-new-tokens", 2, "--no-progress")
    assert_one_line_error(code, err, "the model is prepared already")


def test_inspect_refuses_what_is_not_a_model(capsys, tmp_path):
    (tmp_path / "broken.onnx").write_bytes(b"not a protobuf at all \xff\xfe")
    code, _, err = run_cli(capsys, "inspect", tmp_path / "broken.onnx")
    assert_one_line_error(code, err, "broken.onnx", "not an ONNX model")
    code, _, err = run_cli(capsys, "inspect", tmp_path)
    assert_one_line_error(code, err, "without genai_config.json")
    (tmp_path / "genai_config.json").write_text('{"model": [1]}')
    code, _, err = run_cli(capsys, "inspect", tmp_path)
    assert_one_line_error(code, err, "genai_config.json: model must be a JSON object, got list")


@pytest.mark.parametrize("folder", [TINY, TINY_F16], ids=["float32", "float16"])
def test_run_agrees_with_ort_cpu(capsys, folder, tmp_path):
    code, out, err = run_cli(capsys, "run", folder, "--seq", 6, "--past", 34, "--capacity", 64, "--compare-ort", "--save", tmp_path / "out.npz")
    assert code == 0, err
    table = [line.split() for line in out.splitlines() if line.startswith(("logits", "present."))]
    assert len(table) == 9 and all(row[-1] == "yes" for row in table), out
    with np.load(tmp_path / "out.npz") as saved:
        assert saved["logits"].shape == (1, 6, 512)


def test_run_with_given_feeds_and_their_errors(capsys, tmp_path):
    graph = tmp_path / "graph.onnx"
    feeds = tmp_path / "feeds.npz"
    code, _, err = run_cli(capsys, "export", "graph", graph, "--rotary", "--packed", "--past", 20, "--inputs", feeds)
    assert code == 0, err
    code, out, err = run_cli(capsys, "run", graph, "--feeds", feeds, "--compare-ort")
    assert code == 0 and out.count(" yes") == 3, out + err
    with np.load(feeds) as archive:
        partial = {name: archive[name] for name in archive.files if name != "query"}
    np.savez(tmp_path / "partial.npz", **partial)
    code, _, err = run_cli(capsys, "run", graph, "--feeds", tmp_path / "partial.npz")
    assert_one_line_error(code, err, "partial.npz lacks graph input(s) 'query'")


def test_export_keeps_what_exists_and_names_what_it_writes(capsys, tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "model.onnx").write_text("keep")
    code, _, err = run_cli(capsys, "export", "decoder", folder, "--layers", 2)
    assert_one_line_error(code, err, "already holds model.onnx (a model folder): pass --overwrite")
    assert (folder / "model.onnx").read_text() == "keep"
    code, out, err = run_cli(capsys, "export", "decoder", folder, "--layers", 2, "--overwrite")
    assert code == 0 and (folder / "genai_config.json").is_file(), err
    # np.savez adds .npz to a name without it: the message names the file written, and
    # run says plainly when a --feeds file is not there.
    code, out, err = run_cli(capsys, "export", "graph", tmp_path / "g.onnx", "--inputs", tmp_path / "feeds")
    assert code == 0 and f"wrote {tmp_path / 'feeds.npz'}" in out and (tmp_path / "feeds.npz").is_file(), err
    code, _, err = run_cli(capsys, "run", tmp_path / "g.onnx", "--feeds", tmp_path / "feeds")
    assert_one_line_error(code, err, f"--feeds {tmp_path / 'feeds'}: no such file")


def test_an_exported_graph_runs_without_being_told_its_head_size(capsys, tmp_path):
    graph = tmp_path / "graph.onnx"
    code, _, err = run_cli(capsys, "export", "graph", graph, "--rotary", "--rotary-dim", 16, "--head-size", 48, "--packed")
    assert code == 0, err
    code, out, err = run_cli(capsys, "run", graph, "--past", 5, "--compare-ort")
    assert code == 0 and out.count(" yes") == 3, out + err
    assert "query [1, 8, 384]" in out and "cos_cache [13, 8]" in out  # (4 + 2 * 2) * 48; rotary_dim / 2


@pytest.mark.parametrize(
    "options, message",
    [
        (["--head-size", 12], "SparseAttention input 'query': head_size must be a positive multiple of 8, got 12"),
        (["--block", 12, "--max-cache-len", 48], "'sparse_block_size': must be a positive power of two"),
        (["--rotary", "--rotary-dim", 8], "'cos_cache': dimension 1 (rotary_dim / 2) must be a positive multiple of 8"),
        (["--rotary", "--head-size", 24], "head_size must be a multiple of 16 when do_rotary = 1"),
        (["--rotary-dim", 16], "--rotary-dim applies to the rotary embedding: add --rotary"),
        (["--interleaved"], "--interleaved applies to the rotary embedding: add --rotary"),
        (["--past", -2], "--past must be >= 0, got -2"),
        (["--local-blocks", -1], "--local-blocks must be >= 0"),
        (["--vert-stride", 0], "--vert-stride must be at least 1"),
    ],
)
def test_export_graph_refuses_what_the_op_would_refuse(capsys, tmp_path, options, message):
    """Usage errors, as argparse's own: the command's usage, one error line, exit 2."""
    graph = tmp_path / "graph.onnx"
    with pytest.raises(SystemExit) as usage:
        cli.main(["export", "graph", str(graph), *map(str, options)])
    err = capsys.readouterr().err
    assert usage.value.code == 2 and "usage: sparse-attention-op export graph" in err
    assert "sparse-attention-op export graph: error: " in err and message in err
    assert not graph.exists()


def test_generate_json_matches_the_api_and_ort(capsys, tmp_path):
    out_json = tmp_path / "tokens.json"
    code, out, err = run_cli(
        capsys,
        "generate",
        TINY,
        "--prompt-ids",
        "5,17,33",
        "--prompt-ids",
        "9,8,7,6,5,4,3,2,40,41",
        "--max-new-tokens",
        12,
        "--compare-ort",
        "--no-stop",
        "--json",
        out_json,
        "--no-progress",
    )
    assert code == 0, err
    assert "ONNX Runtime's CPU kernel: identical tokens" in out
    document = json.loads(out_json.read_text())
    assert isinstance(document["ms_per_token"], float) and document["ms_per_token"] > 0
    expected = generate(str(TINY), [[5, 17, 33], [9, 8, 7, 6, 5, 4, 3, 2, 40, 41]], 12).tokens
    assert document["tokens"] == expected == document["ort_cpu_tokens"]


def test_generate_stops_at_the_folders_eos(capsys, tmp_path):
    # A folder whose eos is the third token greedy decoding emits: generation stops there.
    free = generate(str(TINY), [[5, 17, 33]], 8).tokens[0]
    folder = tmp_path / "eos"
    folder.mkdir()
    (folder / "model.onnx").write_bytes((TINY / "model.onnx").read_bytes())
    config = json.loads((TINY / "genai_config.json").read_text())
    config["model"]["eos_token_id"] = free[2]
    (folder / "genai_config.json").write_text(json.dumps(config))
    code, out, err = run_cli(capsys, "generate", folder, "--prompt-ids", "5,17,33", "--max-new-tokens", 8, "--json", "-", "--no-progress")
    assert code == 0, err
    document = json.loads(out[out.index("{") :])
    assert document["tokens"] == [free[: free.index(free[2]) + 1]]


def test_generate_errors_are_one_line(capsys):
    code, _, err = run_cli(capsys, "generate", TINY, "--prompt-ids", "5,9999", "--max-new-tokens", 3)
    assert_one_line_error(code, err, "token id(s) [9999] outside the vocabulary [0, 512)")
    code, _, err = run_cli(capsys, "generate", TINY, "--prompt-ids", "1,2", "--max-new-tokens", 600)
    assert_one_line_error(code, err, "more than the model's context of 512 tokens")
    # Messages name the options, not generate()'s arguments.
    code, _, err = run_cli(capsys, "generate", TINY, "--prompt-ids", "1,2", "--max-new-tokens", 6, "--capacity", 5)
    assert_one_line_error(code, err, "--capacity must be an int that holds the longest prompt plus --max-new-tokens = 8 rows")
    code, _, err = run_cli(capsys, "generate", TINY, "--prompt-ids", "1,2", "--max-new-tokens", 3, "--stop-ids", "9999")
    assert_one_line_error(code, err, "the stop ids (--stop-ids, or the folder's eos_token_id) [9999] lie outside the vocabulary")
    with pytest.raises(SystemExit) as usage:
        cli.main(["generate", str(TINY), "--prompt-ids", "five"])
    assert usage.value.code == 2
    assert "token ids separated by commas or spaces" in capsys.readouterr().err
    # Spaces separate ids too; an empty part is a mistake, never skipped.
    assert cli._token_ids("5 17, 33") == [5, 17, 33]
    with pytest.raises(Exception, match="separated by commas or spaces"):
        cli._token_ids("5,,17")


def test_export_decoder_then_generate_and_inspect(capsys, tmp_path):
    folder = tmp_path / "custom"
    code, out, err = run_cli(capsys, "export", "decoder", folder, "--layers", 2, "--dtype", "float16", "--seed", 5, "--dense-every", 0)
    assert code == 0 and (folder / "genai_config.json").is_file(), err
    model = onnx.load(str(folder / "model.onnx"))
    assert sum(n.op_type == "SparseAttention" for n in model.graph.node) == 2
    code, out, err = run_cli(capsys, "generate", folder, "--prompt-ids", "3,4,5,6", "--max-new-tokens", 6, "--compare-ort", "--no-progress")
    assert code == 0 and "identical tokens" in out, err
    code, _, err = run_cli(capsys, "export", "decoder", tmp_path / "bad", "--num-heads", 5)
    assert_one_line_error(code, err, "num_heads (5) must be a multiple of kv_num_heads")


def test_bench_writes_json_and_a_plot(capsys, tmp_path):
    code, out, err = run_cli(
        capsys,
        "bench",
        "--prefill",
        128,
        "--decode",
        127,
        "--capacity",
        256,
        "--layouts",
        "dense",
        "--reps",
        1,
        "--json",
        tmp_path / "bench.json",
        "--plot",
        tmp_path / "bench.png",
    )
    assert code == 0, err
    document = json.loads((tmp_path / "bench.json").read_text())
    assert [row["kind"] for row in document["rows"]] == ["prefill", "decode"]
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "every spot check passed" in out


def test_options_that_would_be_ignored_are_refused(capsys, monkeypatch):
    def usage_error(*argv) -> str:
        with pytest.raises(SystemExit) as usage:
            cli.main([str(a) for a in argv])
        assert usage.value.code == 2
        return capsys.readouterr().err

    assert "--temperature, --seed only apply with --sample" in usage_error("generate", TINY, "--prompt-ids", "5", "--temperature", 0.5, "--seed", 3)
    assert "--top-k only apply with --sample" in usage_error("generate", TINY, "--prompt-ids", "5", "--top-k", 4)
    assert "--no-stop and --stop-ids contradict" in usage_error("generate", TINY, "--prompt-ids", "5", "--no-stop", "--stop-ids", "7")
    monkeypatch.setattr("sparse_attention_op.benchmarking.sweep.import_torch_cuda", lambda: None)
    assert "--torch needs torch with a CUDA device" in usage_error("bench", "--quick", "--torch")
    assert "name no case" in usage_error("bench", "--quick", "--prefill", "--decode")
    assert "--prefill lengths must be at least 1, got -5" in usage_error("bench", "--quick", "--prefill", -5)
    assert "--fp32-tflops must be > 0" in usage_error("bench", "--quick", "--fp32-tflops", 0)
    assert "argument --batch: expected an integer, got 'abc'" in usage_error("run", TINY, "--batch", "abc")
    assert "argument --past: must be >= 0, got -3" in usage_error("run", TINY, "--past", -3)
    # --traceback after the command's name: the whole traceback instead of one line.
    with pytest.raises(Exception, match="no such file or folder"):
        cli.main(["run", "/no/such/model.onnx", "--traceback"])
    code, _, err = run_cli(capsys, "run", TINY, "--dim", "total_sequnce_length=9")
    assert_one_line_error(code, err, "--dim total_sequnce_length: no graph input has a dim of that name", "total_sequence_length")
    # Sizes the model fixes win over the options, and a note says so.
    code, _, err = run_cli(capsys, "run", REPO / "models" / "demo_decoder_attention.onnx", "--capacity", 100, "--head-size", 64)
    assert code == 0 and "note: --capacity 100 does not apply to 'past_key': the model fixes its axis 2 at 256 rows" in err, err
    assert "note: --head-size 64 does not apply: the model declares head size 32" in err
    # Given with --sample, they reach the sampler.
    code, out, err = run_cli(
        capsys,
        "generate",
        TINY,
        "--prompt-ids",
        "5",
        "--max-new-tokens",
        2,
        "--sample",
        "--temperature",
        0.5,
        "--top-k",
        3,
        "--seed",
        1,
        "--json",
        "-",
        "--no-progress",
    )
    assert code == 0 and len(json.loads(out)["tokens"][0]) == 2, err


def test_demo_passes(capsys):
    code, out, err = run_cli(capsys, "demo", "--prompt", 20, "--steps", 6)
    assert code == 0, out + err
    assert "identical tokens" in out and "OK" in out and "tokens/s" in out


def test_edge_cases_a_user_meets(capsys, tmp_path):
    # --json - : stdout is the JSON alone, the report goes to stderr.
    code, out, err = run_cli(capsys, "generate", TINY, "--prompt-ids", "5 17 33", "--max-new-tokens", 3, "--json", "-", "--no-progress")
    assert code == 0 and json.loads(out)["tokens"][0] and "row 0: prompt 5,17,33" in err
    # One new token comes from the prompt alone: no decode figure is claimed.
    code, _, err = run_cli(capsys, "generate", TINY, "--prompt-ids", "5", "--max-new-tokens", 1, "--json", "-", "--no-progress")
    assert code == 0 and "one token per row, from the prompt" in err
    # Sampled runs are compared but not judged.
    code, out, _ = run_cli(
        capsys, "generate", TINY, "--prompt-ids", "5,6", "--prompt-ids", "7", "--max-new-tokens", 4, "--sample", "--compare-ort", "--no-progress"
    )
    assert code == 0 and "not judged" in out
    # --save names the file np.savez writes; --feeds that is no .npz archive is refused clearly.
    code, out, _ = run_cli(capsys, "run", TINY, "--seq", 4, "--save", tmp_path / "outputs")
    assert code == 0 and f"wrote {tmp_path / 'outputs.npz'}" in out and (tmp_path / "outputs.npz").is_file()
    np.save(tmp_path / "one.npy", np.zeros(3))
    code, _, err = run_cli(capsys, "run", TINY, "--feeds", tmp_path / "one.npy")
    assert_one_line_error(code, err, "a single array, not an .npz archive")
    code, _, err = run_cli(capsys, "demo", "--model", REPO / "models" / "demo_decoder_attention.onnx")
    assert_one_line_error(code, err, "the demo runs an ORT GenAI decoder folder")
    with pytest.raises(SystemExit):
        cli.main(["bench", "--json", "-"])
    assert "--json needs a file path here" in capsys.readouterr().err
    # An RMS-norm decoder (ORT's SimplifiedLayerNormalization) exports and generates.
    code, _, err = run_cli(capsys, "export", "decoder", tmp_path / "rms", "--norm", "rms", "--layers", 2)
    assert code == 0, err
    code, out, err = run_cli(capsys, "generate", tmp_path / "rms", "--prompt-ids", "3,4", "--max-new-tokens", 4, "--compare-ort", "--no-progress")
    assert code == 0 and "identical tokens" in out, err
