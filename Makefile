# Quick start: `make demo` and `make test` do all the set-up they need, idempotently:
# a virtualenv in .venv, the package installed editable with its test extra, and Mesa's
# software Vulkan driver (lavapipe) through apt-get when wgpu finds no adapter at all.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

# lavapipe's window-system layer warns without a runtime dir; nothing here draws to a screen.
export XDG_RUNTIME_DIR ?= /tmp

.PHONY: demo test lint setup vulkan clean

demo: setup
	$(PY) -m sparse_attention_op demo

test: setup lint
	$(PY) -m pytest

# ruff: lint and the format check (pyproject.toml's [tool.ruff]); `ruff format` fixes the latter.
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

setup: $(STAMP) vulkan

# Reinstall only when the package metadata changes.
# A venv that failed half-way (Debian without python3-venv leaves python but no pip) is
# made again, and a failure says what is missing instead of leaving it for the next run.
$(STAMP): pyproject.toml
	@test -x $(VENV)/bin/pip || { rm -rf $(VENV) && $(PYTHON) -m venv $(VENV); } || \
	  { rm -rf $(VENV); echo "cannot create a virtualenv with $(PYTHON) (Debian/Ubuntu: apt-get install python3-venv)"; exit 1; }
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

# Ask wgpu itself whether it sees a native (Vulkan/Metal/D3D12) adapter; only when it sees
# none, install lavapipe. OpenGL adapters do not count: the kernels need a native backend.
# The question is about the machine, so an SAO_ADAPTER choice (or its old name) is left out
# of it (one that matches nothing is reported, not answered with a driver install).
vulkan: $(STAMP)
	@$(PY) -c "import sparse_attention_op, wgpu"  # a broken install shows its own error, not "no adapter"
	@if env -u SAO_ADAPTER -u SPARSE_ATTENTION_OP_ADAPTER $(PY) -m sparse_attention_op adapters --native >/dev/null 2>&1; then \
	  echo "wgpu adapter: $$($(PY) -m sparse_attention_op adapters 2>&1 | head -n 1)"; \
	else \
	  echo "no wgpu adapter found: installing Mesa's software Vulkan driver (lavapipe)"; \
	  SUDO=$$(command -v sudo >/dev/null && [ "$$(id -u)" != 0 ] && echo sudo); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends mesa-vulkan-drivers libvulkan1 >/dev/null && \
	  $(PY) -m sparse_attention_op adapters --native; \
	fi

clean:
	rm -rf $(VENV) build *.egg-info
