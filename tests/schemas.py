"""50 JSON-schema requests for structured output: nested objects, enums, arrays and numbers, with a chat prompt each.

Shared by tests/test_structured_output.py and benchmarks/structured_output.py. Strings and arrays are bounded
(``maxLength``, ``maxItems``) as a client bounds them, so that every output completes within the token budget.
"""

import json

SUBJECTS = [
    ("person", "a software engineer living in Lisbon"),
    ("product", "a stainless steel water bottle sold online"),
    ("book", "a classic science fiction novel"),
    ("city", "a large port city in Asia"),
    ("event", "a music festival held every summer"),
    ("recipe", "a vegetarian pasta dish"),
    ("movie", "an animated film for children"),
    ("company", "a small bakery that delivers bread"),
    ("car", "a compact electric car"),
    ("planet", "a rocky planet in our solar system"),
]

#: Enum fields by variant.
ENUMS = [("status", ["active", "inactive", "pending"]), ("rating", ["low", "medium", "high"]),
         ("category", ["basic", "standard", "premium"]), ("size", ["small", "medium", "large"]),
         ("priority", ["p0", "p1", "p2", "p3"])]

TOKEN_BUDGET = 256


def _string(n=24):
    return {"type": "string", "maxLength": n}


def schema(kind: str, variant: int) -> dict:
    """The JSON schema of request ``variant`` (0-4) about ``kind``: every one nests an object and holds an enum, an
    array and a number."""
    enum_name, enum_values = ENUMS[variant]
    props = {
        "name": _string(),
        enum_name: {"type": "string", "enum": enum_values},
        "details": {
            "type": "object",
            "properties": {"summary": _string(40), "year": {"type": "integer", "minimum": 1800, "maximum": 2100}},
            "required": ["summary", "year"], "additionalProperties": False,
        },
    }
    if variant in (0, 2, 4):
        props["scores"] = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                           "minItems": 1, "maxItems": 3}
    if variant in (1, 3, 4):
        props["tags"] = {"type": "array", "items": _string(12), "minItems": 1, "maxItems": 3}
    if variant in (1, 2):
        props["price"] = {"type": "number", "minimum": 0, "maximum": 10000}
    if variant == 3:
        props["parts"] = {"type": "array", "maxItems": 2, "items": {
            "type": "object", "properties": {"label": _string(12), "count": {"type": "integer", "minimum": 0,
                                                                              "maximum": 99}},
            "required": ["label", "count"], "additionalProperties": False}}
    if variant == 0:
        props["available"] = {"type": "boolean"}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def requests():
    """``[(messages, response_format, schema)]``: the 50 requests."""
    out = []
    for variant in range(5):
        for kind, about in SUBJECTS:
            s = schema(kind, variant)
            messages = [{"role": "user", "content": f"Describe {about} as a JSON {kind} with the fields "
                                                    f"{', '.join(s['properties'])}."}]
            fmt = {"type": "json_schema", "json_schema": {"name": f"{kind}_{variant}", "schema": s}}
            out.append((messages, fmt, s))
    return out


def parse_and_validate(text: str, s: dict) -> dict:
    """The JSON value of ``text``, validated against ``s`` (raises ``json.JSONDecodeError`` or
    ``jsonschema.ValidationError``)."""
    import jsonschema

    value = json.loads(text)
    jsonschema.validate(value, s)
    return value
