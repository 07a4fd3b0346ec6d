# The two commands a newcomer needs:
#   make demo   set up, then serve / generate with the synthetic demo model
#   make test   set up, then run the whole test suite
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel: an unpinned torch on a CPU-only machine pulls a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
DEMO_DIR ?= .cache/demo

.PHONY: setup test demo lint

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $@

test: setup
	$(PY) -m pytest -q

lint: setup
	$(PY) -m ruff check .

demo: setup
	$(PY) -m actors.cli --demo "$(DEMO_DIR)" --prompt "Tell me about queues." --max-tokens 48
