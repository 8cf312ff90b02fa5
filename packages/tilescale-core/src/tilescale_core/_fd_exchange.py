"""Give every rank a copy of every other rank's file descriptor, over Unix sockets.

POSIX-fd VMM handles (and the host-memory test backend's memfds) are file descriptors,
which only the kernel can move between processes (``SCM_RIGHTS``).  Each rank serves its
descriptor on an abstract Unix socket from a background thread; the socket names, the
ranks' process ids and a random per-rank token travel through the allocator's
:class:`~tilescale_core._comm.Comm`; then each rank connects to every peer, proves it knows
the peer's token, and receives the descriptor with :func:`socket.recv_fds`.  Both steps are
checked phases, so a failure on one rank raises on all.

Abstract sockets are visible to every local user, so the server trusts nobody by default:

* a connection is served only when its ``SO_PEERCRED`` credentials show this user's uid and
  the pid of one of the ranks (the pids are exchanged with the socket names); another user's
  connection, or (once the pids are known) another process's, is refused by the accepting
  thread at once, so a flood of them starts no thread and drains the listen queue quickly;
* each remaining connection is handled in its own thread (at most
  :data:`MAX_HANDLERS` at a time) with a deadline of :data:`CONNECTION_TIMEOUT` seconds, so a
  connection that sends nothing delays no peer and is dropped after at most that long; the
  token is compared in constant time (:func:`hmac.compare_digest`);
* a client whose ``connect()`` finds the listen queue full waits for room and retries, with
  backoff, until its deadline, so a stranger filling the queue delays the exchange by at most
  that deadline and never makes it fail at once;
* the client checks the server's credentials too (the pid must be the peer rank's);
* refused connections are remembered (the first :data:`MAX_REFUSED_LISTED`, then a count),
  and a failed exchange names their pids and uids.
"""

from __future__ import annotations

import hmac
import os
import secrets
import socket
import struct
import threading
import time

from ._comm import Comm

__all__ = [
    "CONNECTION_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "MAX_HANDLERS",
    "MAX_REFUSED_LISTED",
    "FdServer",
    "exchange_fds",
    "peer_credentials",
    "receive_fd",
]

#: Seconds a rank waits for its peers' sockets before giving up.
DEFAULT_TIMEOUT = 60.0
#: Seconds one connection may take to authenticate (send its token) before it is dropped.
CONNECTION_TIMEOUT = 5.0
#: Connections of this user handled at once (each in a thread); more are refused.
MAX_HANDLERS = 32
#: Refused connections listed by :attr:`FdServer.refused`; later ones are only counted.
MAX_REFUSED_LISTED = 32
_TOKEN_BYTES = 16
_TIMEVAL = struct.Struct("ll")  # struct timeval {time_t tv_sec; suseconds_t tv_usec;}
_CRED = struct.Struct("3i")  # struct ucred {pid_t pid; uid_t uid; gid_t gid;}


def peer_credentials(conn: socket.socket) -> tuple[int, int]:
    """``(pid, uid)`` of the process at the other end of the Unix socket ``conn``."""
    pid, uid, _gid = _CRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return pid, uid


