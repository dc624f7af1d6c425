"""The field a request's validation error names, for the 400's `param`: pydantic's location
without its union-member tags. Above every protocol module (it reads all their request models),
so none of them imports another to name a field."""

from __future__ import annotations

from ddtree.server.native_protocol import GenerateRequest, NativeSamplingParams
from ddtree.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    StreamOptions,
    TextPart,
)
from ddtree.server.responses_protocol import ResponsesRequest

FIELD_NAMES = frozenset().union(
    *(
        model.model_fields
        for model in (
            CompletionRequest,
            ChatCompletionRequest,
            ChatMessage,
            TextPart,
            StreamOptions,
            GenerateRequest,
            NativeSamplingParams,
            ResponsesRequest,
        )
    )
)


def error_param(loc) -> str | None:
    """Dotted field path of a validation error location, without pydantic's union-member tags."""
    parts = [str(x) for x in loc if isinstance(x, int) or x in FIELD_NAMES]
    return ".".join(parts) or None
