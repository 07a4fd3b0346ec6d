"""`GET /v1/models` and `GET /v1/models/{id}`: one body that both SDKs read.

Each model is an Anthropic `ModelInfo` (`type`, `id`, `display_name`, `created_at`) that is
also an OpenAI `Model` (`object`, `id`, `created`, `owned_by`); the page is Anthropic's
(`data`, `has_more`, `first_id`, `last_id`, paged by `limit`, `after_id`, `before_id`) and
OpenAI's (`object: list`, `data`). Each SDK ignores the other's fields.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from serve_app.errors import invalid_request

MAX_MODELS_PAGE = 1000
MODEL_OWNER = "zeroqueue"  # OpenAI's `owned_by` of every model served here


def model_info(
    model_id: str,
    display_name: str,
    created_at: datetime,
    *,
    max_input_tokens: int | None = None,
    max_tokens: int | None = None,
) -> dict[str, Any]:
    """One Anthropic `ModelInfo` that is also an OpenAI `Model`. `created_at` must be timezone-aware;
    it is sent as RFC 3339 UTC (Anthropic's `created_at`) and as epoch seconds (OpenAI's `created`)."""
    if created_at.tzinfo is None:
        raise ValueError(f"created_at must be timezone-aware, got {created_at!r}")
    info: dict[str, Any] = {
        "type": "model",
        "id": model_id,
        "display_name": display_name,
        "created_at": created_at.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "lifecycle": "active",
        "object": "model",
        "created": int(created_at.timestamp()),
        "owned_by": MODEL_OWNER,
    }
    if max_input_tokens is not None:
        info["max_input_tokens"] = max_input_tokens
    if max_tokens is not None:
        info["max_tokens"] = max_tokens
    return info


@dataclass(frozen=True)
class ModelsQuery:
    """`GET /v1/models` paging: `limit` items after `after_id` or before `before_id`."""

    limit: int = 20
    after_id: str | None = None
    before_id: str | None = None


def parse_models_query(params: Mapping[str, str]) -> ModelsQuery:
    """Query parameters of `GET /v1/models`; others (e.g. `lifecycle`) are ignored."""
    raw_limit = params.get("limit", "20")
    is_number = raw_limit.isascii() and raw_limit.isdigit() and len(raw_limit) <= 6
    if not is_number or not 1 <= int(raw_limit) <= MAX_MODELS_PAGE:
        raise invalid_request(f"limit: must be an integer from 1 to {MAX_MODELS_PAGE}, got {raw_limit!r}")
    after_id, before_id = params.get("after_id"), params.get("before_id")
    if after_id is not None and before_id is not None:
        raise invalid_request("after_id and before_id cannot both be given")
    return ModelsQuery(limit=int(raw_limit), after_id=after_id, before_id=before_id)


def models_response(infos: Sequence[Mapping[str, Any]], query: ModelsQuery = ModelsQuery()) -> dict[str, Any]:
    """One page of `infos` (already in listing order, newest first) for `models.list()`."""
    ids = [info["id"] for info in infos]
    start, stop = 0, len(infos)
    for cursor, name in ((query.after_id, "after_id"), (query.before_id, "before_id")):
        if cursor is not None and cursor not in ids:
            raise invalid_request(f"{name}: no model with id {cursor!r}")
    if query.after_id is not None:
        start = ids.index(query.after_id) + 1
    if query.before_id is not None:
        stop = ids.index(query.before_id)
        start = max(0, stop - query.limit)
    else:
        stop = min(stop, start + query.limit)
    page = [dict(info) for info in infos[start:stop]]
    # "More" is in the direction of travel: newer items when paging back with before_id.
    has_more = start > 0 if query.before_id is not None else stop < len(infos)
    return {
        "object": "list",
        "data": page,
        "has_more": has_more,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
    }
