"""One recorded backend call, and which of its arguments it reads and writes."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

import numpy as np

from ..backends.api import BINARY_OPS, UNARY_OPS, ArrayBackend

_SCALARS = (numbers.Number, str, bytes, type(None), np.generic, tuple, list, dict, np.ndarray)
# array parameters that the array API's functions write (every argument is taken as read)
_WRITTEN = frozenset(("out", "total", "keys", "values", "param", "m", "v", "momentum_buf"))


def _written_positions() -> dict[str, tuple[int, ...]]:
    import inspect

    table = {}
    for name, fn in vars(ArrayBackend).items():
        if callable(fn) and not name.startswith("_"):
            params = list(inspect.signature(fn).parameters)[1:]
            table[name] = tuple(i for i, p in enumerate(params) if p in _WRITTEN)
    for op in BINARY_OPS:
        table[f"ewise_{op}"] = (2,)
        table[f"scalar_{op}"] = (2,)
    for op in UNARY_OPS:
        table[f"ewise_{op}"] = (1,)
    return table


WRITES = _written_positions()


def is_array(x) -> bool:
    """Whether an argument is a backend array (not a number, shape, flag or host array)."""
    return not isinstance(x, _SCALARS)


def _arrays(x) -> list:
    """The backend arrays an argument holds: itself, or a list's (``adam_update_many``)."""
    if isinstance(x, list):
        return [a for a in x if is_array(a)]
    return [x] if is_array(x) else []


@dataclass(eq=False)
class Call:
    """One recorded backend call: ``fn(*args, **kwargs)`` at position ``pos`` of the step."""

    name: str
    fn: object
    args: tuple
    kwargs: dict
    pos: int = 0
    reads: list = field(default_factory=list)  # arrays it may read (``analyse``)
    writes: list = field(default_factory=list)  # arrays it may write (``analyse``)
    node: object = None  # plan.Node, when the call is elementwise

    def analyse(self) -> None:
        """Fill ``reads`` and ``writes`` (they hold references: ``plan.dead_arrays`` first)."""
        arrays = [a for x in self.args for a in _arrays(x)]
        arrays += [a for v in self.kwargs.values() for a in _arrays(v)]
        self.reads = arrays
        known = WRITES.get(self.name)
        if known is None:  # a function outside the array API: it may write anything it gets
            self.writes = list(arrays)
        else:
            self.writes = [self.args[i] for i in known if i < len(self.args)
                           and is_array(self.args[i])]
            self.writes += [v for k, v in self.kwargs.items() if k in _WRITTEN and is_array(v)]

    def __call__(self):
        return self.fn(*self.args, **self.kwargs)


