"""Prompts to token ids: the chat template, completion prompts, and the context-length checks."""
from __future__ import annotations

from functools import lru_cache

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from specd.tokenizer import Tokenizer

from .errors import bad_request


def _raise(message: str):
    raise jinja2.TemplateError(message)


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    # The environment Hugging Face renders chat templates with, so templates behave as they do there.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise
    return env.from_string(template)


def _special(tokenizer: Tokenizer, name: str) -> str:
    value = tokenizer.config.get(name) or ""
    return value.get("content", "") if isinstance(value, dict) else value  # AddedToken-style entries


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[dict]) -> list[int]:
    if not tokenizer.chat_template:
        raise bad_request("this model has no chat template; use /v1/completions", param="messages")
    if not messages:
        raise bad_request("messages must not be empty", param="messages")
    bos = _special(tokenizer, "bos_token")
    try:
        text = _compile(tokenizer.chat_template).render(
            messages=messages, add_generation_prompt=True, bos_token=bos, eos_token=_special(tokenizer, "eos_token"))
    except jinja2.TemplateError as e:
        raise bad_request(f"chat template failed: {e}", param="messages") from None
    # Templates that write BOS themselves must not get a second one from the tokenizer;
    # those that do not (the demo model's) get the one the tokenizer adds to any prompt.
    return tokenizer.encode(text, add_special_tokens=not (bos and text.startswith(bos)))


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
