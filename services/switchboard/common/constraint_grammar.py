"""Structured output: one constraint (kind + spec) -> an llguidance grammar, for both roles.

The gateway checks a request's constraint with ``check_structured_output`` before it is queued
(no tokenizer needed: syntax, schema keywords, regex and grammar errors), the engine core
compiles it against the model's tokenizer (``engine/constrained_decoding.py``). Both start from
``to_grammar``, so what the gateway accepts is exactly what the engine compiles.

Kinds (``wire.engine_msgs.StructuredOutputParams.kind``) and their ``spec``:

============== ==============================================================================
json_schema    a JSON Schema document (llguidance's JSON subset; unknown keywords are errors)
json_object    "" : any JSON object
regex          a regular expression the whole output must match (Rust ``regex`` syntax)
grammar        a Lark grammar (llguidance's dialect), or a GBNF / EBNF one (converted to Lark)
choice         a JSON list of strings: the output is exactly one of them
structural_tag a JSON object in vLLM's format: ``{"structures": [{"begin", "schema", "end"}],
               "triggers": [...]}``: free text in which every ``begin`` (which starts with one of
               the triggers) is followed by JSON of its schema and then ``end``
============== ==============================================================================

llguidance is imported lazily: the client install (no server extra) imports this module only to
read the kinds.
"""

from __future__ import annotations

import json
from typing import Any

KINDS = ("json_schema", "json_object", "regex", "grammar", "choice", "structural_tag")
MAX_SPEC_CHARS = 1 << 20  # a schema, grammar or regex of at most 1 MiB (the engine checks too)
MAX_CHOICES = 4096
# JSON on one line with the usual separators: flexible whitespace lets a small model loop on
# newlines until max_tokens. A schema's own "x-guidance" options override these.
JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Every object must give "properties" ("patternProperties") exactly the keys it names unless it
# says "additionalProperties" itself: vLLM's default grammar backend (xgrammar, strict mode) and
# OpenAI's strict schemas do the same. JSON Schema's own default (any other key) lets a model
# open a key of its own and write it until max_tokens: a routers' tool-call schema (an array of
# {"name", "parameters"} objects that does not say) ended so.
ADDITIONAL_PROPERTIES_DEFAULT = False


class StructuredOutputError(ValueError):
    """The constraint cannot be compiled; the message says why (safe to show the client)."""


def to_grammar(kind: str, spec: str) -> str:
    """The llguidance grammar (a JSON string) for one constraint; StructuredOutputError if the
    spec is malformed before any compiling (bad JSON, an empty choice list, ...)."""
    import llguidance

    matcher = llguidance.LLMatcher
    if kind == "json_schema":
        schema = _json(spec, "json_schema: not valid JSON")
        if not isinstance(schema, dict | bool):
            raise StructuredOutputError("json_schema: a schema is a JSON object (or a boolean)")
        closed = json.dumps(closed_objects(schema))
        return _from(lambda: matcher.grammar_from_json_schema(closed, JSON_OPTIONS), kind)
    if kind == "json_object":
        return matcher.grammar_from_json_schema('{"type": "object"}', JSON_OPTIONS)
    if kind == "regex":
        if not spec:
            raise StructuredOutputError("regex: must not be empty")
        return matcher.grammar_from_regex(spec)
    if kind == "grammar":
        if not spec.strip():
            raise StructuredOutputError("grammar: must not be empty")
        return _from(lambda: llguidance.grammar_from("grammar", spec), kind)
    if kind == "choice":
        return matcher.grammar_from_lark(_choice_lark(spec))
    if kind == "structural_tag":
        return matcher.grammar_from_lark(_structural_tag_lark(spec))
    raise StructuredOutputError(f"unknown structured output kind {kind!r}: one of {KINDS}")


def check_structured_output(kind: str, spec: str) -> None:
    """Raise StructuredOutputError naming the problem if the constraint does not compile."""
    import llguidance

    if len(spec) > MAX_SPEC_CHARS:
        raise StructuredOutputError(f"{kind}: at most {MAX_SPEC_CHARS} characters")
    grammar = to_grammar(kind, spec)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise StructuredOutputError(f"{kind}: {error.strip()}")


