"""/openapi.json as served: FastAPI's schema with the OpenAI error body this server
answers (400 and the other error statuses) in place of the 422 it never sends, so that
schemathesis and client generators see the truth."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}

_ERROR_RESPONSES = {
    "400": "invalid input: malformed JSON, a wrong type or value, a field not supported",
    "401": "missing or wrong API key",
    "404": "unknown model",
    "413": "request body too large",
    "429": "the waiting queue is full (see Retry-After)",
    "500": "engine fault",
    "503": "the engine is not running, or the server is shutting down",
}


def openapi_schema(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, with the errors this server answers (the OpenAI error body) in
    place of the 422 it never sends."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    components["ErrorResponse"] = _ERROR_SCHEMA
    for operations in schema.get("paths", {}).values():
        for method, op in operations.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            if method == "post":
                for status, description in _ERROR_RESPONSES.items():
                    responses[status] = {"description": description,
                                         "content": {"application/json": {"schema": ERROR_REF}}}
    app.openapi_schema = schema
    return schema


_ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": "integer"}},
    }},
}
