"""What a request's output must match (vLLM's `structured_outputs` keys) and its grammar text.

Torch-free, so the gateway checks a request's schema or grammar (a clear 400) without loading
the engine; the verifier compiles it against its tokenizer (specd/engine/grammar.py).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match: exactly one of vLLM's `structured_outputs` keys."""

    json: str | None = None  # a JSON schema (serialised)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None  # Lark (llguidance's dialect) or GBNF (llama.cpp's)

    @classmethod
    def from_dict(cls, d: dict) -> "StructuredOutput":
        """From vLLM's keys (json, json_object, regex, choice, grammar); ValueError names the problem."""
        if not isinstance(d, dict):
            raise ValueError("structured_outputs must be an object")
        keys = [k for k, v in d.items() if v not in (None, False)]
        unknown = set(keys) - {"json", "json_object", "regex", "choice", "grammar"}
        if unknown:
            raise ValueError(f"structured_outputs: unknown key(s) {', '.join(sorted(unknown))} "
                             "(json, json_object, regex, choice, grammar)")
        if len(keys) != 1:
            raise ValueError("structured_outputs takes exactly one of json, json_object, regex, choice, grammar")
        key, value = keys[0], d[keys[0]]
        if key == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(value, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema (an object)")
            return cls(json=json.dumps(value))  # key order kept: the output follows it
        if key == "json_object":
            return cls(json_object=True)
        if key == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
            return cls(choice=tuple(value))
        if not isinstance(value, str) or not value:
            raise ValueError(f"structured_outputs.{key} must be a non-empty string")
        return cls(**{key: value})

    @classmethod
    def from_response_format(cls, fmt: dict | None) -> "StructuredOutput | None":
        """From OpenAI's response_format (text, json_object, json_schema); None for free text."""
        if fmt is None or fmt.get("type") == "text":
            return None
        if fmt.get("type") == "json_object":
            return cls(json_object=True)
        if fmt.get("type") == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise ValueError('json_schema must be an object with the schema under "schema"')
            # OpenAI's json_schema without "schema" is any JSON object.
            return cls.from_dict({"json": spec.get("schema", {"type": "object"})})
        raise ValueError(f"type must be text, json_object or json_schema, got {json.dumps(fmt.get('type'))}")

    @property
    def kind(self) -> str:
        return next(iter(self.to_dict()))

    def to_dict(self) -> dict:
        if self.json is not None:
            return {"json": self.json}
        if self.json_object:
            return {"json_object": True}
        if self.choice is not None:
            return {"choice": list(self.choice)}
        return {"regex": self.regex} if self.regex is not None else {"grammar": self.grammar}


# JSON text the way a model writes it best: compact separators, no free whitespace (a model
# allowed any whitespace can spend its tokens on newlines).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(s: StructuredOutput) -> str:
    """llguidance's grammar for s (no tokenizer needed); ValueError where it cannot be built."""
    import llguidance

    if s.json is not None or s.json_object:
        schema = json.loads(s.json) if s.json is not None else {"type": "object"}
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        except ValueError as e:
            raise ValueError(f"JSON schema: {e}") from None
    if s.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(s.regex)
    if s.choice is not None:
        return llguidance.LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in s.choice))
    text = s.grammar
    if "::=" in text:  # GBNF, llama.cpp's grammar format
        from llguidance.gbnf_to_lark import gbnf_to_lark  # llguidance.gbnf_to_lark is the module

        try:
            text = gbnf_to_lark(text)
        except Exception as e:  # noqa: BLE001 - the converter's own error, or Exception, IndexError...: a bad grammar
            raise ValueError(f"GBNF grammar: {e or type(e).__name__}") from None
    return llguidance.LLMatcher.grammar_from_lark(text)


def check(s: StructuredOutput) -> None:
    """ValueError with llguidance's message where the grammar is invalid (the gateway's 400)."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(grammar_text(s))
    if error and not error.startswith("WARNING"):
        raise ValueError(f"structured output: {error.strip()}")
