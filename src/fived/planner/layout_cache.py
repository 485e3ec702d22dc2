"""A memo for the planner's functions of a layout: keyed on the layout's field values, not on the
`Layout` itself.

A search asks the same parts of ~10^4 layouts' figures again and again, each time with a new but equal
`Layout` object (`Layout.with_`). `functools.lru_cache` keyed on one compares the found key with the
dataclass's generated `__eq__` and `__hash__` (a tuple of its 29 fields built in Python, on every
look-up: most of a warm `memory_per_gpu`'s cost). A tuple of the values, read by one
`operator.attrgetter`, hashes and compares in C; equal values are equal layouts (the same fields, in
the same order), so the memo returns what the function would.

`collector_paused`: what a search allocates holds no reference cycle, so Python's cyclic collector
frees nothing during it; yet every full collection walks every object the memos hold.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable
from dataclasses import fields
from operator import attrgetter
from typing import Any, TypeVar

from fived.layout.layout import Layout

layout_values = attrgetter(*(f.name for f in fields(Layout)))  # a layout's field values, as a tuple

F = TypeVar("F", bound=Callable[..., Any])


def kept_hash(obj: Any) -> int:
    """A frozen dataclass's generated hash (of its fields' values), computed once and kept: the memos
    key on runtimes, clusters and constants, and hash them at every look-up (`__hash__ = kept_hash`,
    with `__getstate__ = state_without_kept_hash`)."""
    found = obj.__dict__.get("_hash")
    if found is None:
        found = hash(tuple(getattr(obj, f.name) for f in fields(obj)))
        object.__setattr__(obj, "_hash", found)
    return found


def state_without_kept_hash(obj: Any) -> dict:
    """What a kept-hash object pickles: its fields, not the hash (a string's hash differs between
    processes: an unpickled copy in another would keep a hash its equal objects there do not have)."""
    return {name: value for name, value in obj.__dict__.items() if name != "_hash"}


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off for a search (on again after, if it was): measured on a
    llama3-70b plan for 512 GPUs, the same peak memory without it and ~15% less time."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def layout_memo(maxsize: int, *, values: Callable[[Layout], tuple] = layout_values) -> Callable[[F], F]:
    """Memoise `f(key, layout, *rest)` (`rest` hashable) on (key, `values(layout)`, *rest), keeping the
    `maxsize` latest entries (the oldest go first: a search's layouts come in order). `values`: the
    fields `f` reads (default all; fewer: layouts equal in them share an entry)."""

    def wrap(f: F) -> F:
        table: dict = {}

        @functools.wraps(f)
        def memo(key, layout: Layout, *rest):
            k = (key, values(layout), *rest)
            found = table.get(k, table)  # (`table` itself: not there; a result may be None)
            if found is not table:
                return found
            out = table[k] = f(key, layout, *rest)
            if len(table) > maxsize:
                del table[next(iter(table))]
            return out

        return memo  # type: ignore[return-value]

    return wrap
