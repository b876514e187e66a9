"""A daemon thread that can be stopped wherever it runs Python, and that is stopped before the
interpreter exits.

The decode graphs build on such a thread. Dynamo, AOTAutograd and inductor offer no way to
cancel a compilation, so `stop` raises `ThreadStopped` inside the thread at its next Python
bytecode (CPython's `PyThreadState_SetAsyncExc`); the compilers' `except Exception` handlers let a
`BaseException` through. A daemon thread left running when the interpreter finalizes is
unsafe: CPython ends it with `pthread_exit` the next time it takes the GIL, and if that is inside
a PyTorch op (which releases the GIL while it runs) the unwinding meets a C++ destructor that
must not throw, and the whole process aborts (exit status 134). So every live thread of this
kind is stopped from an `atexit` handler, which runs before daemon threads are cut off.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import threading
import time
import weakref
from collections.abc import Callable

log = logging.getLogger("tokenmill.engine")

# How long the interpreter's exit waits for each running stoppable thread to stop. The raised
# exception lands at the thread's next bytecode; a thread inside one long C call (a compiler run
# by a subprocess, one op) stops when that call returns.
STOP_AT_EXIT_TIMEOUT_S = 60.0

# How long `stop` waits for the thread to end before it raises the exception again. Unwinding
# after the exception takes milliseconds; a raise sooner could cut short the cleanup it runs.
RAISE_AGAIN_AFTER_S = 2.0

_live: weakref.WeakSet[StoppableThread] = weakref.WeakSet()


class ThreadStopped(BaseException):
    """Raised inside a `StoppableThread` by its `stop`."""


class StoppableThread:
    """Runs target() on a daemon thread named name; `stop` ends it early."""

    def __init__(self, target: Callable[[], None], name: str) -> None:
        self._target = target
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        # Guards the two flags below: the exception is raised only between the target's start
        # and the end of `_run`'s try block, where `_run` catches it.
        self._lock = threading.Lock()
        self._running = False
        self._stop_requested = False

    @property
    def name(self) -> str:
        return self._thread.name

    def start(self) -> None:
        _live.add(self)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def stop_requested(self) -> bool:
        """Whether `stop` was called: what the target raises from then on is the stop's doing."""
        return self._stop_requested

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def stop(self, timeout: float | None = None) -> bool:
        """Stop the thread at its next bytecode and wait up to timeout seconds for it to end;
        True if it has ended (or never started). While it waits, it raises the exception again
        every `RAISE_AGAIN_AFTER_S`: one that lands in a weakref callback or a `__del__` is
        printed and dropped by CPython, and the thread runs on."""
        with self._lock:
            self._stop_requested = True
        if self._thread.ident is None:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if self._running:
                    _raise_in(self._thread, ThreadStopped)
            wait = RAISE_AGAIN_AFTER_S
            if deadline is not None:
                wait = min(wait, max(deadline - time.monotonic(), 0.0))
            self._thread.join(wait)
            if not self._thread.is_alive():
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def _run(self) -> None:
        try:
            try:
                with self._lock:
                    if self._stop_requested:
                        raise ThreadStopped
                    self._running = True
                self._target()
            finally:
                with self._lock:
                    self._running = False
                    _raise_in(self._thread, None)  # clears an exception not yet raised
        except ThreadStopped:
            log.info("%s stopped", self.name)


def _raise_in(thread: threading.Thread, exc_type: type[BaseException] | None) -> None:
    """Raise exc_type in thread at its next bytecode (None: clear one not yet raised)."""
    exc = None if exc_type is None else ctypes.py_object(exc_type)  # None passes NULL
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), exc)


def stop_all(timeout: float) -> list[str]:
    """Stop every running thread of this kind, waiting up to timeout seconds for each; the names
    of those still running after it."""
    return [t.name for t in list(_live) if t.is_alive() and not t.stop(timeout)]


@atexit.register
def _stop_live_threads() -> None:
    for name in stop_all(STOP_AT_EXIT_TIMEOUT_S):
        log.warning("%s did not stop within %.0f s", name, STOP_AT_EXIT_TIMEOUT_S)
