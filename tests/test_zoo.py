"""Every common encoder family, tiny and random, saved from its config as safetensors (no
download). Each view equals its plain-transformers oracle (eager attention, NumPy float64
pooling) or is refused with a one-line reason; the position limit is the model's own."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pipeline.errors import ModelError
from pipeline.extract.partition import Extractor
from pipeline.spec import Job
from tests.conftest import WORDS, job_dict, wordpiece_tokenizer

SIZES = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
         "intermediate_size": 64}
TEXTS = ["the drug worked very well", "bad side effects, no sleep for a week", "great",
         "my doctor said it is not good for pain and sleep",
         "it worked. then it did not. then the pain was terrible!"]
MIX = {"weights": [0.5, -1.0, 2.0], "gamma": 0.8}
VIEWS: dict[str, dict[str, Any]] = {
    "cls": {"pooling": "cls"},
    "pooler": {"pooling": "pooler"},
    "mean": {"pooling": "mean"},
    "max": {"pooling": "max"},
    "attention": {"pooling": "attention"},
    "last": {"pooling": "last"},
    "mix": {"layers": "all", "combine": "scalar_mix", **MIX, "pooling": "mean"},
    "low": {"layers": [1], "pooling": "max"},
}
NO_POOLER = "has no trained pooler weights"


# ---- tokenizers ----------------------------------------------------------------------

def trained_tokenizer(kind: str, specials: list[str], max_length: int, **roles: str) -> Any:
    """A byte-level BPE (RoBERTa, ModernBERT) or SentencePiece-style Unigram (XLM-RoBERTa,
    ALBERT, DeBERTa) tokenizer trained on a few sentences; special tokens take ids 0.. in
    the order given, and every sequence is wrapped as `cls_token $A sep_token`."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import trainers as tr
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE() if kind == "bpe" else models.Unigram())
    trainer: Any
    if kind == "bpe":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = tr.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        tok.normalizer = normalizers.Lowercase()
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = tr.UnigramTrainer(vocab_size=200, special_tokens=specials, show_progress=False,
                                    unk_token=roles["unk_token"])
    tok.train_from_iterator([" ".join(WORDS)] * 3 + TEXTS, trainer)
    assert [tok.token_to_id(s) for s in specials] == list(range(len(specials)))
    first, last = roles["cls_token"], roles["sep_token"]
    template = processors.TemplateProcessing(
        single=f"{first} $A {last}", pair=f"{first} $A {last} $B {last}",
        special_tokens=[(first, specials.index(first)), (last, specials.index(last))])
    tok.post_processor = (processors.Sequence([processors.ByteLevel(trim_offsets=True),
                                               template]) if kind == "bpe" else template)
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=max_length, **roles)


def wordpiece(root: Path) -> Any:  # BERT, DistilBERT, ELECTRA
    return wordpiece_tokenizer(root, max_length=512)


def roberta_bpe(root: Path) -> Any:
    return trained_tokenizer("bpe", ["<s>", "<pad>", "</s>", "<unk>", "<mask>"], 512,
                             bos_token="<s>", eos_token="</s>", cls_token="<s>",
                             sep_token="</s>", pad_token="<pad>", unk_token="<unk>",
                             mask_token="<mask>")


def xlmr_unigram(root: Path) -> Any:
    return trained_tokenizer("unigram", ["<s>", "<pad>", "</s>", "<unk>", "<mask>"], 512,
                             bos_token="<s>", eos_token="</s>", cls_token="<s>",
                             sep_token="</s>", pad_token="<pad>", unk_token="<unk>",
                             mask_token="<mask>")


def albert_unigram(root: Path) -> Any:
    return trained_tokenizer("unigram", ["<pad>", "<unk>", "[CLS]", "[SEP]", "[MASK]"], 512,
                             cls_token="[CLS]", sep_token="[SEP]", pad_token="<pad>",
                             unk_token="<unk>", mask_token="[MASK]")


def deberta_unigram(root: Path) -> Any:
    return trained_tokenizer("unigram", ["[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]"], 512,
                             cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]",
                             unk_token="[UNK]", mask_token="[MASK]")


def modernbert_bpe(root: Path) -> Any:  # a pad id that is not 0 on purpose
    return trained_tokenizer("bpe", ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"], 8192,
                             cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]",
                             unk_token="[UNK]", mask_token="[MASK]")


# ---- families ------------------------------------------------------------------------

@dataclass(frozen=True)
class Family:
    tokenizer: Callable[[Path], Any]
    config: Callable[[Any], Any]  # tokenizer -> config
    limit: int  # tokens per sequence, special tokens included
    refused: dict[str, str] = field(default_factory=dict)  # pooling -> reason in the error


