"""StoppableThread: a daemon thread stopped wherever it runs Python."""

from __future__ import annotations

import threading
import time

from tokenmill.engine.stoppable_thread import StoppableThread, ThreadStopped, stop_all


def _spin() -> None:
    while True:
        time.sleep(0.01)


def test_stop_all_ends_every_running_thread_and_names_those_that_hold_out() -> None:
    released = threading.Event()

    def holds_out() -> None:
        while not released.is_set():  # swallows every stop until released
            try:
                _spin()
            except ThreadStopped:
                pass

    spinners = [StoppableThread(_spin, f"spinner-{i}") for i in range(2)]
    stubborn = StoppableThread(holds_out, "stubborn")
    for thread in (*spinners, stubborn):
        thread.start()
    try:
        assert stop_all(timeout=0.5) == ["stubborn"]
        assert not any(t.is_alive() for t in spinners)
        assert stubborn.is_alive()
    finally:
        released.set()
    assert stop_all(timeout=10) == []
    assert not stubborn.is_alive()
