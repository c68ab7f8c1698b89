# realm_jax developer targets.
#
#   make install              .venv with the package (editable) and the test extras
#   make demo [WORKDIR=...] [SEED=...]   the REALM-in-miniature demo, end to end
#   make demo-squad [SQUAD_WORKDIR=...]   prepare -> ICT -> REALM on SQuADShifts + retrieval recall
#   make test                 pytest on CPU (tests force 8 host devices themselves)
#   make bench [BENCH_ARGS=...]          train-step throughput (step time, FLOP/s, MFU)
#   make lint                 byte-compile everything (catches syntax errors fast)
#   make clean / distclean    remove run outputs and caches / also the .venv

PYTHON ?= python3
VENV ?= .venv
VENV_PYTHON := $(VENV)/bin/python
WORKDIR ?= runs/demo
SEED ?= 0
SQUAD_WORKDIR ?= runs/squad
BENCH_ARGS ?=

.PHONY: install demo demo-squad test bench lint clean distclean

install: $(VENV)/.installed

# The stamp makes re-runs instant; editing setup.py (dependencies, entry points) reinstalls.
$(VENV)/.installed: setup.py
	test -x $(VENV_PYTHON) || $(PYTHON) -m venv $(VENV)
	$(VENV_PYTHON) -m pip install --quiet --upgrade pip
	$(VENV_PYTHON) -m pip install --quiet -e '.[test]'
	touch $@

demo: install
	$(VENV_PYTHON) -m realm_jax.demo --workdir $(WORKDIR) --seed $(SEED)

demo-squad: install
	$(VENV_PYTHON) -m realm_jax.demo_squad --workdir $(SQUAD_WORKDIR) --seed $(SEED)

test: install
	$(VENV_PYTHON) -m pytest -q tests

bench: install
	$(VENV_PYTHON) bench/train_step.py $(BENCH_ARGS)

lint:
	$(PYTHON) -m compileall -q realm_jax configs bench tests

clean:
	rm -rf runs build .pytest_cache *.egg-info
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
