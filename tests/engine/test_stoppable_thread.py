"""StoppableThread: a daemon thread stopped wherever it runs Python."""

from __future__ import annotations

import threading
import time

from tokenmill.engine.stoppable_thread import StoppableThread, ThreadStopped, stop_all


def _spin() -> None:
    while True:
        time.sleep(0.01)


def test_stop_all_ends_every_running_thread_and_names_those_that_hold_out() -> None:
    entered, released = threading.Event(), threading.Event()

    def holds_out() -> None:
        while True:  # swallows every stop until released
            try:
                entered.set()
                _spin()
            except ThreadStopped:
                if released.is_set():
                    return

    spinners = [StoppableThread(_spin, f"spinner-{i}") for i in range(2)]
    stubborn = StoppableThread(holds_out, "stubborn")
    for thread in (*spinners, stubborn):
        thread.start()
    assert entered.wait(10)  # a thread stopped before its target starts never runs it
    try:
        assert stop_all(timeout=0.5) == ["stubborn"]
        assert not any(t.is_alive() for t in spinners)
        assert stubborn.is_alive()
    finally:
        released.set()
    assert stop_all(timeout=10) == []
    assert not stubborn.is_alive()