def _bert(tok: Any) -> Any:
    from transformers import BertConfig

    return BertConfig(vocab_size=len(tok), max_position_embeddings=512, pad_token_id=0, **SIZES)


def _roberta(tok: Any, xlm: bool = False) -> Any:
    from transformers import RobertaConfig, XLMRobertaConfig

    cls = XLMRobertaConfig if xlm else RobertaConfig
    return cls(vocab_size=len(tok), max_position_embeddings=514, pad_token_id=1,
               bos_token_id=0, eos_token_id=2, type_vocab_size=1, **SIZES)


def _distilbert(tok: Any) -> Any:
    from transformers import DistilBertConfig

    return DistilBertConfig(vocab_size=len(tok), dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                            max_position_embeddings=512, pad_token_id=0)


def _albert(tok: Any) -> Any:
    from transformers import AlbertConfig

    return AlbertConfig(vocab_size=len(tok), embedding_size=16, max_position_embeddings=512,
                        pad_token_id=0, bos_token_id=2, eos_token_id=3, **SIZES)


def _electra(tok: Any) -> Any:
    from transformers import ElectraConfig

    return ElectraConfig(vocab_size=len(tok), embedding_size=16, max_position_embeddings=512,
                         pad_token_id=0, **SIZES)


def _deberta(tok: Any, conv: int) -> Any:
    """v2 (a convolution beside the first block) and v3 (none): the same architecture."""
    from transformers import DebertaV2Config

    return DebertaV2Config(vocab_size=len(tok), max_position_embeddings=512, pad_token_id=0,
                           relative_attention=True, position_buckets=256,
                           pos_att_type=["p2c", "c2p"], norm_rel_ebd="layer_norm",
                           share_att_key=True, position_biased_input=False, type_vocab_size=0,
                           max_relative_positions=-1, conv_kernel_size=conv, **SIZES)


def _modernbert(tok: Any) -> Any:
    from transformers import ModernBertConfig

    return ModernBertConfig(vocab_size=len(tok), max_position_embeddings=8192, pad_token_id=3,
                            bos_token_id=1, cls_token_id=1, eos_token_id=2, sep_token_id=2,
                            layer_types=["full_attention", "sliding_attention"],
                            local_attention=16, **SIZES)


RELATIVE = "relative-position terms"
# The two ends run in the fast set (post-LN BERT with a pooler; pre-LN ModernBERT with
# rotary attention, a final norm and 8192 positions); the other families with the slow set.
FAST = ("bert", "modernbert")
FAMILIES = {
    "bert": Family(wordpiece, _bert, 512),
    "roberta": Family(roberta_bpe, _roberta, 512),  # 514 rows, 2 reserved
    "xlm-roberta": Family(xlmr_unigram, lambda t: _roberta(t, xlm=True), 512),
    "distilbert": Family(wordpiece, _distilbert, 512, {"pooler": NO_POOLER}),
    "albert": Family(albert_unigram, _albert, 512),
    "electra": Family(wordpiece, _electra, 512, {"pooler": NO_POOLER}),
    "deberta-v2": Family(deberta_unigram, lambda t: _deberta(t, conv=3), 512,
                         {"pooler": NO_POOLER, "attention": RELATIVE}),
    "deberta-v3": Family(deberta_unigram, lambda t: _deberta(t, conv=0), 512,
                         {"pooler": NO_POOLER, "attention": RELATIVE}),
    "modernbert": Family(modernbert_bpe, _modernbert, 8192,
                         {"pooler": NO_POOLER, "attention": "rotary"}),
}


def spread(model: torch.nn.Module) -> None:
    """Matrices and biases drawn with std 0.3 (layer-norm scales stay 1): attention logits
    then spread over several units, so attention is far from uniform and a pooling that
    weighted the wrong tokens could not pass for the right one."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1 or name.endswith("bias"):
                p.normal_(0.0, 0.3)


def save_family(root: Path, family: Family) -> Path:
    """A family's tokenizer and randomly initialised encoder, saved as safetensors."""
    from transformers import AutoModel

    tokenizer = family.tokenizer(root)
    torch.manual_seed(0)
    model = AutoModel.from_config(family.config(tokenizer))
    spread(model)
    model.save_pretrained(root, safe_serialization=True)
    tokenizer.save_pretrained(root)
    return root


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = save_family(tmp_path_factory.mktemp(name), FAMILIES[name])
        return built[name]

    return get


