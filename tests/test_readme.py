"""Every ```python block of README.md runs as written.

Each block runs in a fresh Python process (a fresh namespace, as a reader pasting it would
have), with the repository root as the working directory, in README order, under a timeout so
that a hang fails one test instead of stalling the suite. Commands that need what CI lacks
(a GPU-only execution provider, say) belong in ```text or ```sh blocks, which are not run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
#: Seconds one block may take. The bundled models are tiny: each block takes a few seconds
#: on lavapipe with 2 cores, most of it importing onnxruntime and wgpu and making the device.
TIMEOUT_S = 120

_FENCE = re.compile(r"^(`{3,}|~{3,})\s*([^`\s]*)[^`]*$")


@dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the opening fence
    info: str  # the fence's language word ("python", "sh", "" ...)
    code: str


def fenced_blocks(text: str) -> list[Block]:
    """Every fenced code block of a Markdown text, in order, with its language word."""
    blocks, opening, info, body = [], None, "", []
    for number, line in enumerate(text.splitlines(), start=1):
        match = _FENCE.match(line.strip())
        if opening is None:
            if match:
                opening, info, body, start = match.group(1), match.group(2).lower(), [], number
        elif match and line.strip().startswith(opening[0] * len(opening)) and not match.group(2):
            blocks.append(Block(start, info, "\n".join(body) + "\n"))
            opening = None
        else:
            body.append(line)
    if opening is not None:
        raise ValueError(f"the code block opened at line {start} is never closed")
    return blocks


def python_blocks(text: str) -> list[Block]:
    return [block for block in fenced_blocks(text) if block.info == "python"]


@dataclass(frozen=True)
class Outcome:
    ok: bool
    report: str


def run_block(code: str, timeout: float = TIMEOUT_S) -> Outcome:
    """Run ``code`` as a script in a fresh interpreter (this one's), cwd = the repository root."""
    env = dict(os.environ)
    env.setdefault("XDG_RUNTIME_DIR", "/tmp")  # lavapipe's WSI layer complains without it
    try:
        done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        output = expired.stderr or b""
        output = output.decode(errors="replace") if isinstance(output, bytes) else output
        return Outcome(False, f"timed out after {timeout} s\n{output[-3000:]}")
    if done.returncode != 0:
        return Outcome(False, f"exit status {done.returncode}\n{done.stderr[-3000:]}")
    return Outcome(True, done.stdout)


_README_BLOCKS = python_blocks(README.read_text(encoding="utf-8"))


def test_readme_has_its_python_examples():
    # The three ways to run a model are shown as code; a fence changed by mistake (```py,
    # ```Python3) would otherwise silently drop a block from this test.
    assert len(_README_BLOCKS) >= 4
    for block in fenced_blocks(README.read_text(encoding="utf-8")):
        assert block.info == "python" or not block.info.startswith("py"), (
            f"README.md line {block.line}: fence ```{block.info} is not run by this test; write ```python"
        )
    names = "".join(block.code for block in _README_BLOCKS)
    for name in (
        "sao.create_session",
        "sao.prepare_model",
        "sao.session_options",
        "sao.bind_shared",
        "sao.generate",
        "sao.Sampling",
        "sao.prepare_genai_folder",
        "sao.load_genai_model",
    ):
        assert name in names, f"no README example runs {name}"


def test_readme_documents_every_environment_variable_once():
    from sparse_attention_op.settings import DEPRECATED, VARIABLES

    rows = [line for line in README.read_text(encoding="utf-8").splitlines() if re.match(r"\|\s*`SAO_", line)]
    documented = [re.match(r"\|\s*`(SAO_\w+)`", row).group(1) for row in rows]
    assert sorted(documented) == sorted(VARIABLES), "README's environment table and settings.VARIABLES differ"
    for old in DEPRECATED:
        assert sum(old in row for row in rows) == 1, f"README's environment table should name the old {old} once"


@pytest.mark.gpu
@pytest.mark.parametrize("block", _README_BLOCKS, ids=[f"line{block.line}" for block in _README_BLOCKS])
def test_readme_python_block_runs(block):
    outcome = run_block(block.code)
    assert outcome.ok, f"README.md's python block at line {block.line} failed: {outcome.report}\n--- the block:\n{block.code}"


# -- the harness itself can fail ---------------------------------------------------------


def test_fenced_blocks_keep_only_python_and_their_lines():
    text = "intro\n```python\nprint(1)\n```\n```sh\nmake test\n```\n````python\n```\nprint(2)\n````\n~~~text\nprint(3)\n~~~\n"
    blocks = python_blocks(text)
    assert [(b.line, b.code) for b in blocks] == [(2, "print(1)\n"), (8, "```\nprint(2)\n")]
    with pytest.raises(ValueError, match="line 1"):
        fenced_blocks("```python\nprint(1)\n")


def test_a_broken_block_is_reported_as_failing():
    broken = 'import sparse_attention_op as sao\nsao.generate("models/no-such-model", [[5, 17, 33]], max_new_tokens=4)\n'
    outcome = run_block(broken)
    assert not outcome.ok
    assert "no-such-model" in outcome.report


def test_a_block_that_hangs_fails_at_its_timeout():
    outcome = run_block("import time\ntime.sleep(60)\n", timeout=1)
    assert not outcome.ok
    assert outcome.report.startswith("timed out after 1 s")


def test_a_block_runs_in_a_fresh_namespace_at_the_repository_root():
    assert run_block("from pathlib import Path\nassert Path('README.md').is_file()\nassert 'sao' not in dir()\n").ok
