"""The rendezvous store: rank 0 serves it, ranks meet through it, waits end in errors."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from needle.distributed.store import Store
from needle.errors import DistributedError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def served():
    port = _free_port()
    store = Store.serve("127.0.0.1", port, timeout=5)
    yield store, port
    store.close()


def test_values_cross_processes(served):
    store, port = served
    store.set("nccl/id", bytes(range(128)))
    code = ("from needle.distributed.store import Store\n"
            f"s = Store.connect('127.0.0.1', {port}, 5)\n"
            "assert s.get('nccl/id') == bytes(range(128))\n"
            "s.set('joined/1', b'1')\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    store.set("joined/0", b"1")
    store.wait_all("joined/", 2, timeout=1)


def test_waits_time_out_naming_what_is_missing(served):
    store, _ = served
    start = time.monotonic()
    with pytest.raises(DistributedError, match="timed out after 0 s waiting for the id"):
        store.get("never", timeout=0.3, what="the id")
    store.set("joined/0", b"1")
    with pytest.raises(DistributedError, match=r"rank\(s\) 1, 2 never joined"):
        store.wait_all("joined/", 3, timeout=0.3, what="joined")
    assert time.monotonic() - start < 5


def test_port_in_use_and_no_server(served):
    _, port = served
    with pytest.raises(DistributedError, match="choose a free MASTER_PORT"):
        Store.serve("127.0.0.1", port, timeout=1)
    with pytest.raises(DistributedError, match="no store at"):
        Store.connect("127.0.0.1", _free_port(), timeout=0.3)


def test_a_dead_rank_0_is_reported():
    port = _free_port()
    code = ("import time\nfrom needle.distributed.store import Store\n"
            f"Store.serve('127.0.0.1', {port}, 5)\nprint('up', flush=True)\ntime.sleep(60)\n")
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "up"
        store = Store.connect("127.0.0.1", port, timeout=5)
        server.kill()
        server.wait()
        with pytest.raises(DistributedError, match="rank 0 has exited or died"):
            store.get("nccl/id", timeout=5)
    finally:
        server.kill()
        server.wait()


def test_remote_address_needs_a_secret(monkeypatch):
    monkeypatch.delenv("NEEDLE_STORE_AUTHKEY", raising=False)
    with pytest.raises(DistributedError, match="NEEDLE_STORE_AUTHKEY"):
        Store.connect("192.0.2.1", 29500, timeout=0.1)


def test_poll_waits_or_says_not_yet_and_delete_forgets(served):
    store, _ = served
    start = time.monotonic()
    assert store.poll("bell/0", 0.2) is None
    assert time.monotonic() - start >= 0.15
    store.set("bell/0", b"run")
    assert store.poll("bell/0", 0.2) == b"run"
    store.delete("bell/0")
    store.delete("bell/0")  # already gone: nothing to do
    assert store.poll("bell/0", 0.1) is None


def test_a_doorbell_over_the_store_wakes_another_process_in_order(served, monkeypatch):
    """The nccl group's doorbell (tensor-parallel serving): rank 1 waits with no deadline
    (many POLL_S rounds) until rank 0 rings; rings arrive in order; once rank 0 knows they
    were taken, the store forgets them."""
    from types import SimpleNamespace

    from needle.distributed import doorbell

    store, port = served
    code = ("from types import SimpleNamespace\n"
            "from needle.distributed import doorbell\n"
            "from needle.distributed.store import Store\n"
            f"s = Store.connect('127.0.0.1', {port}, 5)\n"
            "doorbell.POLL_S = 0.05\n"
            "doorbell.group = lambda: SimpleNamespace(rank=1, world_size=2, store=s)\n"
            "bell = doorbell.Doorbell('t/bell')\n"
            "print(*(bell.wait().decode() for _ in range(3)), flush=True)\n")
    follower = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    monkeypatch.setattr(doorbell, "group", lambda: SimpleNamespace(rank=0, world_size=2,
                                                                    store=store))
    bell = doorbell.Doorbell("t/bell")
    time.sleep(0.5)  # the follower waits through several polls first
    for word in (b"run", b"again", b"stop"):
        bell.ring(word)
    out, _ = follower.communicate(timeout=60)
    assert out.split() == ["run", "again", "stop"]
    assert store.poll("t/bell/2", 0.01) == b"stop"
    bell.taken()
    assert all(store.poll(f"t/bell/{n}", 0.01) is None for n in range(3))
