"""``tilescale-run``'s echo of the ranks' output (:mod:`tilescale_host.launcher`): every line
prefixed with ``[rank N]``, text without a newline yet shown as it comes, read in bounded
chunks, and each rank's last lines kept for the failure summary."""

from __future__ import annotations

import codecs
import os
import threading
import time
from typing import Any, TextIO

__all__ = ["PARTIAL_DELAY_S", "READ_CHUNK", "TAIL_LINES", "TAIL_LINE_CHARS", "RankSink", "cut_line", "echo"]

#: Lines of each rank's output kept for the failure summary.
TAIL_LINES = 60
#: Characters of one line kept for the failure summary (a longer line is cut).
TAIL_LINE_CHARS = 4096
#: Most bytes read from a rank's output at once: memory stays bounded without newlines.
READ_CHUNK = 1 << 16
#: Seconds text without a newline waits for the rest of its line before it is shown.
PARTIAL_DELAY_S = 0.2


class RankSink:
    """``out``, shared by the ranks' readers: ``[rank N] `` starts every line; text without a
    newline yet (a progress bar) is written as it comes, and its line is ended before another
    rank writes."""

    def __init__(self, out: TextIO):
        self.out = out
        self.lock = threading.Lock()
        self.open_rank: int | None = None  # the rank whose line on ``out`` is unfinished

    def write(self, rank: int, text: str) -> None:
        with self.lock:
            pieces = text.split("\n")
            for i, piece in enumerate(pieces):
                if i < len(pieces) - 1:
                    piece += "\n"
                elif not piece:
                    break
                if self.open_rank not in (None, rank):
                    self.out.write("\n")
                    self.open_rank = None
                if self.open_rank is None:
                    self.out.write(f"[rank {rank}] ")
                self.out.write(piece)
                self.open_rank = None if piece.endswith("\n") else rank
            self.out.flush()

    def end(self, rank: int) -> None:
        """End ``rank``'s unfinished line (its output closed without a newline)."""
        with self.lock:
            if self.open_rank == rank:
                self.out.write("\n")
                self.out.flush()
                self.open_rank = None


def cut_line(line: str) -> str:
    """``line``, cut to :data:`TAIL_LINE_CHARS` characters (and marked) when it is longer."""
    return line if len(line) <= TAIL_LINE_CHARS else line[:TAIL_LINE_CHARS] + " [line cut]"


def echo(rank: Any, sink: RankSink) -> None:
    """Copy the rank's output to ``sink``, reading at most :data:`READ_CHUNK` bytes at once.

    Whole lines go out as they come; text after the last newline waits at most
    :data:`PARTIAL_DELAY_S` for the rest of its line (``print`` writes a line in pieces) and is
    then shown as it is (a progress bar), or at once when it reaches :data:`READ_CHUNK`.  The
    last lines, each cut to :data:`TAIL_LINE_CHARS`, are kept in ``rank.tail``.
    """
    import select

    fd = rank.proc.stdout.fileno()
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pending = ""  # read, not shown yet: the start of a line
    shown_by = 0.0  # when ``pending`` is shown even without its newline
    partial = ""  # the unfinished line of the tail
    while True:
        if pending:
            wait = shown_by - time.monotonic()
            if wait <= 0 or not poller.poll(wait * 1000):
                sink.write(rank.rank, pending)
                pending = ""
                continue
        data = os.read(fd, READ_CHUNK)
        text = decoder.decode(data, final=not data)
        *lines, partial = (partial + text).split("\n")
        rank.tail.extend(cut_line(line) for line in lines)
        partial = partial[: TAIL_LINE_CHARS + 1]
        waiting = bool(pending)
        head, newline, pending = (pending + text).rpartition("\n")
        if newline:
            sink.write(rank.rank, head + newline)
            waiting = False
        if pending and not waiting:
            shown_by = time.monotonic() + PARTIAL_DELAY_S
        if pending and (not data or len(pending) >= READ_CHUNK):
            sink.write(rank.rank, pending)
            pending = ""
        if not data:
            break
    if partial:
        rank.tail.append(cut_line(partial))
    sink.end(rank.rank)
    rank.proc.stdout.close()
