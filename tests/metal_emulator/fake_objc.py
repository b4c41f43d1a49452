"""A CPU stand-in for the part of PyObjC's ``objc`` module needle's Metal backend uses.

``autorelease_pool()`` is a context manager, as in PyObjC. Objective-C objects that Metal
returns autoreleased (command buffers, encoders, errors) are freed when the innermost pool
drains; created outside any pool they pile up until the thread ends (in a Python program,
forever). The fake counts pool depth so that ``fake_metal`` can record which objects were
created with no pool in place (``fake_metal.unpooled``), and tests can check there are none.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

_state = threading.local()


def depth() -> int:
    """How many autorelease pools are open on this thread."""
    return getattr(_state, "depth", 0)


@contextmanager
def autorelease_pool():
    _state.depth = depth() + 1
    try:
        yield
    finally:
        _state.depth -= 1
