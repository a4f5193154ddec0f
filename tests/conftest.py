"""Shared fixtures. GPU tests need a wgpu adapter; `make test` installs lavapipe where none exists.

A GPU test never skips silently: without an adapter it fails and says why.
"""

import os
import zlib

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
    # A per-test seed from the test's id: the same in every process (Python's hash() is
    # salted per process), and shown with the failure so it can be reproduced.
    seed = zlib.crc32(request.node.nodeid.encode())
    request.node.user_properties.append(("rng seed", seed))
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for name, value in item.user_properties:
            if name == "rng seed":
                report.sections.append(("rng seed", f"np.random.default_rng({value})  # {item.nodeid}"))
