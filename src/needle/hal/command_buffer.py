"""CommandBuffer: device work recorded once and submitted many times.

CUDA: a stream capture instantiated as a CUDA graph (one launch replays every kernel);
Metal: the recorded dispatches, re-encoded into a fresh MTLCommandBuffer per replay. Made
by ``Queue.capture()``; a decode step of a language model replays one with almost no host
work. Kernel arguments (buffers and scalars) are frozen at capture: to feed new data, write
into the captured input buffers before ``replay()``.

Memory allocated during capture comes from the command buffer's private pool and stays
reserved for it until ``close()`` (or garbage collection), because every replay writes it.
"""

from __future__ import annotations


class CommandBuffer:
    """Recorded work. Backends implement ``replay`` and ``_release``."""

    def __init__(self, pool=None):
        self.pool = pool
        self.closed = False
        self.closed_because: str | None = None  # why it was closed early, for replay's error

    def replay(self) -> None:
        """Enqueue all recorded work again (asynchronously, like any dispatch)."""
        raise NotImplementedError

    def describe(self) -> str:
        """What was recorded, for traces."""
        return "recording"

    def _release(self) -> None:
        """Free the backend's recorded objects."""

    def close(self, because: str | None = None) -> None:
        """Free the recording and return its private memory pool; ``because`` (closed by
        another part before its owner was done with it) is what a later replay's error
        says."""
        if self.closed:
            return
        self.closed = True
        self.closed_because = because
        self._release()
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # never raise from a finalizer (e.g. at interpreter exit)
            pass
