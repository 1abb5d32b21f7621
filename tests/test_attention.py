"""Attention diagnostics: maps equal plain transformers' eager attention, statistics equal
a NumPy float64 count, and the page renders in a real headless browser."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner, Result

from pipeline.analysis.attention import HeadStatistics, TokenKinds, is_punctuation
from pipeline.cli import main
from pipeline.extract.chunking import Specials
from tests.conftest import headless, job_dict, write_job, write_table

LONG = ("the drug worked very well for my pain. " * 3 + "\n\n"
        + "bad side effects, no sleep for a week. " * 3)


@pytest.fixture
def job(tmp_path: Path, tiny_bert: Path, small_texts: Path) -> Path:
    return write_job(tmp_path / "job.yaml", job_dict(small_texts, tiny_bert,
                                                     tmp_path / "o.zarr"))


def run(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def eager_oracle(model_dir: Path, ids: list[int]) -> np.ndarray:
    """(layers, heads, T, T) from plain transformers with eager attention."""
    from transformers import BertModel

    model = BertModel.from_pretrained(model_dir, attn_implementation="eager").eval()
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), output_attentions=True)
    return torch.stack(out.attentions, 1)[0].numpy()


def test_row_maps_equal_plain_transformers(job: Path, tiny_bert: Path, tmp_path: Path) -> None:
    from transformers import BertTokenizerFast

    out = tmp_path / "att"
    result = run("attention", str(job), "--id", "r3", "--out", str(out))
    assert result.exit_code == 0, result.output
    saved = np.load(out / "attention.npz")
    tokenizer = BertTokenizerFast.from_pretrained(tiny_bert)
    ids = tokenizer("my doctor said it is not good for pain and sleep")["input_ids"]
    assert saved["token_ids"].tolist() == ids
    assert saved["tokens"].tolist() == tokenizer.convert_ids_to_tokens(ids)
    assert saved["attentions"].shape == (2, 4, len(ids), len(ids))
    assert saved["attentions"].dtype == np.float32
    np.testing.assert_allclose(saved["attentions"], eager_oracle(tiny_bert, ids), atol=1e-5)
    page = (out / "attention.html").read_text()
    assert page.count('class="heatmap"') == 8 and "layer 1, head 3" in page
    assert "http" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")


def test_chosen_layers_heads_and_chunk(tmp_path: Path, tiny_bert: Path) -> None:
    from transformers import BertTokenizerFast

    src = write_table(tmp_path / "long.parquet", {"text": ["short one", LONG]})
    spec = job_dict(src, tiny_bert, tmp_path / "o.zarr",
                    input={"id_column": None}, chunking={"strategy": "hierarchical"})
    del spec["input"]["id_column"]
    job = write_job(tmp_path / "job.yaml", spec)
    out = tmp_path / "att"
    result = run("attention", str(job), "--id", "1", "--chunk", "1", "--layers", "-1",
                 "--heads", "2,0", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "chunk 1 of 2" in result.stdout
    saved = np.load(out / "attention.npz")
    assert saved["layers"].tolist() == [1] and saved["heads"].tolist() == [0, 2]
    start, end = saved["span"].tolist()
    assert start > 0 and end == len(LONG)  # the second chunk is the second paragraph
    tokenizer = BertTokenizerFast.from_pretrained(tiny_bert)
    ids = tokenizer(LONG[start:end])["input_ids"]
    assert saved["token_ids"].tolist() == ids
    full = eager_oracle(tiny_bert, ids)
    np.testing.assert_allclose(saved["attentions"], full[[1]][:, [0, 2]], atol=1e-5)


@pytest.mark.parametrize("args,code,fragment", [
    (["--id", "nope"], 3, "no row has id == 'nope'"),
    (["--id", "r1", "--layers", "2"], 2, "--layers: 2 is out of range"),
    (["--id", "r1", "--heads", "x"], 2, "--heads: 'x' is not an integer"),
    (["--id", "r1", "--chunk", "1"], 2, "--chunk: 1 is out of range; row 1 (id r1) has 1 chunk"),
    ([], 2, "give either --id ID"),
    (["--id", "r1", "--summary"], 2, "give either --id ID"),
    (["--summary", "--chunk", "2"], 2, "--chunk: applies to one row"),
    (["--summary", "--sample", "0"], 2, "--sample: 0 must be at least 1"),
])
def test_bad_options(job: Path, tmp_path: Path, args: list[str], code: int,
                     fragment: str) -> None:
    result = run("attention", str(job), *args, "--out", str(tmp_path / "x"))
    assert result.exit_code == code, result.output
    assert result.stderr.startswith("error: ") and fragment in result.stderr
    assert "Traceback" not in result.output


def test_statistics_equal_a_float64_count() -> None:
    """Two hand-made sequences (T=4 and T=3) of 2 layers x 2 heads, checked by loops."""
    rng = np.random.default_rng(7)
    tokens = [["[CLS]", "good", ",", "[SEP]"], ["[CLS]", "##!", "[SEP]"]]
    attns = [rng.dirichlet(np.ones(len(t)), size=(2, 2, len(t))) for t in tokens]
    attns[0][0, 1, 2] = [0.0, 0.0, 1.0, 0.0]  # a one-hot row: entropy 0, never NaN
    specials = Specials((2,), (3,))
    stats = HeadStatistics(2, 2)
    for a, t in zip(attns, tokens, strict=True):
        stats.add(a.astype(np.float32), TokenKinds.of(t, specials))
    got = stats.means()
    for layer in range(2):
        for head in range(2):
            acc = dict.fromkeys(("entropy", "distance", "cls", "sep", "punct"), 0.0)
            n = 0
            for a, t in zip(attns, tokens, strict=True):
                for i in range(len(t)):
                    row = [float(v) for v in a[layer, head, i].astype(np.float32)]
                    acc["entropy"] -= sum(p * math.log(p) for p in row if p > 0)
                    acc["distance"] += sum(p * abs(i - j) for j, p in enumerate(row))
                    acc["cls"] += row[0]
                    acc["sep"] += row[-1]
                    acc["punct"] += sum(p for j, p in enumerate(row)
                                        if t[j] in (",", "##!"))
                    n += 1
            for key, total in acc.items():
                assert got[key][layer, head] == pytest.approx(total / n, abs=1e-12), key
    assert stats.n_queries == 7
    assert stats.uniform_entropy == pytest.approx((4 * math.log(4) + 3 * math.log(3)) / 7)
    uniform = sum(abs(i - j) / t for t in (4, 3) for i in range(t) for j in range(t)) / 7
    assert stats.uniform_distance == pytest.approx(uniform)


def test_punctuation_rule() -> None:
    assert all(map(is_punctuation, [",", "...", "##!", "$", "Ġ(", "▁—", "「"]))
    assert not any(map(is_punctuation, ["good", "##s", "a,", "", "1", "[UNK]"]))


def test_summary_outputs(job: Path, tmp_path: Path) -> None:
    out = tmp_path / "sum"
    result = run("attention", str(job), "--summary", "--sample", "6", "--heads", "1,3",
                 "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "mean entropy (nats)" in result.stdout and "share of attention on [CLS]" in result.stdout
    data = json.loads((out / "attention-summary.json").read_text())
    assert data["layers"] == [0, 1] and data["heads"] == [1, 3]
    assert len(data["rows"]) == 6 and data["n_empty"] == 0
    stats = {k: np.asarray(v) for k, v in data["statistics"].items()}
    assert all(v.shape == (2, 2) for v in stats.values())
    shares = stats["cls"] + stats["sep"] + stats["punct"]
    assert (shares > 0).all() and (shares <= 1 + 1e-9).all()
    assert (stats["entropy"] > 0).all()
    # no row can be more spread out than uniform attention over its T keys
    assert (stats["entropy"] <= data["uniform_entropy"] + 1e-9).all()
    page = (out / "attention-summary.html").read_text()
    assert page.count('class="grid"') == 5


def test_page_renders_in_headless_chromium(job: Path, tmp_path: Path) -> None:
    out = tmp_path / "att"
    assert run("attention", str(job), "--id", "r0", "--layers", "1", "--heads", "0,1",
               "--out", str(out)).exit_code == 0
    page = out / "attention.html"
    dom = headless(page, tmp_path, "--dump-dom").stdout
    assert dom.count("<figure>") == 2 and "layer 1, head 1" in dom
    assert dom.count(">worked</text>") == 4  # on both axes of both maps
    shot = tmp_path / "shot.png"
    headless(page, tmp_path, f"--screenshot={shot}", "--window-size=1200,900")
    from PIL import Image

    pixels = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    blue = (pixels[..., 2] - pixels[..., 0] > 60) & (pixels[..., 0] < 150)
    assert blue.sum() > 100  # the heatmap images were decoded and drawn
