"""Tokenizer of a model directory, read with the `tokenizers` library (no transformers)."""
from __future__ import annotations

import functools
import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

# What Tokenizer.from_dir reads: the vocabulary, its config, the chat template (either file).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json")


class Tokenizer:
    def __init__(self, tokenizer: _HFTokenizer, config: dict):
        self._tok = tokenizer
        self.config = config
        self.chat_template: str | None = _default_template(config.get("chat_template"))

    @classmethod
    def from_dir(cls, model_dir: Path) -> "Tokenizer | None":
        """None when the directory has no tokenizer.json (token-id prompts still work)."""
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            return None
        config = {}
        cfg_path = Path(model_dir) / "tokenizer_config.json"
        if cfg_path.is_file():
            with open(cfg_path) as f:
                config = json.load(f)
        tok = cls(_HFTokenizer.from_file(str(path)), config)
        tok.chat_template = find_chat_template(Path(model_dir), config)
        return tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_strs(self, ids: list[int]) -> list[str | None]:
        """Each id's vocabulary string (byte-level "Ġword", metaspace "▁word"), as transformers'
        convert_ids_to_tokens; None for an id the vocabulary lacks."""
        return [self._tok.id_to_token(i) for i in ids]

    def added_token_id(self, text: str) -> int | None:
        """The id of the added token (special or not) whose content is exactly text; None if none is."""
        return next((i for i, t in self._tok.get_added_tokens_decoder().items() if t.content == text), None)

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """The tokens decode(skip_special_tokens=True) drops."""
        return frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    def max_token_bytes(self) -> int:
        """An upper bound on the UTF-8 bytes one token stands for (its vocabulary string, which
        byte-level, metaspace and byte-fallback forms only lengthen, plus a joining space): a text
        of more than n times this many bytes needs more than n tokens, known without tokenizing."""
        if not hasattr(self, "_max_token_bytes"):
            vocab = self._tok.get_vocab(with_added_tokens=True)
            self._max_token_bytes = max((len(t.encode("utf-8")) for t in vocab), default=1) + 1
        return self._max_token_bytes

    def vocab_hash(self) -> str:
        """sha256 of the token<->id table: equal hashes mean ids mean the same tokens."""
        import hashlib

        table = sorted(self._tok.get_vocab(with_added_tokens=True).items(), key=lambda kv: (kv[1], kv[0]))
        return hashlib.sha256(json.dumps(table, ensure_ascii=False).encode()).hexdigest()


def vocab_hash_of(model_dir: Path | str) -> str:
    """The vocabulary hash of a model directory; "" when it has no tokenizer.json."""
    tok = Tokenizer.from_dir(Path(model_dir))
    return tok.vocab_hash() if tok is not None else ""


def _default_template(template) -> str | None:
    """tokenizer_config may hold a string or a list of named templates; "default" is the chat one."""
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return template or None


def find_chat_template(model_dir: Path, config: dict) -> str | None:
    """Where transformers keeps it, newest first: chat_template.jinja (transformers >= 4.43
    saves it there), chat_template.json, then tokenizer_config.json's chat_template."""
    jinja_path = model_dir / "chat_template.jinja"
    if jinja_path.is_file():
        return jinja_path.read_text(encoding="utf-8") or None
    json_path = model_dir / "chat_template.json"
    if json_path.is_file():
        with open(json_path, encoding="utf-8") as f:
            template = _default_template(json.load(f).get("chat_template"))
        if template:
            return template
    return _default_template(config.get("chat_template"))
