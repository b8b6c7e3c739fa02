"""POST /tokenize and /detokenize, as vLLM's OpenAI server defines them.

/tokenize takes a prompt, or chat messages with the chat template applied as /v1/chat/completions
applies it (so `count` is the prompt_tokens a chat request with the same messages and tools
reports), and answers {"count", "max_model_len", "tokens", "token_strs"}; a count over
max_model_len is answered, not refused (clients ask in order to cut). /detokenize takes token ids
and answers {"prompt": text}, special tokens kept (as vLLM decodes). The work runs on the
gateway's tokenizer pool; text certainly over the context is refused before it (prompts.py).
"""
from __future__ import annotations

from functools import partial
from typing import Callable

from specd.models import chat
from specd.models.tokenizer import Tokenizer

from . import tools
from .config import ModelInfo
from .errors import APIError, bad_request
from .prompts import check_prompt_size
from .schemas import Message, _Body


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    # None: as /v1/completions (prompt) and /v1/chat/completions (messages: only where the template does not
    # write BOS itself) would tokenize
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None  # messages only; default true
    continue_final_message: bool | None = None
    tools: list[dict] | None = None
    return_token_strs: bool | None = False

    def work(self, tokenizer: Tokenizer, model: ModelInfo, tool_format) -> Callable[[], dict]:
        """Checks the body (400 naming the field) and returns the tokenizing work, for the pool."""
        check_model(self.model, model)
        if self.prompt is None and self.messages is None:
            raise bad_request("set either prompt or messages", param="prompt")
        if self.prompt is not None and self.messages is not None:
            raise bad_request("set either prompt or messages, not both", param="messages")
        if self.prompt is not None:
            for name in ("add_generation_prompt", "continue_final_message", "tools"):
                if getattr(self, name) is not None:
                    raise bad_request(f"{name} applies to messages, not to a prompt", param=name)
            check_prompt_size(tokenizer, [self.prompt], model.max_model_len, "prompt")
            return partial(self._answer, tokenizer, model, self.prompt, None)
        if self.continue_final_message:
            raise bad_request("continue_final_message is not supported: the template always ends the last message",
                              param="continue_final_message")
        if not self.messages:
            raise bad_request("messages must not be empty", param="messages")
        try:
            tools.check(self.tools, None, tool_format, tokenizer.chat_template)
        except ValueError as e:
            param, _, message = str(e).partition(": ")
            raise bad_request(message, param=param) from None
        messages = tools.template_messages([m.to_template() for m in self.messages])
        check_prompt_size(tokenizer, [m["content"] for m in messages] + [m.get("name") or "" for m in messages],
                          model.max_model_len, "messages")
        return partial(self._answer, tokenizer, model, None, messages)

    def _answer(self, tokenizer: Tokenizer, model: ModelInfo, prompt: str | None, messages: list[dict] | None) -> dict:
        if prompt is not None:
            ids = tokenizer.encode(prompt, add_special_tokens=self.add_special_tokens is not False)
        else:
            try:
                ids = chat.chat_prompt_ids(tokenizer, messages, self.tools or None,
                                           add_generation_prompt=self.add_generation_prompt is not False,
                                           add_special_tokens=self.add_special_tokens)
            except chat.ChatTemplateError as e:
                raise bad_request(str(e), param="messages") from None
        return {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids,
                "token_strs": tokenizer.token_strs(ids) if self.return_token_strs else None}


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]

    def work(self, tokenizer: Tokenizer, model: ModelInfo) -> Callable[[], dict]:
        check_model(self.model, model)
        # as a completion's token-id prompt: ids of the served model's vocabulary, not far over its context
        bad = next((t for t in self.tokens if not 0 <= t < model.vocab_size), None)
        if bad is not None:
            raise bad_request(f"tokens must be in [0, {model.vocab_size}), got {bad}", param="tokens")
        if len(self.tokens) > 4 * model.max_model_len:
            raise bad_request(f"at most {4 * model.max_model_len} tokens (4 x max_model_len), got {len(self.tokens)}",
                              param="tokens")
        return lambda: {"prompt": tokenizer.decode(self.tokens, skip_special_tokens=False)}


def check_model(name: str | None, model: ModelInfo) -> None:
    if name is not None and name != model.name:
        raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
