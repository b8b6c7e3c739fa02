"""Tiny 16-token Llamas and perturbed copies as drafters; with the letters tokenizer (tokens 3-15 are
the letters a-m, byte-level, which llguidance reads), the grammar tests' model pair."""
from __future__ import annotations

import string
from pathlib import Path

import torch

from drafter_helpers import perturbed_copy

LETTERS = string.ascii_lowercase[:13]  # token 3 + i is LETTERS[i]


def save_letter_tokenizer(out_dir) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: 3 + i for i, c in enumerate(LETTERS)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(out_dir / "tokenizer.json"))


def tiny16_pair(tmp_path_factory, name: str, seed: int, drafter_scale: float, tokenizer: bool = False):
    """(target dir, drafter dir, the target as a transformers model): a 16-token Llama with
    spread-out random weights and a perturbed copy of it (scale: how much the drafter disagrees);
    tokenizer: both get the letters tokenizer."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    target = tmp_path_factory.mktemp(f"{name}_target")
    model.save_pretrained(target)
    drafter = perturbed_copy(str(target), tmp_path_factory.mktemp(f"{name}_drafter"), scale=drafter_scale)
    if tokenizer:
        save_letter_tokenizer(target)
        save_letter_tokenizer(Path(drafter))  # so the drafter can mask its own drafts (draft_grammar.py)
    return str(target), drafter, model.eval()


def make_letters_pair(tmp_path_factory):
    # A drafter that disagrees with the target (a rejection's residual then differs from the
    # target's own distribution, so sampling the wrong one shows in the chi-square).
    return tiny16_pair(tmp_path_factory, "letters", seed=5, drafter_scale=1.0, tokenizer=True)
