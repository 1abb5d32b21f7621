#!/usr/bin/env bash
# The installed package works: build the wheel, install it (not editable) into a fresh
# venv, and from a folder outside the repository validate the sample job, run a tiny
# extract of it into every store format, verify and inspect the stores.
#
#   tests/packaging/check_wheel.sh            (make check-wheel; CI runs it)
#
# Needs the real model in models/ (`make model`). Fast on a second run: pip reuses its
# cache, and torch comes from the local wheel like `make install` does.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
TORCH="${TORCH:-torch==2.13.0}"
MODEL="$REPO/models/all-MiniLM-L6-v2"
ROWS=24
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PIP_DISABLE_PIP_VERSION_CHECK=1

[ -f "$MODEL/config.json" ] || { echo "check-wheel: $MODEL missing; run make model" >&2; exit 1; }
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"; rm -rf "$REPO/build"' EXIT
started=$SECONDS

step() { echo "check-wheel: $* ($((SECONDS - started))s)"; }

step "building the wheel"
"$PYTHON" -m venv "$WORK/venv"
PIP=("$WORK/venv/bin/python" -m pip)
"${PIP[@]}" wheel -q --no-deps -w "$WORK/dist" "$REPO"
WHEEL="$(ls "$WORK"/dist/bertpipe-*.whl)"
"$WORK/venv/bin/python" - "$WHEEL" <<'PY'
import sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
missing = {"pipeline/schemas/job.schema.json", "pipeline/schemas/store.schema.json"} - names
sys.exit(f"check-wheel: the wheel lacks {sorted(missing)}" if missing else 0)
PY

step "installing $TORCH, then $(basename "$WHEEL") into a fresh venv"
# the CPU build of torch first, so the wheel's dependencies pull no CUDA build
"${PIP[@]}" install -q "$TORCH"
"${PIP[@]}" install -q "$WHEEL"

step "running the installed bertpipe outside the repository"
JOB="$WORK/job"
mkdir -p "$JOB/jobs" "$JOB/data"
cp "$REPO/jobs/reviews.yaml" "$JOB/jobs/"
cd "$JOB"  # relative paths in the job resolve here, far from the source tree
"$WORK/venv/bin/python" - "$REPO/data/reviews.parquet" "$ROWS" <<'PY'
import sys
import pyarrow.parquet as pq
import pipeline
where = pipeline.__file__
if "site-packages" not in where:
    sys.exit(f"check-wheel: pipeline imported from {where}, not the installed wheel")
pq.write_table(pq.read_table(sys.argv[1]).slice(0, int(sys.argv[2])), "data/reviews.parquet")
PY
BERTPIPE="$WORK/venv/bin/bertpipe"
SET=(--set "model.path=$MODEL" --set execution.scheduler=synchronous)
"$BERTPIPE" validate jobs/reviews.yaml --set "model.path=$MODEL"
for format in zarr parquet icechunk delta; do
    store="out/reviews.$format"
    "$BERTPIPE" extract jobs/reviews.yaml "${SET[@]}" --set "output.format=$format" \
        --set "output.path=$store"
    "$BERTPIPE" verify "$store"
    "$BERTPIPE" inspect "$store" >/dev/null
    "$BERTPIPE" search "$store" --exact -k 1 "made me dizzy" >/dev/null
done
"$WORK/venv/bin/python" -c "
import pipeline
store = pipeline.open_store('out/reviews.zarr')
assert store.vectors('mean').shape == ($ROWS, 384), store.vectors('mean').shape
"
step "OK: the wheel validates, extracts $ROWS rows into zarr, parquet, icechunk and delta, verifies, inspects"
