"""A corpus of JSON schemas, each with a request that asks for it and an instance that satisfies it.

Used by the structured-output tests (every output must validate against its schema) and by
bench/grammar_engines.py (mask time per token, walking the instance token by token). They cover
what users send: nested objects, arrays with bounds, enums, numbers and integers with bounds,
required and optional fields, strings with patterns and lengths, nullable fields, anyOf.
Strings without a bound get maxLength 40 (patterns bound their repeats): a 135M model can stay
inside a string until max_tokens (seen: an author's first name "A.A.A.A..."), and a cut output is
not valid JSON.
"""
from __future__ import annotations

STRING_BOUND = 40


def bounded(schema):
    """schema with maxLength STRING_BOUND on every string without a length, pattern or enum."""
    if isinstance(schema, list):
        return [bounded(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bounded(v) for k, v in schema.items()}
    if schema.get("type") == "string" and not {"maxLength", "pattern", "enum", "const"} & schema.keys():
        out["maxLength"] = STRING_BOUND
    return out


_SCHEMAS: list[tuple[str, dict, object]] = [  # (request, schema, one valid instance)
    ("Describe a person.",
     {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0,
                                                                           "maximum": 150}},
      "required": ["name", "age"], "additionalProperties": False},
     {"name": "Ada", "age": 36}),
    ("Give the weather in Paris.",
     {"type": "object", "properties": {"city": {"type": "string"},
                                       "unit": {"enum": ["celsius", "fahrenheit"]},
                                       "temperature": {"type": "number", "minimum": -90, "maximum": 60}},
      "required": ["city", "unit", "temperature"], "additionalProperties": False},
     {"city": "Paris", "unit": "celsius", "temperature": 18.5}),
    ("List three fruits.",
     {"type": "object", "properties": {"fruits": {"type": "array", "items": {"type": "string"}, "minItems": 3,
                                                  "maxItems": 3}},
      "required": ["fruits"], "additionalProperties": False},
     {"fruits": ["apple", "pear", "plum"]}),
    ("Is the sky blue? Answer with a boolean and a reason.",
     {"type": "object", "properties": {"answer": {"type": "boolean"}, "reason": {"type": "string", "maxLength": 80}},
      "required": ["answer", "reason"], "additionalProperties": False},
     {"answer": True, "reason": "Rayleigh scattering"}),
    ("Give a book with its author and year.",
     {"type": "object", "properties": {
         "title": {"type": "string"},
         "author": {"type": "object", "properties": {"first": {"type": "string"}, "last": {"type": "string"}},
                    "required": ["first", "last"], "additionalProperties": False},
         "year": {"type": "integer", "minimum": 1450, "maximum": 2030}},
      "required": ["title", "author", "year"], "additionalProperties": False},
     {"title": "Emma", "author": {"first": "Jane", "last": "Austen"}, "year": 1815}),
    ("Rate this movie from 1 to 5.",
     {"type": "object", "properties": {"rating": {"type": "integer", "minimum": 1, "maximum": 5}},
      "required": ["rating"], "additionalProperties": False},
     {"rating": 4}),
    ("Give the sentiment of: I love this phone.",
     {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                                       "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
      "required": ["sentiment", "confidence"], "additionalProperties": False},
     {"sentiment": "positive", "confidence": 0.9}),
    ("Give a point in 3D.",
     {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}, "z": {"type": "number"}},
      "required": ["x", "y", "z"], "additionalProperties": False},
     {"x": 1.0, "y": -2.5, "z": 0}),
    ("Make a shopping list with quantities.",
     {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 5, "items": {
         "type": "object", "properties": {"name": {"type": "string"},
                                          "quantity": {"type": "integer", "minimum": 1, "maximum": 99}},
         "required": ["name", "quantity"], "additionalProperties": False}}},
      "required": ["items"], "additionalProperties": False},
     {"items": [{"name": "milk", "quantity": 2}]}),
    ("Give an HTTP response status.",
     {"type": "object", "properties": {"code": {"type": "integer", "enum": [200, 201, 400, 404, 500]},
                                       "message": {"type": "string"}},
      "required": ["code", "message"], "additionalProperties": False},
     {"code": 404, "message": "Not Found"}),
    ("Give a US zip code for New York.",
     {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
      "required": ["zip"], "additionalProperties": False},
     {"zip": "10001"}),
    ("Give a username.",
     {"type": "object", "properties": {"username": {"type": "string", "pattern": "^[a-z][a-z0-9_]{2,11}$"}},
      "required": ["username"], "additionalProperties": False},
     {"username": "ada_l"}),
    ("Give a company with its employees.",
     {"type": "object", "properties": {
         "company": {"type": "string"},
         "employees": {"type": "array", "maxItems": 3, "items": {
             "type": "object", "properties": {"name": {"type": "string"},
                                              "role": {"enum": ["engineer", "manager", "designer"]}},
             "required": ["name", "role"], "additionalProperties": False}}},
      "required": ["company", "employees"], "additionalProperties": False},
     {"company": "Acme", "employees": [{"name": "Bo", "role": "engineer"}]}),
    ("Give a date.",
     {"type": "object", "properties": {"year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                                       "month": {"type": "integer", "minimum": 1, "maximum": 12},
                                       "day": {"type": "integer", "minimum": 1, "maximum": 31}},
      "required": ["year", "month", "day"], "additionalProperties": False},
     {"year": 2024, "month": 5, "day": 17}),
    ("Give a product with an optional discount.",
     {"type": "object", "properties": {"name": {"type": "string"},
                                       "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 10000},
                                       "discount": {"type": ["number", "null"], "minimum": 0, "maximum": 1}},
      "required": ["name", "price"], "additionalProperties": False},
     {"name": "lamp", "price": 25.0, "discount": None}),
    ("Give the colors of a flag as RGB.",
     {"type": "object", "properties": {"colors": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
         "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255}, "minItems": 3, "maxItems": 3}}},
      "required": ["colors"], "additionalProperties": False},
     {"colors": [[0, 85, 164], [255, 255, 255]]}),
    ("Answer yes or no: is water wet?",
     {"enum": ["yes", "no"]},
     "yes"),
    ("Give a number between 1 and 10.",
     {"type": "integer", "minimum": 1, "maximum": 10},
     7),
    ("Give a shape: a circle with a radius or a square with a side.",
     {"anyOf": [
         {"type": "object", "properties": {"kind": {"const": "circle"}, "radius": {"type": "number", "minimum": 0}},
          "required": ["kind", "radius"], "additionalProperties": False},
         {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "number", "minimum": 0}},
          "required": ["kind", "side"], "additionalProperties": False}]},
     {"kind": "circle", "radius": 2}),
    ("Give a to-do list with priorities and tags.",
     {"type": "object", "properties": {"todos": {"type": "array", "maxItems": 3, "items": {
         "type": "object", "properties": {
             "task": {"type": "string", "maxLength": 40},
             "priority": {"enum": ["low", "medium", "high"]},
             "done": {"type": "boolean"},
             "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
         "required": ["task", "priority", "done"], "additionalProperties": False}}},
      "required": ["todos"], "additionalProperties": False},
     {"todos": [{"task": "write tests", "priority": "high", "done": False, "tags": ["dev"]}]}),
    ("Give the capital of France with its population.",
     {"type": "object", "properties": {"country": {"type": "string"}, "capital": {"type": "string"},
                                       "population_millions": {"type": "number", "minimum": 0, "maximum": 50}},
      "required": ["country", "capital", "population_millions"], "additionalProperties": False},
     {"country": "France", "capital": "Paris", "population_millions": 2.1}),
    ("Extract the email and phone from: call Bo at 555-0100 or bo@example.com.",
     {"type": "object", "properties": {"email": {"type": "string", "pattern": "^[a-z.]{1,20}@[a-z]{1,12}\\.[a-z]{2,4}$"},
                                       "phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}},
      "required": ["email", "phone"], "additionalProperties": False},
     {"email": "bo@example.com", "phone": "555-0100"}),
]

SCHEMAS = [(request, bounded(schema), instance) for request, schema, instance in _SCHEMAS]
