"""The model's files read without torch (extract/modelfiles.py) say what transformers says:
the config's facts as AutoConfig gives them, the tokenizer's ids, tokens, words and
offsets as AutoTokenizer gives them, on the real reviews and on mixed scripts, for every
encoder family the zoo builds and for the real MiniLM."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from pipeline.errors import ModelError
from pipeline.extract import modelfiles
from pipeline.extract.modelfiles import ModelConfig, load_config, load_tokenizer
from pipeline.spec import ModelSpec
from tests.conftest import REVIEWS
from tests.test_vocabulary import MIXED
from tests.test_zoo import FAMILIES


def spec(path: Path | str) -> ModelSpec:
    return ModelSpec(path=str(path))


def auto_config(path: Path) -> ModelConfig:
    from transformers import AutoConfig

    return ModelConfig.of(AutoConfig.from_pretrained(path, local_files_only=True))


def texts() -> list[str]:
    reviews = pq.read_table(REVIEWS, columns=["text"]).column("text").to_pylist()
    return [t for t in [*reviews[:200], *MIXED, "", "  ", "a\n\nb. c!"] if t is not None]


# the real MiniLM and the tiny test models in make test-fast; every zoo family (each
# tokenizer trained first, seconds) in make test
MODELS = ["minilm", "tiny_bert", "tiny_distilbert", "tiny_roberta",
          *(pytest.param(name, marks=pytest.mark.slow) for name in FAMILIES)]


def model_files(name: str, request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """A conftest model by fixture name, or a zoo family's config.json and tokenizer files
    (no weights: none are read)."""
    if name not in FAMILIES:
        return Path(request.getfixturevalue(name))
    family = FAMILIES[name]
    tokenizer = family.tokenizer(tmp_path)
    family.config(tokenizer).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("name", MODELS)
def test_config_read_without_transformers_equals_autoconfig(
        name: str, request: pytest.FixtureRequest, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    path = model_files(name, request, tmp_path)
    expected = auto_config(path)

    def refused(spec: ModelSpec) -> Any:
        raise AssertionError(f"{spec.path}: read through AutoConfig")

    monkeypatch.setattr(modelfiles, "_auto_config", refused)  # the json path, every family
    assert load_config(spec(path)) == expected


def test_config_outside_the_known_families_goes_through_autoconfig(
        tiny_bert: Path, tmp_path: Path) -> None:
    """A config the json path does not take (a key missing, an unknown family, a value
    that is no number) gets AutoConfig's answer: its defaults, or its refusal."""
    model = tmp_path / "m"
    shutil.copytree(tiny_bert, model)
    raw = json.loads((model / "config.json").read_text())
    del raw["max_position_embeddings"]  # BertConfig's default: 512
    (model / "config.json").write_text(json.dumps(raw))
    assert load_config(spec(model)) == auto_config(model)
    assert load_config(spec(model)).max_position_embeddings == 512
    (model / "config.json").write_text(json.dumps({**raw, "model_type": "no-such-family"}))
    with pytest.raises(ModelError, match="model.path: cannot load"):
        load_config(spec(model))
    (model / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="model.path: cannot load"):
        load_config(spec(model))


