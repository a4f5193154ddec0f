"""One value per process, created on first use: the device and the executor."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class ProcessWide(Generic[T]):
    """Calls ``factory`` once, on the first :meth:`get` from any thread; later calls share it."""

    def __init__(self, factory: Callable[[], T]):
        self._factory = factory
        self._value: T | None = None
        self._lock = threading.Lock()

    def get(self) -> T:
        value = self._value
        if value is not None:  # created: no lock on the path every call takes
            return value
        with self._lock:
            if self._value is None:
                self._value = self._factory()
            return self._value

    def peek(self) -> T | None:
        """The value if it was created, without creating it (a finaliser must not start a GPU)."""
        return self._value
