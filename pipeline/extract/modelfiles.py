"""What a model folder says about the model without loading it: its config, its
tokenizer, its weight files' names and headers. No torch and no transformers on the common
path, so `bertpipe validate` and `bertpipe inspect` start in about a second.

`load_config` reads `config.json` with the json module for the encoder families whose keys
it knows (`CONFIG_KEYS`); any other config (another family, a key missing, a value that is
not a positive integer, code of the model's own) goes through transformers' AutoConfig, so
that whatever AutoConfig refuses is refused with its message, as before. `load_tokenizer`
reads `tokenizer.json` with the tokenizers library, the same backend (and the same file)
that transformers' fast tokenizer wraps; a folder without one goes through AutoTokenizer.
`tests/test_modelfiles.py` checks both against transformers on every family it builds.
"""

from __future__ import annotations

import json
import struct
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from ..errors import ModelError, first_line
from ..fileutil import sha256_file
from ..spec import ModelSpec

# model types whose position table starts after padding_idx (RoBERTa-style embeddings): what
# `families.reserved_positions` finds on a loaded module, known from the config before loading
PADDING_OFFSET_POSITIONS = frozenset({"roberta", "xlm-roberta", "camembert", "longformer",
                                      "roberta-prelayernorm", "xlm-roberta-xl"})

# The families read without transformers, and the config.json key of each field where the
# family names it differently (transformers' attribute_map for that config class).
_STANDARD = {"num_hidden_layers": "num_hidden_layers", "hidden_size": "hidden_size",
             "num_attention_heads": "num_attention_heads",
             "max_position_embeddings": "max_position_embeddings"}
CONFIG_KEYS: dict[str, dict[str, str]] = {
    **{kind: _STANDARD for kind in ("bert", "roberta", "xlm-roberta", "camembert", "electra",
                                     "albert", "deberta", "deberta-v2", "modernbert")},
    "distilbert": {"num_hidden_layers": "n_layers", "hidden_size": "dim",
                   "num_attention_heads": "n_heads",
                   "max_position_embeddings": "max_position_embeddings"},
}


@dataclass(frozen=True)
class ModelConfig:
    """The facts bertpipe reads from a model's config (named as transformers names them)."""

    model_type: str
    num_hidden_layers: int | None  # None: the config gives none (model_shape refuses it)
    hidden_size: int | None
    num_attention_heads: int | None
    max_position_embeddings: int
    pad_token_id: int | None
    is_decoder: bool

    @classmethod
    def of(cls, config: Any) -> ModelConfig:
        """From a transformers config object (the AutoConfig path)."""
        def number(name: str) -> int | None:
            value = getattr(config, name, None)
            return value if isinstance(value, int) and not isinstance(value, bool) else None

        pad = getattr(config, "pad_token_id", 1)  # absent: RoBERTa's padding_idx default
        return cls(model_type=str(getattr(config, "model_type", "?")),
                   num_hidden_layers=number("num_hidden_layers"),
                   hidden_size=number("hidden_size"),
                   num_attention_heads=number("num_attention_heads"),
                   max_position_embeddings=int(getattr(config, "max_position_embeddings", 512)),
                   pad_token_id=pad if isinstance(pad, int) else None,
                   is_decoder=bool(getattr(config, "is_decoder", False)))


def model_root(path: str) -> Path | None:
    """The local folder of a model: `path` itself, or its snapshot in the offline Hugging
    Face cache; None where neither exists."""
    root = Path(path)
    if root.is_dir():
        return root
    try:
        return cached_snapshot(path)
    except Exception:  # noqa: BLE001 - not a valid id, or not cached: either way, not there
        return None


def cached_snapshot(repo_id: str) -> Path:
    import_tqdm_quietly()  # huggingface_hub imports tqdm
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo_id, local_files_only=True))


def in_hub_cache(repo_id: str) -> bool:
    """Whether the local Hugging Face cache holds anything of `repo_id`."""
    try:
        cached_snapshot(repo_id)
    except Exception:  # noqa: BLE001 - not a valid id, or not cached: either way, not there
        return False
    return True


def import_tqdm_quietly() -> None:
    """Import tqdm.auto once, its widget warning silenced. huggingface_hub imports it under
    transformers, and in a Jupyter kernel without ipywidgets that first import warns
    'IProgress not found' into the user's notebook; bertpipe draws no widget (its own
    model loading turns the bar off), so the warning says nothing to act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="IProgress not found")
        import tqdm.auto  # noqa: F401


# ---- config --------------------------------------------------------------------------

def load_config(spec: ModelSpec) -> ModelConfig:
    """The model's config, from a local directory or the offline cache (never the network)."""
    if Path(spec.path).is_absolute() and not Path(spec.path).is_dir():
        raise ModelError(f"model.path: {spec.path} does not exist (a local model directory, "
                         "or a hub id already in the local cache)")
    root = model_root(spec.path)
    known = _read_known_config(root / "config.json", spec) if root is not None else None
    return known if known is not None else ModelConfig.of(_auto_config(spec))


