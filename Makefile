# fairseq-attnzoo: two commands do everything on a fresh machine.
#   make test   install (.venv) + the full test suite (CI; prints the 15 slowest tests)
#               (make test-fast: the edit loop, without the end-to-end runs marked slow)
#   make demo   install + prepare the offline German-English corpus + train/generate/score a table
#               + a picture report, under work/demo/ (DEMO_ARGS=--publish: the tracked
#               docs/demo_results.md and docs/demo/README.md)
# Also: make install, make data, make bench, make clean-venv

PY      ?= python3
VENV    ?= .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.attnzoo-installed
THREADS ?= 2
# demo: which rows (ARCHS, LM_ARCHS; LM_ARCHS=none for no LM row) and any other option
# (DEMO_ARGS, e.g. "--max-update 3000 --rerun"); see python -m scripts.demo.demo --help and docs/demo.md
ARCHS   ?=
LM_ARCHS ?=
DEMO_ARGS ?=
# bench: which cases (CASES, e.g. "device aop/sublayer-vs-ffn"; default: list them) and any other
# option (BENCH_ARGS); see docs/performance.md
CASES ?= --list
BENCH_ARGS ?=

.PHONY: install test test-fast demo data bench clean-venv

install: $(STAMP)

$(STAMP): constraints.txt setup.py scripts/install.sh
	PYTHON=$(PY) VENV=$(VENV) bash scripts/install.sh
	touch $(STAMP)

test: install
	OMP_NUM_THREADS=1 $(VPY) -m pytest -q -n 2 --dist loadgroup --durations=15 tests

test-fast: install
	OMP_NUM_THREADS=1 $(VPY) -m pytest -q -n 2 --dist loadgroup -m "not slow" --durations=10 tests

data: install
	OMP_NUM_THREADS=$(THREADS) $(VPY) -m scripts.data.prepare_libreoffice --workers $(THREADS)
	OMP_NUM_THREADS=$(THREADS) $(VPY) -m scripts.data.prepare_enwik8 --gensim --workers $(THREADS)

demo: data
	OMP_NUM_THREADS=$(THREADS) $(VPY) -m scripts.demo.demo $(if $(ARCHS),--archs "$(ARCHS)") \
	  $(if $(LM_ARCHS),--lm-archs "$(LM_ARCHS)") $(DEMO_ARGS)

# records are appended to docs/benchmarks.jsonl; `python -m scripts.bench.tables` renders the
# tables of docs/performance.md from them
bench: install
	$(VPY) -m scripts.bench $(CASES) $(BENCH_ARGS)

clean-venv:
	rm -rf $(VENV)
