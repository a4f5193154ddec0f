"""Whole-model configurations (a)-(e) and where their time goes.

The two whole-model scripts share them: ``scripts/bench_generate.py`` times generation in each
configuration, ``scripts/profile_generate.py`` splits one configuration's prompt and decode
steps by node kind from ONNX Runtime's own profiler.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

from sparse_attention_op.generation.genai import load_genai_model, prepare_genai_folder
from sparse_attention_op.generation.loop import generate
from sparse_attention_op.generation.model_files import resolve
from sparse_attention_op.ort.providers import add_ep
from sparse_attention_op.ort.session import create_session

CONFIGS = {
    "a": "ORT CPU EP alone",
    "b": "this package + ORT CPU EP",
    "c": "ORT WebGPU plugin EP alone",
    "d": "this package + ORT WebGPU plugin EP",
    "e": "d through ORT GenAI (SparseAttention caches held by the op)",
}


class Runner:
    """One configuration's session (or GenAI model) and how to generate with it.

    ``sess_options`` (not for e) are the base of the session's options, e.g. with ORT's
    profiler on."""

    def __init__(self, config: str, folder: Path, ep_options: dict, sess_options: ort.SessionOptions | None = None):
        if config not in CONFIGS:
            raise ValueError(f"unknown configuration {config!r}; known: {sorted(CONFIGS)}")
        if config == "e" and sess_options is not None:
            raise ValueError("configuration e runs through ORT GenAI, which takes no SessionOptions")
        self.config, self.folder = config, folder
        path = str(resolve(folder).onnx_path)
        if config == "a":
            self.session = ort.InferenceSession(path, sess_options, providers=["CPUExecutionProvider"])
        elif config == "b":
            self.session = create_session(path, sess_options, kv_check="fast", last_logits=True)
        elif config == "c":
            options = sess_options or ort.SessionOptions()
            add_ep(options, "webgpu", ep_options)
            self.session = ort.InferenceSession(path, options)
        elif config == "d":
            self.session = create_session(path, sess_options, kv_check="fast", ep="webgpu", ep_options=ep_options, last_logits=True)
        else:
            self._staging = tempfile.TemporaryDirectory(prefix="genai-", dir=folder.parent)
            prepared = prepare_genai_folder(folder, Path(self._staging.name) / "prepared", sparse_caches="op")
            self.model = load_genai_model(prepared, ep="webgpu", ep_options=ep_options)
            self.session = None

    def generate(self, prompt: list[int], new_tokens: int) -> tuple[list[int], float, list[float]]:
        """(new tokens, prompt seconds, decode step seconds)."""
        if self.session is not None:
            result = generate(self.session, [prompt], new_tokens, stop_tokens=())
            return result.tokens[0], result.prompt_seconds, result.step_seconds
        import onnxruntime_genai as og

        params = og.GeneratorParams(self.model)
        params.set_search_options(max_length=len(prompt) + new_tokens, do_sample=False)
        generator = og.Generator(self.model, params)
        start = time.perf_counter()
        generator.append_tokens(np.array([prompt], np.int32))
        generator.generate_next_token()
        tokens = [int(generator.get_next_tokens()[0])]
        prompt_seconds, steps = time.perf_counter() - start, []
        while len(tokens) < new_tokens and not generator.is_done():
            start = time.perf_counter()
            generator.generate_next_token()
            tokens.append(int(generator.get_next_tokens()[0]))
            steps.append(time.perf_counter() - start)
        return tokens, prompt_seconds, steps


@dataclass
class RunProfile:
    """One ``session.run`` from ORT's profile: its wall time and its nodes' times by kind.

    A kind is (op type, EP). An EP that queues GPU work (WebGPU) reports the time its
    kernels take to record it; the GPU's own time then shows where the host waits for it
    (a copy to the host). ``between`` is the run's time outside every node."""

    seconds: float
    kinds: dict[tuple[str, str], list[float]] = field(default_factory=dict)  # kind -> [seconds, count]

    @property
    def between(self) -> float:
        return self.seconds - sum(seconds for seconds, _ in self.kinds.values())


def read_profile(path: str | Path) -> list[RunProfile]:
    """Every ``model_run`` in an ORT profile (``enable_profiling``), in order, with the node
    events that fall inside it."""
    events = json.loads(Path(path).read_text())
    runs = sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"), key=lambda e: e["ts"])
    nodes = sorted((e for e in events if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")), key=lambda e: e["ts"])
    profiles, index = [], 0
    for run in runs:
        kinds: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
        while index < len(nodes) and nodes[index]["ts"] < run["ts"]:
            index += 1
        while index < len(nodes) and nodes[index]["ts"] <= run["ts"] + run["dur"]:
            args = nodes[index].get("args", {})
            kind = (args.get("op_name", "?"), args.get("provider", "?").removesuffix("ExecutionProvider"))
            kinds[kind][0] += nodes[index]["dur"] / 1e6
            kinds[kind][1] += 1
            index += 1
        profiles.append(RunProfile(run["dur"] / 1e6, dict(kinds)))
    return profiles


def median_profile(runs: list[RunProfile]) -> RunProfile:
    """Each kind's median over ``runs`` (decode steps of one shape)."""
    kinds = {kind for run in runs for kind in run.kinds}
    return RunProfile(
        float(np.median([run.seconds for run in runs])),
        {kind: [float(np.median([run.kinds.get(kind, [0.0, 0])[0] for run in runs])), runs[-1].kinds.get(kind, [0.0, 0])[1]] for kind in kinds},
    )
