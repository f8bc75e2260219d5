"""What a request asks its output to match, read from OpenAI's `response_format` (`json_object`,
`json_schema`) or vLLM's `structured_outputs` field (`json`, `regex`, `choice`, `grammar`), as
one `StructuredOutputs`; an invalid schema, regex or grammar is a 400 naming the field."""

from __future__ import annotations

from compiled.server.protocol import bad
from compiled.structured.grammar import check
from compiled.structured.spec import KINDS, StructuredOutputs


def response_format(body: dict) -> StructuredOutputs | None:
    """OpenAI's `response_format`: `text` (no constraint), `json_object` (any JSON object) or
    `json_schema` (`{"json_schema": {"name", "schema", "strict"}}`). `strict` false still
    constrains: a schema given is a schema kept."""
    value = body.get("response_format")
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad("response_format", f"expected an object with a type, got {value!r}")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind != "json_schema":
        raise bad("response_format", f"type must be text, json_object or json_schema, got {kind!r}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad("response_format.json_schema", f"expected an object with a schema, got {spec!r}")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad("response_format.json_schema.strict", f"expected true or false, got {strict!r}")
    schema = spec.get("schema", {})   # OpenAI: no schema is any JSON
    if not isinstance(schema, (dict, bool)):
        raise bad("response_format.json_schema.schema", f"expected a JSON schema object, got {schema!r}")
    return checked(StructuredOutputs(json=schema), "response_format.json_schema.schema")


def structured_outputs(body: dict) -> StructuredOutputs | None:
    """vLLM's `structured_outputs`: exactly one of its kinds (more than one is a 400)."""
    value = body.get("structured_outputs")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad("structured_outputs", f"expected an object, got {value!r}")
    unknown = sorted(set(value) - set(KINDS))
    if unknown:
        raise bad("structured_outputs", f"unknown field(s) {', '.join(unknown)} (fields: {', '.join(KINDS)})")
    given = [k for k in KINDS if value.get(k) not in (None, False)]
    if len(given) != 1:
        raise bad("structured_outputs", f"give exactly one of {', '.join(KINDS)}, got "
                  f"{', '.join(given) or 'none'}")
    try:
        spec = StructuredOutputs(**{given[0]: value[given[0]]})
    except ValueError as e:
        raise bad(f"structured_outputs.{given[0]}", str(e).removeprefix("SamplingParams.structured_outputs ")) \
            from None
    return checked(spec, f"structured_outputs.{given[0]}")


def request_constraint(body: dict) -> StructuredOutputs | None:
    """The request's constraint: `response_format` or `structured_outputs`, not both."""
    fmt, so = response_format(body), structured_outputs(body)
    if fmt is not None and so is not None:
        raise bad("structured_outputs", "give either response_format or structured_outputs, not both")
    return fmt or so


def checked(spec: StructuredOutputs, field: str) -> StructuredOutputs:
    """`spec` once its schema, regex or grammar parses; else a 400 naming `field`."""
    try:
        check(spec)
    except ValueError as e:   # named as `structured_outputs.<kind>: ...`: the request's field is `field`
        raise bad(field, str(e).removeprefix(f"structured_outputs.{spec.kind}: ")) from None
    return spec
