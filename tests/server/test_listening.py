"""`tokenmill serve`'s uvicorn server starts the decode graphs' compilation once it listens."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn
from fastapi import FastAPI

from tests.server.conftest import free_port
from tokenmill.server.listening import ListeningServer


def test_on_listening_runs_once_the_socket_accepts() -> None:
    port = free_port()
    accepted: list[bool] = []

    def on_listening() -> None:  # runs on the server's loop: a connection must already succeed
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            accepted.append(True)

    server = ListeningServer(
        uvicorn.Config(FastAPI(), host="127.0.0.1", port=port, log_level="warning", lifespan="off"),
        on_listening=on_listening,
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    server.should_exit = True
    thread.join(10)
    assert server.started and accepted == [True]


def test_on_listening_is_not_called_when_the_port_is_taken() -> None:
    calls: list[bool] = []
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = ListeningServer(
            uvicorn.Config(
                FastAPI(),
                host="127.0.0.1",
                port=taken.getsockname()[1],
                log_level="critical",
                lifespan="off",
            ),
            on_listening=lambda: calls.append(True),
        )
        try:
            server.run()
        except SystemExit:  # uvicorn's answer to a failed bind
            pass
    assert not server.started and calls == []
