#!/usr/bin/env bash
# One-time, untimed set-up of the peers that `make bench` measures bertpipe against:
# sentence-transformers with its PyTorch, ONNX Runtime and OpenVINO backends, in a venv of
# their own (the [onnx,openvino] extras pull transformers 4.x, which bertpipe's venv must
# not get), and the peers' own exports of the model (ONNX fp32, ONNX dynamic int8 for this
# CPU, OpenVINO IR) made once here so that no timed run converts anything.
#
#   benchmarks/setup_peers.sh MODEL_DIR [PEER_VENV] [PEER_MODEL]
set -euo pipefail
MODEL=${1:?usage: setup_peers.sh MODEL_DIR [PEER_VENV] [PEER_MODEL]}
PEER_VENV=${2:-benchmarks/work/peer-venv}
PEER_MODEL=${3:-benchmarks/work/peer-model}
PYTHON=${PYTHON:-python3}
TORCH=${TORCH:-torch==2.13.0}
# the release measured in docs/results.md; PEER_ST=... to try another
PEER_ST=${PEER_ST:-sentence-transformers[onnx,openvino]==5.7.0}

if [ ! -f "$PEER_VENV/.installed" ]; then
  "$PYTHON" -m venv "$PEER_VENV"
  "$PEER_VENV/bin/python" -m pip install -q --upgrade pip
  # the CPU build of torch first, so nothing below pulls a multi-GB CUDA build
  "$PEER_VENV/bin/python" -m pip install -q "$TORCH"
  "$PEER_VENV/bin/python" -m pip install -q "$PEER_ST" pyarrow
  touch "$PEER_VENV/.installed"
fi
HF_HUB_OFFLINE=1 "$PEER_VENV/bin/python" "$(dirname "$0")/peer_export.py" "$MODEL" "$PEER_MODEL"
