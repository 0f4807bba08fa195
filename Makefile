# Set-up is part of every target: a fresh clone needs only `make test` or `make demo`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
TORCH := torch==2.13.0

.PHONY: setup test demo fuzz bench gpu-check clean

$(STAMP): pyproject.toml setup.py abi/superfluid.h abi/sf_ring.c abi/sf_codec.c abi/_build.py kernels/sf_cpu.c kernels/sf_gemm.c kernels/sf_pool.c kernels/sf_mask.c kernels/sf_cpu.h kernels/sf_internal.h kernels/_build_cpu.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[test,triton]'
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

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

clean:
	rm -rf $(VENV) build *.egg-info abi/_native*.so abi/_codec*.so