@pytest.mark.parametrize("name", MODELS)
def test_tokenizer_read_without_transformers_equals_autotokenizer(
        name: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = model_files(name, request, tmp_path)
    sample = texts()
    auto = AutoTokenizer.from_pretrained(path, use_fast=True, local_files_only=True)
    light = load_tokenizer(spec(path))
    assert light.model_max_length == auto.model_max_length
    assert (light.unk_token, light.unk_token_id) == (auto.unk_token, auto.unk_token_id)
    enc = auto(sample, add_special_tokens=False, return_offsets_mapping=True)
    for k, got in enumerate(light.encode_batch(sample)):
        assert got.ids == enc["input_ids"][k], sample[k]
        assert got.tokens == enc.tokens(k), sample[k]
        assert got.word_ids == enc.word_ids(k), sample[k]
        assert [tuple(o) for o in got.offsets] == [tuple(o) for o in enc["offset_mapping"][k]]
    assert [light.encode(t) for t in sample] == auto(sample)["input_ids"]  # special tokens


@pytest.mark.parametrize("name", MODELS)
def test_chunking_tokenizes_as_transformers_does(
        name: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Chunking calls the fast tokenizer's backend directly (`encode_contents`): the same
    ids, offsets and words as transformers' own call, special-token strings in a text
    included; the transformers tokenizer's own truncation is left as it was."""
    from transformers import AutoTokenizer

    from pipeline.extract.chunking import _calls_backend_only, encode_contents

    path = model_files(name, request, tmp_path)
    auto = AutoTokenizer.from_pretrained(path, use_fast=True, local_files_only=True)
    specials = [t for t in (auto.cls_token, auto.sep_token, auto.unk_token) if t]
    sample = [*texts(), f"before {' and '.join(specials)} after", " ".join(["pain"] * 700)]
    want = auto(sample, add_special_tokens=False, return_offsets_mapping=True)
    auto.backend_tokenizer.enable_truncation(16)  # another caller's setting: neither reaches
    got = encode_contents(auto, sample)           # the other
    for k, encoding in enumerate(got):
        assert encoding.ids == want["input_ids"][k], sample[k]
        assert [tuple(o) for o in encoding.offsets] == \
            [tuple(o) for o in want["offset_mapping"][k]], sample[k]
        assert encoding.word_ids == want.word_ids(k), sample[k]
    assert len(got[-1].ids) >= 700 and auto.backend_tokenizer.truncation["max_length"] == 16
    assert _calls_backend_only(auto)  # every family takes the direct path


def test_a_tokenizer_class_that_changes_the_call_is_called(minilm: Path) -> None:
    """A tokenizer whose own code changes the call (remote code may: here it drops each
    text's last word) is called, not bypassed."""
    from transformers import AutoTokenizer

    from pipeline.extract.chunking import _calls_backend_only, encode_contents

    auto = AutoTokenizer.from_pretrained(minilm, use_fast=True, local_files_only=True)

    class Shortening(type(auto)):  # type: ignore[misc]
        def __call__(self, text: Any, *args: Any, **kwargs: Any) -> Any:
            return super().__call__([t.rsplit(" ", 1)[0] for t in text], *args, **kwargs)

    shortening = Shortening.from_pretrained(minilm, local_files_only=True)
    assert not _calls_backend_only(shortening)
    got = encode_contents(shortening, ["the pain went away", "good drug"])
    assert [e.ids for e in got] == auto(["the pain went", "good"],
                                        add_special_tokens=False)["input_ids"]
    assert got[0].word_ids == [0, 1, 2] and got[1].offsets == [(0, 4)]


def test_tokenizer_file_truncation_is_ignored(minilm: Path) -> None:
    """MiniLM's tokenizer.json truncates at 128 tokens; AutoTokenizer does not, nor may
    the light reader (a long review would be counted short)."""
    assert json.loads((minilm / "tokenizer.json").read_text())["truncation"]
    long = " ".join(["pain"] * 400)
    assert len(load_tokenizer(spec(minilm)).encode(long)) == 402


def test_pooler_weights_from_the_header(tiny_bert: Path, tiny_distilbert: Path,
                                        tmp_path: Path) -> None:
    from safetensors import safe_open

    for model in (tiny_bert, tiny_distilbert):
        file = model / "model.safetensors"
        with safe_open(str(file), framework="numpy") as handle:
            assert sorted(modelfiles.safetensors_names(file) or []) == sorted(handle.keys())
    assert modelfiles.has_pooler_weights(str(tiny_bert)) is True
    assert modelfiles.has_pooler_weights(str(tiny_distilbert)) is False
    damaged = tmp_path / "d"
    damaged.mkdir()
    (damaged / "model.safetensors").write_bytes(b"\xff" * 12)
    assert modelfiles.has_pooler_weights(str(damaged)) is None


def test_a_tokenizer_that_splits_special_tokens_is_followed(minilm: Path) -> None:
    """With split_special_tokens, "[CLS]" in a text is text, not the token: chunking's
    direct path splits it as transformers' call does."""
    from transformers import AutoTokenizer

    from pipeline.extract.chunking import encode_contents

    sample = ["before [CLS] and [SEP] after"]
    for split in (False, True):
        auto = AutoTokenizer.from_pretrained(minilm, use_fast=True, local_files_only=True,
                                             split_special_tokens=split)
        want = auto(sample, add_special_tokens=False)["input_ids"]
        assert [e.ids for e in encode_contents(auto, sample)] == want
        assert (auto.cls_token_id in want[0]) is not split
