"""What each endpoint may answer, declared in the OpenAPI schema: OpenAI's error object under every error status the
app or its gate sends, and the media types of the answers that are not JSON (text, server-sent events). Clients and
the API fuzzing test read the schema; an answer it does not document is a bug of one or the other."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int | str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body (`protocol.error_body`)."""

    error: ErrorDetail


WHY = {
    400: "Invalid request: the message names the field",
    401: "Invalid or missing API key (--api-key)",
    404: "The model named is not served",
    413: "The request body is larger than --max-request-body-bytes",
    503: "Not serving: warming up, warm-up failed, shutting down, or the scheduler stopped",
}
GATE = (401, 413, 503)  # what the gate in front of every endpoint may answer (but /health: no key asked)


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` of a route: OpenAI's error object under each of `statuses`."""
    return {status: {"model": ErrorResponse, "description": WHY[status]} for status in statuses}


def text(media_type: str, description: str) -> dict[str, Any]:
    """A 200 answer that is not JSON."""
    return {"description": description, "content": {media_type: {"schema": {"type": "string"}}}}


# One server-sent event: its data a JSON chunk, an error object, or the closing "[DONE]".
EVENT = {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}


def json_or_events(description: str) -> dict[str, Any]:
    """A 200 answer that is JSON, or server-sent events when the request sets `stream`."""
    return {"description": description, "content": {"application/json": {}, "text/event-stream": {"schema": EVENT}}}
