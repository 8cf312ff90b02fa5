"""The POSIX-fd exchange against hostile local connections (CPU only, no allocator).

A connection from a process that is not a rank, or one that connects and sends nothing, must
neither stall the peers nor go unreported: it is refused (naming its pid) and the ranks'
own connections are served concurrently.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from tilescale_core._fd_exchange import FdServer, _wait_served, peer_credentials, receive_fd

pytestmark = pytest.mark.timeout(60)


def _silent_client(address: str) -> subprocess.Popen:
    """A separate process that connects to ``address`` and then sends nothing for 30 s."""
    code = textwrap.dedent(
        f"""
        import socket, sys, time
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect({address!r})
        print("connected", flush=True)
        time.sleep(30)
        """
    )
    proc = subprocess.Popen([sys.executable, "-S", "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "connected"
    return proc


@pytest.fixture
def memfd():
    fd = os.memfd_create("fd-exchange-hostile")
    os.write(fd, b"payload")
    yield fd
    os.close(fd)


def _read(fd: int) -> bytes:
    try:
        return os.pread(fd, 16, 0)
    finally:
        os.close(fd)


def test_foreign_process_is_refused_and_named_without_stalling_the_peer(memfd):
    server = FdServer(memfd, clients=1, timeout=30)
    hostile = _silent_client(server.address)
    try:
        server.allow([os.getpid()])  # the peer rank is this process
        start = time.monotonic()
        got = receive_fd(server.address, server.token, timeout=10, expect_pid=os.getpid())
        elapsed = time.monotonic() - start
        assert _read(got) == b"payload"
        assert elapsed < 1.0, f"the peer waited {elapsed:.2f} s behind a hostile connection"
        deadline = time.monotonic() + 5
        while not server.refused and time.monotonic() < deadline:
            time.sleep(0.01)
        assert any(f"pid {hostile.pid}" in r and "not one of the ranks" in r for r in server.refused), server.refused
    finally:
        hostile.kill()
        hostile.wait()
        server.stop()


def test_silent_rank_connection_is_dropped_after_its_deadline(memfd):
    """A connection from an allowed pid that sends nothing is cut after connection_timeout,
    while a real request on another connection is served at once."""
    server = FdServer(memfd, clients=1, timeout=30, connection_timeout=0.5)
    server.allow([os.getpid()])
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.connect(server.address)
    try:
        start = time.monotonic()
        got = receive_fd(server.address, server.token, timeout=10, expect_pid=os.getpid())
        assert time.monotonic() - start < 0.4
        assert _read(got) == b"payload"
        silent.settimeout(3)
        t0 = time.monotonic()
        assert silent.recv(1) == b""  # the server hung up on it
        assert time.monotonic() - t0 < 2.0
        assert any(f"pid {os.getpid()}" in r and "within 0.5 s" in r for r in server.refused), server.refused
    finally:
        silent.close()
        server.stop()


def test_unserved_exchange_names_the_hostile_pid(memfd):
    server = FdServer(memfd, clients=1, timeout=30)
    hostile = _silent_client(server.address)
    try:
        server.allow([1])  # a peer that never comes
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=rf"pid {hostile.pid} uid {os.getuid()}"):
            _wait_served(server, 1.0)
        assert time.monotonic() - start < 3.0
    finally:
        hostile.kill()
        hostile.wait()
        server.stop()


def test_client_refuses_a_server_that_is_not_the_peer(memfd):
    server = FdServer(memfd, clients=1, timeout=30)
    try:
        server.allow([os.getpid()])
        with pytest.raises(ConnectionError, match=rf"served by pid {os.getpid()}.*not by the peer rank \(pid 1 "):
            receive_fd(server.address, server.token, timeout=5, expect_pid=1)
    finally:
        server.stop()


def test_peer_credentials_are_this_process():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        assert peer_credentials(a) == (os.getpid(), os.getuid())
