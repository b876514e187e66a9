"""Responses of /v1/responses kept for `previous_response_id` and GET /v1/responses/{id}: the
last RESPONSE_STORE_SIZE, in memory, until the server restarts."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from tokenmill.server.errors import APIError

# Responses kept, the least recently used dropped first
RESPONSE_STORE_SIZE = 1024


class StoredResponse:
    """A response as returned, and its conversation as chat messages (input then output)."""

    def __init__(self, body: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        self.body, self.messages = body, messages


class ResponseStore:
    """The last RESPONSE_STORE_SIZE stored responses, by id."""

    def __init__(self, size: int = RESPONSE_STORE_SIZE) -> None:
        self.size = size
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def get(self, response_id: str) -> StoredResponse:
        if response_id not in self._items:
            raise APIError(
                404,
                f"Response with id '{response_id}' not found (responses are kept in memory: "
                f"the last {self.size}, until the server restarts).",
                param="previous_response_id",
                code="response_not_found",
            )
        self._items.move_to_end(response_id)
        return self._items[response_id]

    def put(self, response_id: str, stored: StoredResponse) -> None:
        self._items[response_id] = stored
        while len(self._items) > self.size:
            self._items.popitem(last=False)