def _read_known_config(path: Path, spec: ModelSpec) -> ModelConfig | None:
    """The config of a family in CONFIG_KEYS with every field a positive integer; None for
    anything else (AutoConfig decides)."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict):
        return None
    keys = CONFIG_KEYS.get(str(raw.get("model_type")))
    if keys is None or (spec.trust_remote_code and "auto_map" in raw):
        return None  # another family, or the model's own config class
    values = {field: raw.get(key) for field, key in keys.items()}
    pad = raw.get("pad_token_id")
    if raw["model_type"] in PADDING_OFFSET_POSITIONS and "pad_token_id" not in raw:
        return None  # the position table's offset comes from it: the class default decides
    numbers = {field: v for field, v in values.items() if _positive(v)}
    decoder = raw.get("is_decoder", False)
    if len(numbers) != len(values) or not _optional_int(pad) or not isinstance(decoder, bool):
        return None
    return ModelConfig(model_type=raw["model_type"], pad_token_id=pad, is_decoder=decoder,
                       num_hidden_layers=numbers["num_hidden_layers"],
                       hidden_size=numbers["hidden_size"],
                       num_attention_heads=numbers["num_attention_heads"],
                       max_position_embeddings=numbers["max_position_embeddings"])


def _positive(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _optional_int(value: Any) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool))


def _auto_config(spec: ModelSpec) -> Any:
    """transformers' AutoConfig: for configs `_read_known_config` does not take, with its
    own checks and messages. Imported here because it imports torch (seconds)."""
    from huggingface_hub.errors import HFValidationError

    import_tqdm_quietly()
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(spec.path, local_files_only=True,
                                          trust_remote_code=spec.trust_remote_code)
    except (OSError, ValueError, HFValidationError) as exc:
        if not Path(spec.path).is_absolute() and not in_hub_cache(spec.path):
            # a relative path that is no folder here was kept as a hub id (spec._model_path):
            # say that neither exists, not that the hub could not be reached
            raise ModelError(f"model.path: {spec.path!r} does not exist: no folder "
                             f"{Path(spec.path).absolute()}, and no hub id {spec.path!r} in "
                             "the local Hugging Face cache (models are never downloaded)"
                             ) from None
        raise ModelError(f"model.path: cannot load {spec.path!r} offline: {first_line(exc)}"
                         ) from None


def model_shape(config: ModelConfig, key: str = "model.path") -> tuple[int, int]:
    """(transformer blocks, hidden size) from a config, or a ModelError naming what is
    missing (an encoder config always has both)."""
    if config.num_hidden_layers is None or config.hidden_size is None:
        raise ModelError(f"{key}: its config.json gives no num_hidden_layers/hidden_size; "
                         "not a BERT-family encoder")
    return config.num_hidden_layers, config.hidden_size


def max_positions_of(config: ModelConfig, tokenizer: Any) -> int:
    """Tokens per sequence the model can take, special tokens included, from the config
    alone (validation, before any weights load): RoBERTa-style position tables reserve
    padding_idx + 1 rows, as `families.reserved_positions` finds on a loaded module."""
    limit = config.max_position_embeddings
    if config.model_type in PADDING_OFFSET_POSITIONS:
        limit -= int(config.pad_token_id or 0) + 1
    return capped_by_tokenizer(limit, tokenizer)


def capped_by_tokenizer(limit: int, tokenizer: Any) -> int:
    """`limit`, or the tokenizer's own model_max_length where that is smaller."""
    tok_limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(tok_limit, int) and 0 < tok_limit < limit:
        return tok_limit
    return limit


# ---- tokenizer -----------------------------------------------------------------------

class WordTokenizer:
    """The model's fast tokenizer as the tokenizers library gives it (`backend`, a
    `tokenizers.Tokenizer`), with what transformers adds from tokenizer_config.json:
    the length limit and the [UNK] token. Truncation and padding are off, as transformers
    sets them for a call that asks for neither."""

    def __init__(self, backend: Any, model_max_length: int | None, unk_token: str | None,
                 split_special_tokens: bool = False):
        backend.no_truncation()
        backend.no_padding()
        # a special token's string in a text is that token unless the tokenizer splits it
        backend.encode_special_tokens = split_special_tokens
        self.backend = backend
        self.model_max_length = model_max_length
        self.unk_token = unk_token
        self.unk_token_id = backend.token_to_id(unk_token) if unk_token is not None else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[Any]:
        """One `tokenizers.Encoding` per text: ids, tokens, word_ids, offsets."""
        return list(self.backend.encode_batch(list(texts),
                                              add_special_tokens=add_special_tokens))