def closed_objects(schema: Any) -> Any:
    """A copy of the schema in which every object schema that names its properties and does not
    say ``additionalProperties`` allows no other key (ADDITIONAL_PROPERTIES_DEFAULT). Only
    subschemas are walked: ``enum``, ``const``, ``default`` values and property names stay as
    they are."""
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            closed[key] = {name: closed_objects(sub) for name, sub in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            closed[key] = [closed_objects(sub) for sub in value]
        elif key in _SCHEMAS:  # "items" may be a list too (a tuple, before prefixItems)
            closed[key] = (
                [closed_objects(sub) for sub in value]
                if isinstance(value, list)
                else closed_objects(value)
            )
    names_keys = "properties" in schema or "patternProperties" in schema
    if names_keys and "additionalProperties" not in schema:
        closed["additionalProperties"] = ADDITIONAL_PROPERTIES_DEFAULT
    return closed


# JSON Schema keywords whose values are subschemas: a name -> schema map, a list, one schema
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMAS = (
    "items", "additionalItems", "additionalProperties", "unevaluatedProperties",
    "unevaluatedItems", "not", "if", "then", "else", "contains", "propertyNames",
)  # fmt: skip


def _json(spec: str, message: str) -> Any:
    try:
        return json.loads(spec)
    except ValueError as exc:
        raise StructuredOutputError(f"{message} ({exc})") from None


def _from(make: Any, kind: str) -> str:
    try:
        return str(make())
    except (ValueError, TypeError) as exc:
        raise StructuredOutputError(f"{kind}: {exc}") from None


def _choice_lark(spec: str) -> str:
    values = _json(spec, "choice: the values are not a JSON list")
    if not isinstance(values, list) or not values:
        raise StructuredOutputError("choice: at least one value")
    if len(values) > MAX_CHOICES:
        raise StructuredOutputError(f"choice: at most {MAX_CHOICES} values")
    for i, value in enumerate(values):
        if not isinstance(value, str) or not value:
            raise StructuredOutputError(f"choice.values[{i}]: must be a non-empty string")
    return "start: " + " | ".join(json.dumps(v) for v in values)


def _structural_tag_lark(spec: str) -> str:
    from llguidance import StructTag

    tag = _json(spec, "structural_tag: not valid JSON")
    if not isinstance(tag, dict):
        raise StructuredOutputError("structural_tag: a JSON object with structures and triggers")
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise StructuredOutputError("structural_tag.structures: a non-empty list")
    if (
        not isinstance(triggers, list)
        or not triggers
        or not all(isinstance(t, str) and t for t in triggers)
    ):
        raise StructuredOutputError("structural_tag.triggers: a non-empty list of strings")
    tags = []
    for i, item in enumerate(structures):
        field = f"structural_tag.structures[{i}]"
        if not isinstance(item, dict):
            raise StructuredOutputError(f"{field}: an object with begin, schema, end")
        begin, end = item.get("begin"), item.get("end", "")
        schema = item.get("schema", {"type": "object"})
        if not isinstance(begin, str) or not isinstance(end, str):
            raise StructuredOutputError(f"{field}: begin and end are strings")
        if not isinstance(schema, dict | bool):
            raise StructuredOutputError(f"{field}.schema: a JSON schema object")
        trigger = next((t for t in triggers if begin.startswith(t)), None)
        if trigger is None:
            raise StructuredOutputError(f"{field}.begin: must start with one of the triggers")
        grammar = json.dumps(closed_objects(schema))
        tags.append(StructTag(trigger=trigger, begin=begin, grammar=grammar, end=end))
    try:
        return StructTag.to_grammar(tags)
    except (ValueError, TypeError, AssertionError) as exc:
        raise StructuredOutputError(f"structural_tag: {exc}") from None