# ---- oracle and project --------------------------------------------------------------

def oracle(path: Path, texts: list[str], views: dict[str, dict[str, Any]]
           ) -> tuple[dict[str, np.ndarray], list[list[int]]]:
    """Each text alone through plain transformers (eager attention), pooled in float64."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    attentions = any(v["pooling"] == "attention" for v in views.values())
    out: dict[str, list[np.ndarray]] = {name: [] for name in views}
    ids = []
    for text in texts:
        enc = tokenizer(text, return_tensors="pt")
        ids.append(enc["input_ids"][0].tolist())
        with torch.no_grad():
            o = model.eval()(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                             output_hidden_states=True, output_attentions=attentions)
        hs = [h[0].double().numpy() for h in o.hidden_states]  # each (T, H)
        for name, view in views.items():
            out[name].append(pool_reference(view, hs, o))
    return {name: np.stack(v) for name, v in out.items()}, ids


def pool_reference(view: dict[str, Any], hs: list[np.ndarray], o: Any) -> np.ndarray:
    if view["pooling"] == "pooler":
        return o.pooler_output[0].double().numpy()
    if view.get("combine") == "scalar_mix":
        s = np.exp(view["weights"]) / np.exp(view["weights"]).sum()
        h = view["gamma"] * sum(sk * hk for sk, hk in zip(s, hs, strict=True))
    else:
        h = hs[view.get("layers", [-1])[0]]
    pooling = view["pooling"]
    if pooling == "attention":
        a = o.attentions[-1][0, :, 0, :].double().mean(0).numpy()  # [CLS] row, heads averaged
        return a @ h
    return {"cls": h[0], "mean": h.mean(0), "max": h.max(0), "last": h[-1]}[pooling]


def extractor(path: Path, tmp: Path, views: dict[str, dict[str, Any]], **model: Any
              ) -> Extractor:
    job = job_dict(tmp / "in.parquet", path, tmp / "out.zarr", views=views,
                   chunking={"strategy": "hierarchical"})
    job["model"].update(model)
    return Extractor(Job.from_dict(job))


def assert_views_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    for name, expected in want.items():
        np.testing.assert_allclose(got[name], expected, rtol=1e-4, atol=2e-5, err_msg=name)


def by_speed(cases: list[tuple[str, ...]]) -> list[Any]:
    """pytest params, marked slow unless their family (the first value) is in FAST."""
    return [pytest.param(*case, marks=() if case[0] in FAST else pytest.mark.slow)
            for case in cases]


# ---- tests ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", by_speed([(name,) for name in FAMILIES]))
def test_views_equal_transformers(zoo: Callable[[str], Path], tmp_path: Path,
                                  name: str) -> None:
    family = FAMILIES[name]
    views = {v: body for v, body in VIEWS.items() if body["pooling"] not in family.refused}
    ex = extractor(zoo(name), tmp_path, views)
    encoded = ex.encode_texts(TEXTS)  # one padded batch: padding must not leak
    want, ids = oracle(zoo(name), TEXTS, views)
    assert encoded.chunked.chunk_ids == ids  # same tokens, same special tokens
    assert_views_equal(encoded.docs, want)
    # the model's own position limit, not a fixed 512
    assert ex.model.max_positions == family.limit
    assert ex.budget == family.limit - ex.specials.count


@pytest.mark.parametrize("name,pooling", by_speed([(n, p) for n, f in FAMILIES.items()
                                                    for p in f.refused]))
def test_refused_views_say_why(zoo: Callable[[str], Path], tmp_path: Path, name: str,
                               pooling: str) -> None:
    with pytest.raises(ModelError) as err:
        extractor(zoo(name), tmp_path, {"v": {"pooling": pooling}})
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"pooling {pooling}: ")
    assert FAMILIES[name].refused[pooling] in message and name.split("-v")[0] in message


@pytest.mark.parametrize("name", by_speed([(name,) for name in FAMILIES]))
def test_lower_layers_alone_run_fewer_blocks(zoo: Callable[[str], Path], tmp_path: Path,
                                             name: str) -> None:
    views = {"low": {"layers": [1], "pooling": "mean"}, "emb": {"layers": [0], "pooling": "cls"}}
    ex = extractor(zoo(name), tmp_path, views)
    # ALBERT shares one block's weights across layers: nothing to cut, all blocks run
    assert ex.model.blocks_run == (2 if name == "albert" else 1)
    want, _ = oracle(zoo(name), TEXTS, views)
    assert_views_equal(ex.encode_texts(TEXTS).docs, want)


def test_chunking_follows_the_models_limit(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    text = ". ".join(" ".join(WORDS[i:] + WORDS[:i]) for i in range(22))  # ~700 tokens
    long_model = extractor(zoo("modernbert"), tmp_path, {"mean": VIEWS["mean"]})
    encoded = long_model.encode_texts([text])
    assert encoded.chunked.n_chunks.tolist() == [1] and 600 < encoded.chunked.n_tokens[0]
    want, _ = oracle(zoo("modernbert"), [text], {"mean": VIEWS["mean"]})
    assert_views_equal(encoded.docs, want)  # local (sliding-window) attention included
    bert = extractor(zoo("bert"), tmp_path, {"mean": VIEWS["mean"]})
    assert bert.encode_texts([text]).chunked.n_chunks[0] == 2  # 510 content tokens each
    capped = extractor(zoo("modernbert"), tmp_path, {"mean": VIEWS["mean"]}, max_tokens=256)
    assert capped.budget == 254


# ---- a fine-tuned checkpoint ---------------------------------------------------------

@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A `BertForSequenceClassification` saved as a fine-tuned checkpoint is: encoder
    weights under `bert.`, pooler included, a classifier head beside them."""
    from transformers import BertForSequenceClassification

    root = tmp_path_factory.mktemp("fine-tuned")
    tokenizer = wordpiece(root)
    torch.manual_seed(1)
    config = _bert(tokenizer)
    config.num_labels = 3
    model = BertForSequenceClassification(config)
    spread(model)
    model.save_pretrained(root, safe_serialization=True)
    tokenizer.save_pretrained(root)
    return root, model.eval()


