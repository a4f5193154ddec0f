"""scripts/bench_generate.py end to end on a bundled decoder: rows, agreement and the failure row.

The GPU configurations need ORT's WebGPU plugin EP to find an adapter; where it finds none
(lavapipe) their rows must say so rather than stop the run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_bench(tmp_path, *configs: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "rows.json"
    command = [
        sys.executable,
        str(REPO / "scripts" / "bench_generate.py"),
        "--model",
        str(REPO / "models" / "phi3-small-tiny"),
        "--configs",
        *configs,
        "--prompts",
        "40",
        "100",
        "--new-tokens",
        "6",
        "--warm-lengths",
        "--json",
        str(out),
        "--plot",
        str(tmp_path / "rates.png"),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO)
    return done, json.loads(out.read_text())


def test_each_configuration_measures_every_prompt_and_agrees_with_the_first(tmp_path):
    done, document = run_bench(tmp_path, "b", "a")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = document["rows"]
    assert [(r["config"], r["prompt"]) for r in rows] == [("b", 40), ("b", 100), ("a", 40), ("a", 100)]
    assert [r["agreement"] for r in rows] == ["reference", "reference", "identical to b", "identical to b"]
    assert all(len(r["tokens"]) == 6 and r["prompt_tokens_per_second"] > 0 and r["decode_tokens_per_second"] > 0 for r in rows)
    assert (tmp_path / "rates.png").stat().st_size > 0
    # A second run into the same JSON is judged against the first run's reference rows.
    done, document = run_bench(tmp_path, "a")
    assert [r["agreement"] for r in document["rows"][4:]] == ["identical to b", "identical to b"]


def test_a_configuration_that_cannot_run_is_a_row_that_says_why(tmp_path):
    from sparse_attention_op.ort.providers import ExecutionProviderError, webgpu_plugin

    try:
        webgpu_plugin()
    except ExecutionProviderError as error:
        reason = str(error)
    else:
        reason = None
    done, document = run_bench(tmp_path, "d", "a")
    if reason is None:  # a GPU machine: both configurations run
        assert all("error" not in r for r in document["rows"]), document["rows"]
        return
    (failed, *others) = document["rows"]
    assert failed["config"] == "d" and reason in failed["error"]
    assert [(r["config"], r["agreement"]) for r in others] == [("a", "reference"), ("a", "reference")]
