"""Prompts to token ids: the chat template, completion prompts, and the context-length checks."""
from __future__ import annotations

from specd.models import chat
from specd.models.tokenizer import Tokenizer

from .errors import bad_request


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    try:
        return chat.chat_prompt_ids(tokenizer, messages, tools)
    except chat.ChatTemplateError as e:
        message = str(e) + ("; use /v1/completions" if not tokenizer.chat_template else "")
        raise bad_request(message, param="messages") from None


def completion_prompt_ids(tokenizer: Tokenizer, prompt: str | list, vocab_size: int) -> list[int]:
    """prompt: a string, a token-id list, or a list holding one of those (n=1 only)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_request(f"only one prompt per request is supported, got {len(prompt)}", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if not prompt:
        raise bad_request("prompt must not be empty", param="prompt")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"prompt token ids must be in [0, {vocab_size}), got {bad[0]}", param="prompt")
    return list(prompt)


# Normalizers (NFKC, stripping) may shorten a text before it is tokenized: leave them room.
NORMALIZER_SLACK = 4


def check_prompt_size(tokenizer: Tokenizer, texts: list[str], max_model_len: int, param: str) -> None:
    """400 for text that certainly has more than max_model_len tokens, known from its size alone:
    checked before tokenizing, so a 4 MB prompt costs microseconds, not seconds of tokenizer."""
    limit = max_model_len * tokenizer.max_token_bytes() * NORMALIZER_SLACK
    size = sum(len(t) for t in texts)  # characters: at most the bytes; bytes only when close
    if size > limit // 4 and sum(len(t.encode("utf-8", "surrogatepass")) for t in texts) > limit:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens; the {param} is far "
                          f"longer ({size} characters); shorten it", param=param)


def resolve_max_tokens(prompt_len: int, requested: int | None, max_model_len: int, prompt_param: str) -> int:
    """Default: the rest of the context (as vLLM). Values < 1 are left to SamplingParams' check."""
    if prompt_len >= max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
                          f"{prompt_len} tokens; shorten it", param=prompt_param)
    if requested is None:
        return max_model_len - prompt_len
    if requested >= 1 and prompt_len + requested > max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens, but {prompt_len} prompt "
                          f"tokens + max_tokens {requested} = {prompt_len + requested}; reduce max_tokens or the "
                          "prompt", param="max_tokens")
    return requested