def test_fine_tuned_checkpoint_loads_its_encoder_and_pooler(
        classifier: tuple[Path, Any], tmp_path: Path) -> None:
    from transformers import AutoModel

    path, model = classifier
    _, info = AutoModel.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]  # nothing random
    assert {k.split(".")[0] for k in info["unexpected_keys"]} == {"classifier"}  # the head
    views = {v: VIEWS[v] for v in ("pooler", "cls", "mean", "mix")}
    encoded = extractor(path, tmp_path, views).encode_texts(TEXTS)
    tokenizer = wordpiece(tmp_path / "tok")
    for i, text in enumerate(TEXTS):
        enc = tokenizer(text, return_tensors="pt")
        with torch.no_grad():  # the encoder inside the classifier, as the classifier runs it
            o = model.bert(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                           output_hidden_states=True)
        hs = [h[0].double().numpy() for h in o.hidden_states]
        np.testing.assert_allclose(encoded.docs["pooler"][i], o.pooler_output[0], atol=2e-5)
        np.testing.assert_allclose(encoded.docs["cls"][i], hs[-1][0], atol=2e-5)
        np.testing.assert_allclose(encoded.docs["mean"][i], hs[-1].mean(0), atol=2e-5)
        mix = pool_reference(VIEWS["mix"], hs, o)
        np.testing.assert_allclose(encoded.docs["mix"][i], mix, atol=2e-5)
        # and the classifier's logits are its head applied to that pooler output
        logits = model.classifier(torch.from_numpy(encoded.docs["pooler"][i:i + 1]))
        np.testing.assert_allclose(logits[0].detach().numpy(),
                                   model(**enc).logits[0].detach().numpy(), atol=1e-4)


def test_checkpoint_without_some_weights(tmp_path: Path, zoo: Callable[[str], Path]) -> None:
    """transformers would fill absent weights with random ones; bertpipe never uses them."""
    from safetensors.torch import load_file, save_file

    weights = load_file(zoo("bert") / "model.safetensors")
    no_pooler = tmp_path / "no-pooler"
    no_pooler.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt"):
        (no_pooler / f).write_bytes((zoo("bert") / f).read_bytes())
    save_file({k: v for k, v in weights.items() if not k.startswith("pooler.")},
              no_pooler / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelError, match="pooling pooler: .* no trained pooler weights"):
        extractor(no_pooler, tmp_path, {"p": VIEWS["pooler"]})
    ok = extractor(no_pooler, tmp_path, {"mean": VIEWS["mean"]}).encode_texts(TEXTS[:2]).docs
    want, _ = oracle(zoo("bert"), TEXTS[:2], {"mean": VIEWS["mean"]})
    assert_views_equal(ok, want)
    save_file({k: v for k, v in weights.items() if "layer.1.output.dense" not in k},
              no_pooler / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelError, match=r"lacks weights for \['encoder.layer.1.output.dense"):
        extractor(no_pooler, tmp_path, {"mean": VIEWS["mean"]})
