"""Tokenizer of a model directory, read with the `tokenizers` library (no transformers)."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer


class Tokenizer:
    def __init__(self, tokenizer: _HFTokenizer, config: dict):
        self._tok = tokenizer
        self.config = config
        self.chat_template: str | None = config.get("chat_template")

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
        return cls(_HFTokenizer.from_file(str(path)), config)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def vocab_hash(self) -> str:
        """sha256 of the token<->id table: equal hashes mean ids mean the same tokens."""
        import hashlib

        table = sorted(self._tok.get_vocab(with_added_tokens=True).items(), key=lambda kv: (kv[1], kv[0]))
        return hashlib.sha256(json.dumps(table, ensure_ascii=False).encode()).hexdigest()


def vocab_hash_of(model_dir: Path | str) -> str:
    """The vocabulary hash of a model directory; "" when it has no tokenizer.json."""
    tok = Tokenizer.from_dir(Path(model_dir))
    return tok.vocab_hash() if tok is not None else ""
