"""Chat messages -> prompt token ids through the model's own chat template.

Rendered in the sandboxed Jinja environment Hugging Face uses, so templates behave as they
do there. Shared by the gateway, the offline API, drafter training and the benchmarks.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from specd.models.tokenizer import Tokenizer


class ChatTemplateError(ValueError):
    pass


def _raise(message: str):
    raise jinja2.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' tojson: no HTML escaping, unsorted keys, non-ASCII kept (Jinja's differs)
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks;
    rendering just keeps the body, as transformers does outside return_assistant_tokens_mask."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", _GenerationTag])
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = _tojson
    return env.from_string(template)


def special_token(tokenizer: Tokenizer, name: str) -> str:
    value = tokenizer.config.get(name) or ""
    return value.get("content", "") if isinstance(value, dict) else value  # AddedToken-style entries


def render_chat(tokenizer: Tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                tools: list[dict] | None = None) -> str:
    if not tokenizer.chat_template:
        raise ChatTemplateError("this model has no chat template (looked in chat_template.jinja, "
                                "chat_template.json and tokenizer_config.json)")
    if not messages:
        raise ChatTemplateError("messages must not be empty")
    # Every special token the tokenizer config names (bos_token, eos_token, pad_token, ...), as transformers passes them.
    specials = {k: special_token(tokenizer, k) for k in tokenizer.config if k.endswith("_token")}
    specials.setdefault("bos_token", "")
    specials.setdefault("eos_token", "")
    try:
        extra = {"tools": tools} if tools else {}  # templates test `tools is defined` / `if tools`
        return _compile(tokenizer.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **extra, **specials)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {e}") from None


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[dict], tools: list[dict] | None = None,
                    add_generation_prompt: bool = True, add_special_tokens: bool | None = None) -> list[int]:
    """add_special_tokens None: the tokenizer's special tokens (BOS) only where the template does
    not write them itself; true or false: as told (vLLM's /tokenize field)."""
    text = render_chat(tokenizer, messages, add_generation_prompt, tools=tools)
    if add_special_tokens is None:
        bos = special_token(tokenizer, "bos_token")
        # Templates that write BOS themselves must not get a second one from the tokenizer;
        # those that do not get the one the tokenizer adds to any prompt.
        add_special_tokens = not (bos and text.startswith(bos))
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)
