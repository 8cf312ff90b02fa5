"""Give every rank a copy of every other rank's file descriptor, over Unix sockets.

POSIX-fd VMM handles (and the host-memory test backend's memfds) are file descriptors,
which only the kernel can move between processes (``SCM_RIGHTS``).  Each rank serves its
descriptor on an abstract Unix socket from a background thread; the socket names and a
random per-rank token travel through the allocator's :class:`~tilescale_core._comm.Comm`;
then each rank connects to every peer, proves it knows the peer's token, and receives the
descriptor with :func:`socket.recv_fds`.  Both steps are checked phases, so a failure on
one rank raises on all.  Every socket operation has a timeout.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time

from ._comm import Comm

__all__ = ["DEFAULT_TIMEOUT", "FdServer", "exchange_fds", "receive_fd"]

#: Seconds a rank waits for its peers' sockets before giving up.
DEFAULT_TIMEOUT = 60.0
_TOKEN_BYTES = 16


class FdServer:
    """Serve one file descriptor to ``clients`` authenticated connections, in a thread.

    Args:
        fd: the descriptor to hand out (it stays owned by the caller).
        clients: how many connections to serve before stopping.
        timeout: seconds the server stays up at most.
    """

    def __init__(self, fd: int, clients: int, timeout: float):
        self.fd = fd
        self.token = secrets.token_bytes(_TOKEN_BYTES)
        self.address = f"\0tilescale-fd-{os.getpid()}-{secrets.token_hex(8)}"
        self.served = 0
        self.error: BaseException | None = None
        self._clients = clients
        self._deadline = time.monotonic() + timeout
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.address)
        self._sock.listen(max(1, clients))
        self._thread = threading.Thread(target=self._serve, name="tilescale-fd-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            while self.served < self._clients:
                remaining = self._deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"served {self.served} of {self._clients} peers in time")
                self._sock.settimeout(remaining)
                conn, _ = self._sock.accept()
                with conn:
                    conn.settimeout(max(0.1, self._deadline - time.monotonic()))
                    if _recv_exact(conn, _TOKEN_BYTES) != self.token:
                        continue  # not one of our peers: hand out nothing
                    socket.send_fds(conn, [b"F"], [self.fd])
                    self.served += 1
        except OSError as exc:
            if self._sock.fileno() != -1:  # not a close() from stop()
                self.error = exc
        except BaseException as exc:
            self.error = exc

    def stop(self) -> None:
        """Close the listening socket and let the thread end."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._thread.join(timeout=5.0)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def receive_fd(address: str, token: bytes, timeout: float) -> int:
    """Connect to an :class:`FdServer` at ``address`` and return the new local descriptor."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(address)
        s.sendall(token)
        _, fds, _, _ = socket.recv_fds(s, 1, 1)
    if not fds:
        raise ConnectionError(f"the peer at {address!r} closed the connection without a descriptor")
    return fds[0]


def exchange_fds(comm: Comm, fd: int, timeout: float = DEFAULT_TIMEOUT) -> list[int | None]:
    """Collective: return a new descriptor for every peer's ``fd`` (index = rank, own = None).

    The caller owns (and must close) the returned descriptors.

    Raises:
        SetupError: on every rank, if any rank failed to serve or receive.
    """
    servers: list[FdServer] = []

    def listen():
        servers.append(FdServer(fd, comm.world_size - 1, timeout))
        return servers[0].address, servers[0].token

    received: list[int | None] = [None] * comm.world_size
    try:
        endpoints = comm.phase("fd-exchange: listen", listen)

        def receive():
            for peer, (address, token) in enumerate(endpoints):
                if peer != comm.rank:
                    received[peer] = receive_fd(address, token, timeout)

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
