"""One-time, untimed exports of the peers' model files (runs in the peer venv).

    python benchmarks/peer_export.py MODEL_DIR PEER_MODEL_DIR

Copies the sentence-transformers model folder once, then adds what each backend loads:
onnx/model.onnx (fp32), onnx/model_q[u]int8_<config>.onnx (ONNX Runtime dynamic int8 with
sentence-transformers' config for this CPU: avx512_vnni, avx512 or avx2) and
openvino/openvino_model.xml. Files already there are kept; peers.json says which int8
file the benchmark loads.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def int8_config() -> str:
    """sentence-transformers' dynamic-quantisation preset that fits this CPU."""
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    if "avx512_vnni" in flags:
        return "avx512_vnni"
    if "avx512f" in flags:
        return "avx512"
    return "avx2"


def main() -> None:
    from sentence_transformers import SentenceTransformer, export_dynamic_quantized_onnx_model

    source, dest = Path(sys.argv[1]), Path(sys.argv[2])
    if not (dest / "modules.json").exists():
        shutil.copytree(source, dest, dirs_exist_ok=True)
    if not (dest / "onnx" / "model.onnx").exists():
        SentenceTransformer(str(dest), backend="onnx", device="cpu").save_pretrained(str(dest))
    config = int8_config()
    # named model_qint8_<config>.onnx, or model_quint8_avx2.onnx (unsigned weights on AVX2)
    found = sorted((dest / "onnx").glob(f"model_*int8_{config}.onnx"))
    if not found:
        model = SentenceTransformer(str(dest), backend="onnx", device="cpu",
                                    model_kwargs={"file_name": "onnx/model.onnx"})
        export_dynamic_quantized_onnx_model(model, config, str(dest))
        found = sorted((dest / "onnx").glob(f"model_*int8_{config}.onnx"))
    int8 = str(found[0].relative_to(dest))
    if not (dest / "openvino" / "openvino_model.xml").exists():
        SentenceTransformer(str(dest), backend="openvino", device="cpu").save_pretrained(
            str(dest))
    (dest / "peers.json").write_text(json.dumps({"int8_file": int8, "int8_config": config}))
    print(f"peer exports ready in {dest} (int8: {config})")


if __name__ == "__main__":
    main()
