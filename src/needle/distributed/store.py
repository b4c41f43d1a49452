"""A small key-value store through which the ranks of a job meet (the NCCL unique id, who
has joined, who is leaving).

Rank 0 serves a table with the standard library's ``multiprocessing.managers`` (a
thread per connection, messages authenticated with HMAC) on MASTER_ADDR:MASTER_PORT; every
rank, rank 0 too, talks to it through a proxy. Waits take a timeout: a rank that never
writes the key it is waited for, or a store that vanishes because rank 0 died, ends in a
``DistributedError`` that says which, never a hang.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import socket
import threading
import time
from multiprocessing.managers import BaseManager

from ..errors import DistributedError

AUTHKEY_VAR = "NEEDLE_STORE_AUTHKEY"


class _Table:
    """The served object: a dict whose readers can wait for a key to appear."""

    def __init__(self):
        self._data: dict[str, bytes] = {}
        self._changed = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        with self._changed:
            self._data[key] = value
            self._changed.notify_all()

    def get(self, key: str, timeout: float) -> tuple[bool, bytes | None]:
        with self._changed:
            found = self._changed.wait_for(lambda: key in self._data, timeout)
            return found, self._data.get(key)

    def keys(self, prefix: str) -> list[str]:
        with self._changed:
            return [k for k in self._data if k.startswith(prefix)]

    def delete(self, key: str) -> None:
        with self._changed:
            self._data.pop(key, None)


def _manager_class(table: _Table | None) -> type[BaseManager]:
    """A BaseManager subclass of its own (registries are per class), serving ``table``."""
    cls = type("StoreManager", (BaseManager,), {})
    if table is None:
        cls.register("table")
    else:
        cls.register("table", callable=lambda: table)
    return cls


def authkey(addr: str, port: int) -> bytes:
    """The shared secret of the store's connections: ``NEEDLE_STORE_AUTHKEY`` (``needle run``
    sets a fresh one per job); on a loopback address, without it, one derived from the port
    (only processes of this host can connect there)."""
    key = os.environ.get(AUTHKEY_VAR)
    if key:
        return key.encode()
    try:
        loopback = ipaddress.ip_address(socket.gethostbyname(addr)).is_loopback
    except (OSError, ValueError):
        loopback = False
    if not loopback:
        raise DistributedError(f"MASTER_ADDR {addr} is not a loopback address: set "
                               f"{AUTHKEY_VAR} to the same secret on every rank so that only "
                               "the job's processes can use its store")
    return hashlib.sha256(f"needle-store:{port}".encode()).digest()


def _serve(server) -> None:
    try:
        server.serve_forever()
    except SystemExit:  # how the manager's server loop ends, here in a thread of ours
        pass


class Store:
    """The job's store: ``Store.serve`` on rank 0, ``Store.connect`` on every rank."""

    def __init__(self, proxy, address: tuple[str, int], timeout: float, server=None):
        self._proxy, self.address, self.timeout, self._server = proxy, address, timeout, server

    @classmethod
    def serve(cls, addr: str, port: int, timeout: float) -> Store:
        """Serve a new table on addr:port from a daemon thread of this process (it ends
        with the process) and connect to it."""
        manager = _manager_class(_Table())(address=(addr, port), authkey=authkey(addr, port))
        try:
            server = manager.get_server()
        except OSError as e:
            raise DistributedError(f"rank 0 cannot serve the store on {addr}:{port}: {e}; "
                                   "choose a free MASTER_PORT") from None
        threading.Thread(target=_serve, args=(server,), name="needle-store", daemon=True).start()
        store = cls.connect(addr, port, timeout)
        store._server = server
        return store

    @classmethod
    def connect(cls, addr: str, port: int, timeout: float) -> Store:
        """Connect to rank 0's store, retrying until it is up or ``timeout`` seconds pass."""
        manager = _manager_class(None)(address=(addr, port), authkey=authkey(addr, port))
        deadline = time.monotonic() + timeout
        while True:
            try:
                manager.connect()
                return cls(manager.table(), (addr, port), timeout)
            except (ConnectionError, OSError, EOFError) as e:
                if time.monotonic() > deadline:
                    raise DistributedError(
                        f"no store at {addr}:{port} after {timeout:.0f} s ({e}): rank 0 did "
                        "not start, or MASTER_ADDR/MASTER_PORT differ between ranks") from None
                time.sleep(0.05)

    def _call(self, name: str, *args):
        try:
            return getattr(self._proxy, name)(*args)
        except (ConnectionError, EOFError, OSError) as e:
            raise DistributedError(f"lost the store at {self.address[0]}:{self.address[1]} "
                                   f"({type(e).__name__}): rank 0 has exited or died") from None

    def set(self, key: str, value: bytes) -> None:
        self._call("set", key, bytes(value))

    def get(self, key: str, timeout: float | None = None, what: str | None = None) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` (the store's) seconds for it."""
        timeout = self.timeout if timeout is None else timeout
        found, value = self._call("get", key, timeout)
        if not found:
            raise DistributedError(f"timed out after {timeout:.0f} s waiting for "
                                   f"{what or repr(key)}: a rank died, hangs or never started")
        return value

    def poll(self, key: str, timeout: float) -> bytes | None:
        """The value of ``key``, or None if it has not appeared within ``timeout`` seconds
        (a wait that may go on: call it again); raises if the store is gone."""
        found, value = self._call("get", key, timeout)
        return value if found else None

    def delete(self, key: str) -> None:
        self._call("delete", key)

    def wait_all(self, prefix: str, world_size: int, timeout: float | None = None,
                 what: str = "ranks") -> None:
        """Wait until keys ``prefix0`` .. ``prefix{world_size-1}`` exist; the error names
        the ranks still missing."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            present = set(self._call("keys", prefix))
            missing = [r for r in range(world_size) if f"{prefix}{r}" not in present]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise DistributedError(f"timed out after {timeout:.0f} s: rank(s) "
                                       f"{', '.join(map(str, missing))} never {what}")
            time.sleep(0.02)

    def close(self) -> None:
        self._proxy = None  # its finalizer tells the server, which must still be up
        if self._server is not None:
            self._server.stop_event.set()
            self._server = None
