"""``/openapi.json`` that tells the truth about errors: 400 with OpenAI's error body, not FastAPI's 422.

FastAPI documents every route that validates input with a ``422 Validation Error`` answer in its own
``HTTPValidationError`` shape. This server answers such input with ``400`` and OpenAI's
``{"error": {"message", "type", "param", "code"}}`` (``api.add_error_handlers``), as OpenAI and vLLM
do, so a client generated from the schema, or a fuzzer checking answers against it (schemathesis),
would otherwise be told the wrong status and the wrong body. ``document_errors`` rewrites the
generated schema once: each 422 becomes a 400 with ``ErrorResponse``, and FastAPI's two validation
schemas go, since nothing refers to them any more.
"""
from __future__ import annotations

from pydantic import BaseModel


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """OpenAI's error body, which every error answer of this server has."""

    error: ErrorInfo


BAD_REQUEST = {"description": "Bad request: a field is missing, has the wrong type or value, or asks for what "
                              "this server cannot do (the message says which)",
               "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}


def document_errors(app):
    """Make ``app.openapi()`` document 400 (OpenAI's error shape) where FastAPI would say 422."""
    generate = app.openapi

    def openapi():
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()
        for methods in schema.get("paths", {}).values():
            for operation in methods.values():
                responses = operation.get("responses", {})
                if responses.pop("422", None) is not None:
                    responses["400"] = BAD_REQUEST
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        error = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(error.pop("$defs", {}))
        schemas["ErrorResponse"] = error
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
