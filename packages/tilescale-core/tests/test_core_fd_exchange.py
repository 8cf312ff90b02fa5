"""The POSIX-fd exchange against hostile local connections (CPU only, no allocator).

A connection from a process that is not a rank, or one that connects and sends nothing, must
neither stall the peers nor go unreported: it is refused (naming its pid) and the ranks'
own connections are served concurrently.
"""

from __future__ import annotations

import inspect
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


def _connect_nonblocking(address, full=OSError):
    """A non-blocking connection to the Unix socket ``address``, or None when connecting
    raises ``full`` (the listen queue is full)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setblocking(False)
    try:
        s.connect(address)
    except full:
        s.close()
        return None
    return s


# The flooder's script; it defines _connect_nonblocking from this module's source.
FLOOD = inspect.getsource(_connect_nonblocking) + textwrap.dedent(
    """
    import socket, sys, time
    address, end = "\\0" + sys.argv[1], time.monotonic() + float(sys.argv[2])
    held = []
    print("flooding", flush=True)
    while time.monotonic() < end:
        s = _connect_nonblocking(address)
        if s is None:
            continue
        held.append(s)
        if len(held) >= 256:
            for h in held:
                h.close()
            held.clear()
    """
)


def _flooder(address: str, seconds: float, user) -> subprocess.Popen:
    """A process (of another user when the tests run as root) that keeps ``address``'s listen
    queue full with non-blocking connects for ``seconds``."""
    assert address.startswith("\0")
    cmd = [sys.executable, "-S", "-c", FLOOD, address[1:], str(seconds)]
    kw = {}
    if user is not None:
        cmd[0] = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
        kw = dict(user=user[0], group=user[1], extra_groups=[])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, **kw)
    assert proc.stdout.readline().strip() == "flooding"
    return proc


@pytest.fixture
def flood_user(request):
    """Another user's ids when the tests run as root (the attack of issue 39), else None (a
    flood from this user fills the listen queue just the same)."""
    if os.geteuid() != 0:
        return None
    return request.getfixturevalue("other_user")


def test_exchange_succeeds_under_a_connect_flood_filling_the_backlog(memfd, flood_user):
    """Another local user floods the server's listen queue with connects (three processes:
    enough to keep it full, so that a plain ``connect()`` fails with EAGAIN); every one of 20
    exchanges still succeeds (a stranger delays set-up, never makes it fail), the refused
    list stays bounded and no thread is started per refused connection."""
    import threading

    from tilescale_core import _fd_exchange
    MAX_REFUSED_LISTED = getattr(_fd_exchange, "MAX_REFUSED_LISTED", 64)  # noqa: N806

    server = FdServer(memfd, clients=20, timeout=60)
    server.allow([os.getpid()])
    threads_before = threading.active_count()
    flooders = [_flooder(server.address, 30, flood_user) for _ in range(3)]
    failures, most_threads = [], 0
    try:
        time.sleep(0.3)  # let the queue fill
        for i in range(20):
            try:
                got = receive_fd(server.address, server.token, timeout=10, expect_pid=os.getpid())
                assert _read(got) == b"payload"
            except Exception as exc:
                failures.append(f"{i}: {type(exc).__name__}: {exc}")
            most_threads = max(most_threads, threading.active_count())
        _wait_served(server, 10)
    finally:
        for flooder in flooders:
            flooder.kill()
            flooder.wait()
        server.stop()
    assert not failures, f"{len(failures)} of 20 exchanges failed under the flood: {failures[:3]}"
    assert most_threads - threads_before <= 40, f"{most_threads - threads_before} threads under the flood"
    assert len(server.refused) <= MAX_REFUSED_LISTED + 1, len(server.refused)
    if flood_user is not None:
        assert any(f"uid {flood_user[0]}" in r and "another user" in r for r in server.refused), server.refused[:3]


def test_token_is_compared_in_constant_time(memfd, monkeypatch):
    import hmac

    from tilescale_core import _fd_exchange

    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(_fd_exchange.hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    server = FdServer(memfd, clients=1, timeout=30)
    try:
        server.allow([os.getpid()])
        got = receive_fd(server.address, server.token, timeout=5, expect_pid=os.getpid())
        _read(got)
    finally:
        server.stop()
    assert calls, "the token was not compared with hmac.compare_digest"


def _full_queue(address: str):
    """A listening socket at ``address`` whose queue is full (nothing accepts), and the
    connections that fill it."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(address)
    srv.listen(0)
    fillers = []
    while (c := _connect_nonblocking(address, BlockingIOError)) is not None:
        fillers.append(c)
    return srv, fillers


def test_receive_fd_waits_for_room_in_a_full_listen_queue(memfd):
    """The queue stays full for 0.5 s; the client waits and gets the descriptor."""
    import threading

    address = f"\0tilescale-test-full-{os.getpid()}"
    srv, fillers = _full_queue(address)
    token = b"t" * 16

    def serve_later():
        time.sleep(0.5)
        for _ in fillers:
            srv.accept()[0].close()
        while True:
            conn, _ = srv.accept()
            with conn:
                conn.settimeout(5)
                if conn.recv(16) == token:
                    socket.send_fds(conn, [b"F"], [memfd])
                    return

    server = threading.Thread(target=serve_later, daemon=True)
    server.start()
    try:
        start = time.monotonic()
        got = receive_fd(address, token, timeout=10)
        assert _read(got) == b"payload"
        assert 0.4 < time.monotonic() - start < 5
    finally:
        server.join(5)
        for c in fillers:
            c.close()
        srv.close()


def test_receive_fd_gives_up_at_its_deadline_when_the_queue_stays_full():
    address = f"\0tilescale-test-full-{os.getpid()}"
    srv, fillers = _full_queue(address)
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"listen queue .* stayed full for 0.5 s"):
            receive_fd(address, b"t" * 16, timeout=0.5)
        assert 0.4 < time.monotonic() - start < 3
    finally:
        for c in fillers:
            c.close()
        srv.close()
