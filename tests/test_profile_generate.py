"""scripts/profile_generate.py end to end on a bundled decoder: ORT's node kinds and the op's phases."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXECUTOR_PHASES = {"sync", "prepare", "encode_submit", "while_gpu_runs", "wait_read", "record"}


def test_the_profile_splits_prompt_and_step_by_node_kind_and_the_op_by_phase(tmp_path):
    out = tmp_path / "profile.json"
    command = [sys.executable, str(REPO / "scripts" / "profile_generate.py"), "--model", str(REPO / "models" / "phi3-small-tiny")]
    command += ["--configs", "b", "--prompt", "48", "--steps", "3", "--json", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    (found,) = json.loads(out.read_text())["profiles"]
    assert found["config"] == "b" and found["prompt_tokens"] == 48
    for phase in ("prompt", "decode"):
        kinds = {(op, ep): count for op, ep, _, count in found[phase]["kinds"]}
        assert kinds[("SparseAttentionWebGPU", "CPU")] == 2  # the tiny decoder's two SparseAttention layers
        assert kinds[("GroupQueryAttention", "CPU")] == 2
        phases = found["op_phases"][phase]
        assert EXECUTOR_PHASES | {"inputs", "outputs"} <= set(phases) and all(seconds >= 0 for seconds in phases.values())
        assert f"The op's phases, {phase}:" in done.stdout
    assert found["prompt"]["seconds"] > 0 and found["decode"]["seconds"] > 0
