"""Named registries for pluggable implementations (policies, cost models, transports, ...).

Implementations register under a name at import time; callers (CLI, config) look them up by the
name the user typed and get an error listing the known names on a typo."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from yuebing.core.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """A name → object map with a decorator for registration."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: ``@POLICIES.register("random")``. Registering a name twice is an error."""

        def deco(obj: T) -> T:
            self.add(name, obj)
            return obj

        return deco

    def add(self, name: str, obj: T) -> None:
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._items[name] = obj

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            known = ", ".join(sorted(self._items)) or "(none)"
            raise ConfigError(f"unknown {self.kind} {name!r}; known: {known}") from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))
