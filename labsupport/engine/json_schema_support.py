"""Which JSON Schema keywords the structured-output grammar really enforces, and a check that names the rest.

xgrammar (0.2.8) turns a schema into a grammar, but it *silently ignores* some keywords: a schema with
``"not"`` or ``"uniqueItems": true`` compiles, and the output then breaks the rule. vLLM refuses such
schemas for xgrammar (``has_xgrammar_unsupported_json_features``) and falls back to another library;
we have only xgrammar, so we refuse them with a message that says which keyword, and where, instead of
answering with JSON that does not validate. Each rule below was checked against xgrammar 0.2.8 by
feeding a matcher a string the keyword forbids (``tests/test_structured_output.py`` keeps a few).
"""
from __future__ import annotations

ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
               "readOnly", "writeOnly", "$anchor", "contentEncoding", "contentMediaType"}  # no effect on output
ENFORCED = {"type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems",
            "maxItems", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions", "pattern",
            "format", "minLength", "maxLength", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
            "multipleOf", "patternProperties", "propertyNames", "minProperties", "maxProperties",
            "unevaluatedProperties", "unevaluatedItems", "uniqueItems"}  # uniqueItems: only false is (true is refused below)
# (ignored by 0.2.8 and so refused as unknown keywords: not, if/then/else, dependentRequired, dependentSchemas)
# string formats xgrammar's converter implements (json_schema_converter.cc; vLLM's STRING_SUPPORTED_FORMATS)
FORMATS = {"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
           "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"}
MAX_DEPTH = 64  # nesting deeper than this is refused: no client schema needs it, and converters recurse


def _types(node: dict) -> set[str]:
    t = node.get("type")
    return {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()


def _node_problems(node: dict, where: str) -> list[str]:
    """What in this one schema object would be ignored (each as 'what at where')."""
    found = [f"keyword '{k}'" for k in node if k not in ENFORCED and k not in ANNOTATIONS]
    types = _types(node)
    if "multipleOf" in node and "integer" not in types:
        found.append("'multipleOf' on a non-integer number")
    if node.get("uniqueItems") is True:
        found.append("'uniqueItems': true")
    if "contains" in node or "minContains" in node or "maxContains" in node:
        found.append("'contains' on an array")
    if "format" in node and node["format"] not in FORMATS:
        found.append(f"string format {node['format']!r} (supported: {', '.join(sorted(FORMATS))})")
    if ("pattern" in node or "format" in node) and ("minLength" in node or "maxLength" in node):
        found.append("'minLength'/'maxLength' together with 'pattern' or 'format'")
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) >= 2:
        found.append("'allOf' with more than one branch")
    if "propertyNames" in node and ("properties" in node or "patternProperties" in node):
        found.append("'propertyNames' together with 'properties' or 'patternProperties'")
    if isinstance(node.get("patternProperties"), dict) and ("properties" in node or len(node["patternProperties"]) > 1):
        found.append("'patternProperties' with 'properties' or with more than one pattern")
    ref = node.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        found.append(f"a remote '$ref' ({ref!r}): only references inside the schema ('#/...') are followed")
    return [f"{what} at {where}" for what in found]


def _children(node: dict, where: str):
    """The sub-schemas of a schema object, with their paths (values of annotations are not schemas)."""
    for key, value in node.items():
        if key in ANNOTATIONS or key in ("enum", "const", "required", "dependentRequired"):
            continue
        if key in ("properties", "patternProperties", "$defs", "definitions") and isinstance(value, dict):
            for name, sub in value.items():
                yield sub, f"{where}.{key}.{name}"
        elif isinstance(value, list):
            for i, sub in enumerate(value):
                yield sub, f"{where}.{key}[{i}]"
        else:
            yield value, f"{where}.{key}"


def unsupported_features(schema) -> list[str]:
    """Every keyword or combination in ``schema`` that the grammar would not enforce, with its path
    (``$`` is the root); empty when the whole schema is enforced. Walked with a stack, not recursion."""
    if not isinstance(schema, (dict, bool)):
        return [f"the schema must be a JSON object, got {type(schema).__name__}"]
    problems, stack = [], [(schema, "$", 0)]
    while stack:
        node, where, depth = stack.pop()
        if not isinstance(node, dict):
            continue  # true/false schemas, or values of keywords that are not schemas
        if depth > MAX_DEPTH:
            return [f"nesting deeper than {MAX_DEPTH} levels at {where}"]
        problems += _node_problems(node, where)
        stack += [(sub, path, depth + 1) for sub, path in _children(node, where)]
    return problems