class FdServer:
    """Serve one file descriptor to ``clients`` authenticated connections, in threads.

    Args:
        fd: the descriptor to hand out (it stays owned by the caller).
        clients: how many connections to serve before stopping.
        timeout: seconds the server stays up at most.
        connection_timeout: seconds one connection may take to send its token.

    Call :meth:`allow` with the peer ranks' pids once they are known; until then accepted
    connections wait (within their own deadline) before they are checked.
    """

    def __init__(self, fd: int, clients: int, timeout: float, connection_timeout: float = CONNECTION_TIMEOUT):
        self.fd = fd
        self.token = secrets.token_bytes(_TOKEN_BYTES)
        self.address = f"\0tilescale-fd-{os.getpid()}-{secrets.token_hex(8)}"
        self.served = 0
        self.error: BaseException | None = None
        #: Connections that were refused: ``"pid P uid U: why"`` (the first
        #: :data:`MAX_REFUSED_LISTED`; :attr:`refused_more` counts the others).
        self.refused: list[str] = []
        self.refused_more = 0
        self._handling = 0
        self._clients = clients
        self._connection_timeout = connection_timeout
        self._deadline = time.monotonic() + timeout
        self._allowed: set[int] | None = None
        self._allowed_known = threading.Event()
        self._lock = threading.Lock()
        self._workers: list[threading.Thread] = []
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.address)
        self._sock.listen(max(64, 2 * clients))
        self._thread = threading.Thread(target=self._serve, name="tilescale-fd-server", daemon=True)
        self._thread.start()

    def allow(self, pids) -> None:
        """Serve only connections from these process ids (the peer ranks)."""
        self._allowed = {int(p) for p in pids}
        self._allowed_known.set()

    def _serve(self) -> None:
        try:
            while self.served < self._clients:
                remaining = self._deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"served {self.served} of {self._clients} peers in time")
                self._sock.settimeout(remaining)
                conn, _ = self._sock.accept()
                peer = self._screen(conn)
                if peer is None:
                    conn.close()
                    continue
                worker = threading.Thread(target=self._handle, args=(conn, *peer), name="tilescale-fd-conn",
                                          daemon=True)
                self._workers = [w for w in self._workers if w.is_alive()]
                self._workers.append(worker)
                worker.start()
        except OSError as exc:
            if self._sock.fileno() != -1 and self.served < self._clients:  # not a close() from stop()
                self.error = exc
        except BaseException as exc:
            self.error = exc

    def _refuse(self, pid: int, uid: int, why: str) -> None:
        with self._lock:
            if len(self.refused) < MAX_REFUSED_LISTED:
                self.refused.append(f"pid {pid} uid {uid}: {why}")
            else:
                self.refused_more += 1

    def _screen(self, conn: socket.socket) -> tuple[int, int] | None:
        """In the accepting thread, without blocking: refuse what needs no token (another
        user, a pid that is not a rank's, too many connections at once), returning None;
        else reserve a handler for ``conn`` and return its ``(pid, uid)``."""
        try:
            pid, uid = peer_credentials(conn)
        except OSError as exc:
            self._refuse(-1, -1, f"no credentials ({exc})")
            return None
        if uid != os.getuid():
            self._refuse(pid, uid, f"another user (this rank runs as uid {os.getuid()})")
            return None
        allowed = self._allowed
        if allowed is not None and pid not in allowed:
            self._refuse(pid, uid, f"not one of the ranks (pids {sorted(allowed)})")
            return None
        with self._lock:
            if self._handling >= MAX_HANDLERS:
                busy = True
            else:
                busy = False
                self._handling += 1
        if busy:
            self._refuse(pid, uid, f"{MAX_HANDLERS} connections already being handled")
            return None
        return pid, uid

    def _handle(self, conn: socket.socket, pid: int, uid: int) -> None:
        try:
            self._authenticate(conn, pid, uid)
        finally:
            with self._lock:
                self._handling -= 1

    def _authenticate(self, conn: socket.socket, pid: int, uid: int) -> None:
        with conn:
            deadline = time.monotonic() + self._connection_timeout
            if not self._allowed_known.wait(timeout=self._connection_timeout):
                self._refuse(pid, uid, "arrived before the ranks' pids were known")
                return
            if pid not in self._allowed:
                self._refuse(pid, uid, f"not one of the ranks (pids {sorted(self._allowed)})")
                return
            try:
                conn.settimeout(max(0.01, deadline - time.monotonic()))
                if not hmac.compare_digest(_recv_exact(conn, _TOKEN_BYTES), self.token):
                    self._refuse(pid, uid, "wrong or missing token")
                    return
                socket.send_fds(conn, [b"F"], [self.fd])
            except (OSError, TimeoutError) as exc:
                self._refuse(pid, uid, f"{type(exc).__name__} within {self._connection_timeout:g} s: {exc}")
                return
            with self._lock:
                self.served += 1

    def stop(self) -> None:
        """Close the listening socket and let the threads end."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._thread.join(timeout=5.0)
        for worker in self._workers:
            worker.join(timeout=self._connection_timeout + 1.0)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def receive_fd(address: str, token: bytes, timeout: float, expect_pid: int | None = None) -> int:
    """Connect to an :class:`FdServer` at ``address`` and return the new local descriptor.

    Args:
        address: the server's abstract socket name.
        token: the server's token.
        timeout: seconds for the whole exchange.
        expect_pid: the pid the server must run as (the peer rank's); None skips the check.

    A ``connect()`` that finds the server's listen queue full (another process may fill it)
    waits for room and is retried, with backoff, until ``timeout``.

    Raises:
        ConnectionError: the server is not ``expect_pid`` or sent no descriptor.
        OSError, TimeoutError: the socket failed or timed out.
    """
    deadline = time.monotonic() + timeout
    with _connect(address, deadline, timeout) as s:
        s.settimeout(max(0.001, deadline - time.monotonic()))
        if expect_pid is not None:
            pid, uid = peer_credentials(s)
            if pid != expect_pid or uid != os.getuid():
                raise ConnectionError(
                    f"the socket {address!r} is served by pid {pid} uid {uid}, not by the peer rank "
                    f"(pid {expect_pid} uid {os.getuid()}); refusing it"
                )
        s.sendall(token)
        _, fds, _, _ = socket.recv_fds(s, 1, 1)
    if not fds:
        raise ConnectionError(f"the peer at {address!r} closed the connection without a descriptor")
    return fds[0]


def _connect(address: str, deadline: float, timeout: float) -> socket.socket:
    """A socket connected to ``address`` before ``deadline``; a full listen queue is waited
    for (``SO_SNDTIMEO`` bounds a blocking Unix ``connect()``) and retried with backoff."""
    delay = 0.001
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        remaining = deadline - time.monotonic()
        try:
            if remaining <= 0:
                raise BlockingIOError("no time left")
            wait = min(remaining, 1.0)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                         _TIMEVAL.pack(int(wait), max(1, int((wait % 1) * 1e6))))
            s.connect(address)
            return s
        except BlockingIOError as exc:  # EAGAIN: the listen queue stayed full
            s.close()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"the listen queue of {address!r} stayed full for {timeout:g} s ({exc}); "
                    "another process may be flooding it"
                ) from exc
            time.sleep(min(delay, remaining))
            delay = min(2 * delay, 0.05)
        except BaseException:
            s.close()
            raise


def exchange_fds(comm: Comm, fd: int, timeout: float = DEFAULT_TIMEOUT) -> list[int | None]:
    """Collective: return a new descriptor for every peer's ``fd`` (index = rank, own = None).

    The caller owns (and must close) the returned descriptors; on failure none stays open.

    Raises:
        SetupError: on every rank, if any rank failed to serve or receive; the text names
            the peer (rank and pid) and any refused connection's pid.
    """
    servers: list[FdServer] = []

    def listen():
        servers.append(FdServer(fd, comm.world_size - 1, timeout))
        return servers[0].address, servers[0].token, os.getpid()

    received: list[int | None] = [None] * comm.world_size
    try:
        endpoints = comm.phase("fd-exchange: listen", listen)
        servers[0].allow(pid for r, (_, _, pid) in enumerate(endpoints) if r != comm.rank)

        def receive():
            for peer, (address, token, pid) in enumerate(endpoints):
                if peer == comm.rank:
                    continue
                try:
                    received[peer] = receive_fd(address, token, timeout, expect_pid=pid)
                except Exception as exc:
                    raise ConnectionError(
                        f"receiving rank {peer}'s descriptor (pid {pid}) failed: {type(exc).__name__}: {exc}"
                    ) from exc
            _wait_served(servers[0], timeout)

        comm.phase("fd-exchange: receive", receive)
    except BaseException:
        for got in received:
            if got is not None:
                os.close(got)
        raise
    finally:
        for server in servers:
            server.stop()
    return received


def _wait_served(server: FdServer, timeout: float) -> None:
    """Wait (up to ``timeout`` s) until ``server`` served every peer; name refused pids if not."""
    deadline = time.monotonic() + timeout
    while server.served < server._clients and server.error is None and time.monotonic() < deadline:
        time.sleep(0.005)
    if server.served < server._clients:
        refused = "; ".join(server.refused) or "none"
        if server.refused_more:
            refused += f"; and {server.refused_more} more"
        raise TimeoutError(
            f"served this rank's descriptor to {server.served} of {server._clients} peers "
            f"(server error: {server.error!r}; refused connections: {refused})"
        )