def load_tokenizer(spec: ModelSpec) -> WordTokenizer:
    """The model's fast tokenizer from its tokenizer.json; through transformers'
    AutoTokenizer where the folder has none (it converts a slow one) or the model brings
    its own tokenizer code."""
    root = model_root(spec.path)
    if root is not None and (root / "tokenizer.json").is_file():
        settings = _tokenizer_settings(root)
        if not (spec.trust_remote_code and "auto_map" in settings):
            from tokenizers import Tokenizer

            try:
                backend = Tokenizer.from_file(str(root / "tokenizer.json"))
            except Exception as exc:  # noqa: BLE001 - the Rust loader raises plain Exception
                raise ModelError(f"model.path: cannot load the tokenizer of {spec.path!r} "
                                 f"offline: {first_line(exc)}") from None
            return WordTokenizer(backend, _max_length(settings), _unk_token(settings, backend),
                                 bool(settings.get("split_special_tokens", False)))
    tokenizer = auto_tokenizer(spec)
    limit = tokenizer.model_max_length
    return WordTokenizer(tokenizer.backend_tokenizer, limit if isinstance(limit, int) else None,
                         tokenizer.unk_token, bool(getattr(tokenizer, "split_special_tokens",
                                                           False)))


def auto_tokenizer(spec: ModelSpec) -> Any:
    """transformers' fast tokenizer (the extraction's chunking calls it): imported here
    because transformers imports torch."""
    import_tqdm_quietly()
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(spec.path, use_fast=True,
                                                  local_files_only=True,
                                                  trust_remote_code=spec.trust_remote_code)
    except (OSError, ValueError, TypeError) as exc:
        raise ModelError(f"model.path: cannot load the tokenizer of {spec.path!r} offline: "
                         f"{first_line(exc)}") from None
    if not getattr(tokenizer, "is_fast", False):
        raise ModelError(f"model.path: {spec.path!r} has no fast tokenizer (tokenizer.json)")
    return tokenizer


def _tokenizer_settings(root: Path) -> dict[str, Any]:
    """tokenizer_config.json, with special_tokens_map.json under it (transformers reads
    both; the config wins)."""
    settings: dict[str, Any] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        try:
            loaded = json.loads((root / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(loaded, dict):
            settings.update(loaded)
    return settings


def _max_length(settings: dict[str, Any]) -> int | None:
    value = settings.get("model_max_length")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _unk_token(settings: dict[str, Any], backend: Any) -> str | None:
    """The [UNK] token: named in the settings (a string, or an added-token dict), else the
    vocabulary model's own."""
    named = settings.get("unk_token")
    if isinstance(named, dict):
        named = named.get("content")
    if isinstance(named, str):
        return named
    model = json.loads(backend.to_str()).get("model", {})
    token = model.get("unk_token")
    if isinstance(token, str):
        return token
    unk_id = model.get("unk_id")
    return backend.id_to_token(unk_id) if isinstance(unk_id, int) else None


# ---- weights -------------------------------------------------------------------------

def check_weights(spec: ModelSpec) -> None:
    """The weight files the loader will take are there (safetensors, or .bin with
    `allow_pickle`), told from their names alone: a folder with a config and a tokenizer
    but no usable weights is refused before a store is made, not when a worker loads it."""
    root = model_root(spec.path)
    if root is None:  # not in the cache: load_config said so already
        return
    if any(root.glob("*.safetensors")):
        return
    pickled = sorted(p.name for p in root.glob("*.bin"))
    if pickled and spec.allow_pickle:
        return
    if pickled:
        raise ModelError(f"model.path: {spec.path!r} has only pickle weights "
                         f"({', '.join(pickled[:3])}); convert them to safetensors, or set "
                         "model.allow_pickle: true if you trust their source")
    raise ModelError(f"model.path: {spec.path!r} has no weights (no *.safetensors"
                     f"{' or *.bin' if spec.allow_pickle else ''} file)")


def has_pooler_weights(path: str) -> bool | None:
    """Whether the safetensors weights hold a pooler, read from the file headers only;
    None when that cannot be told without loading (pickle weights, no local files)."""
    root = model_root(path)
    if root is None:  # not in the cache: the loader reports it
        return None
    files = sorted(root.glob("*.safetensors"))
    if not files:
        return None
    for file in files:
        names = safetensors_names(file)
        if names is None:
            return None  # an unreadable header: the loader reports it with its own message
        if any(k.endswith("pooler.dense.weight") or k == "pooler.weight" for k in names):
            return True
    return False


def safetensors_names(path: Path) -> list[str] | None:
    """The tensor names in a safetensors file's header (8 bytes of little-endian length,
    then that many bytes of JSON); None where the header cannot be read."""
    try:
        with open(path, "rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            if size > 100_000_000:  # the format's own limit on the header
                return None
            header = json.loads(handle.read(size))
    except (OSError, ValueError, struct.error):
        return None
    if not isinstance(header, dict):
        return None
    return [k for k in header if k != "__metadata__"]


def model_fingerprint(path: str) -> dict[str, Any]:
    """SHA-256 of each weight file plus the config: what the provenance records."""
    root = Path(path)
    if not root.is_dir():
        root = cached_snapshot(path)
    weights = sorted(p for p in root.rglob("*")
                     if p.suffix in (".safetensors", ".bin") and p.is_file())
    digests = {str(p.relative_to(root)): sha256_file(p) for p in weights}
    config_path = root / "config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    return {"path": path, "weights_sha256": digests, "config": config}
