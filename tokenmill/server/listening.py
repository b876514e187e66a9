"""The uvicorn server `tokenmill serve` runs."""

from __future__ import annotations

import socket
from collections.abc import Callable

import uvicorn


class ListeningServer(uvicorn.Server):
    """A uvicorn server that calls `on_listening` once its socket is open: the decode graphs'
    compilation starts then, because dynamo's tracing holds the GIL and would delay the start."""

    def __init__(self, config: uvicorn.Config, on_listening: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_listening = on_listening

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self.on_listening()
