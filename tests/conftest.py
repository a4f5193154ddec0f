"""Shared fixtures. GPU tests need a wgpu adapter; `make test` installs lavapipe where none exists.

A GPU test never skips silently: without an adapter it fails and says why.
"""

import os

import numpy as np
import pytest

os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")  # lavapipe's WSI layer complains without it


@pytest.fixture(scope="session")
def executor():
    from sparse_attention_op.webgpu import NoAdapterError, get_executor

    try:
        return get_executor()
    except NoAdapterError as error:
        pytest.fail(f"this test needs a wgpu adapter (run `make test`, which installs lavapipe): {error}")


@pytest.fixture
def rng(request):
    # A per-test seed, stable across runs, so a failure reproduces.
    return np.random.default_rng(abs(hash(request.node.nodeid)) % (2**32))
