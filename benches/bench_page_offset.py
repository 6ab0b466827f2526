"""Loopback TCP copy speed against the 4 KiB page offset of the buffers: the aliasing the tcp step avoids.

    python benches/bench_page_offset.py                     # a 2 MiB exchange, the offsets that matter
    python benches/bench_page_offset.py --bytes 4M --calls 100

Two processes exchange one frame each way over a loopback TCP socket, as the
tcp step does: a 24-byte header and the payload in one ``sendmsg``, received
with ``recvmsg_into``, both directions at once on non-blocking sockets. Only
where the payload's send and receive buffers start within a 4 KiB page changes
between the rows (the buffers come from ``mmap``, so their page offset is
exact; the values are the same in every row). The kernel copies each sent
byte from the sender's buffer into its socket pages (the payload lands 24
bytes into them, after the header) and each received byte from those pages
into the receiver's buffer. On cores where ``rep movsb`` suffers from 4K
aliasing (AMD Zen), a copy whose destination sits 1-63 bytes past its
source's page offset runs several times slower: a send from a buffer 16
bytes into its page (where a large NumPy array starts) is one. The table
gives each copy's distance (destination past source, mod 4096); ``time_us``
is the median over the calls of one exchange, ``vs_best`` that over the
fastest row's.
"""

from __future__ import annotations

import argparse
import mmap
import os
import socket
import sys
import time

import numpy as np

HDR = 24
#: (send buffer offset, receive buffer offset): a large NumPy array's offset (16) on either side, distances
#: on both sides of the slow window, and both buffers half a page away
ROWS = [(16, 2048), (8, 2048), (4088, 2048), (4072, 2048), (2048, 2048), (2048, 40), (2048, 56), (2048, 16)]


def distance(dst: int, src: int) -> int:
    """How far (bytes, mod 4096) a copy's destination sits past its source's page offset."""
    return (dst - src) % 4096


def _placed(nbytes: int, offset: int) -> tuple[mmap.mmap, np.ndarray]:
    mm = mmap.mmap(-1, nbytes + 8192)
    a = np.frombuffer(mm, np.uint8)[offset:offset + nbytes]
    a[:] = 1
    return mm, a


def exchange_time(nbytes: int, soff: int, roff: int, calls: int) -> float:
    """Median seconds of one exchange of ``nbytes`` each way (rank 0's; the child rank runs the same)."""
    lsn = socket.socket()
    lsn.bind(("127.0.0.1", 0))
    lsn.listen(1)
    pid = os.fork()
    if pid == 0:
        s = socket.create_connection(lsn.getsockname(), timeout=30)
    else:
        s, _ = lsn.accept()
    lsn.close()
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.setblocking(False)
    keep = [_placed(nbytes, soff), _placed(nbytes, roff)]
    smv, rmv = memoryview(keep[0][1]), memoryview(keep[1][1])
    hs, hr, total = bytearray(HDR), bytearray(HDR), HDR + nbytes
    deadline = time.monotonic() + 120

    def one() -> None:
        so = ro = 0
        while so < total or ro < total:
            if time.monotonic() > deadline:
                raise TimeoutError("the exchange did not finish in 120 s")
            if so < total:
                try:
                    so += s.sendmsg([memoryview(hs)[so:], smv] if so < HDR else [smv[so - HDR:]])
                except BlockingIOError:
                    pass
            if ro < total:
                try:
                    ro += s.recvmsg_into([memoryview(hr)[ro:], rmv] if ro < HDR else [rmv[ro - HDR:]])[0]
                except BlockingIOError:
                    pass

    for _ in range(10):
        one()
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        one()
        ts.append(time.perf_counter() - t0)
    s.close()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return float(np.median(ts))


def _size(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:].upper(), 1)
    return int(float(text[:-1] if mult > 1 else text) * mult)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bytes", type=_size, default=2 << 20, help="payload each way (default 2M)")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=2, help="passes over the rows (each row's median is kept)")
    a = p.parse_args(argv)
    res: dict[int, list[float]] = {i: [] for i in range(len(ROWS))}
    for _ in range(a.rounds):
        for i, (so, ro) in enumerate(ROWS):
            res[i].append(exchange_time(a.bytes, so, ro, a.calls))
    med = {i: float(np.median(v)) for i, v in res.items()}
    best = min(med.values())
    print(f"# python benches/bench_page_offset.py --bytes {a.bytes} --calls {a.calls} --rounds {a.rounds}")
    print("| send buffer offset | receive buffer offset | send copy: dst past src | receive copy: dst past src "
          "| time_us | vs_best |\n|--:|--:|--:|--:|--:|--:|")
    for i, (so, ro) in enumerate(ROWS):  # the payload sits HDR bytes into the socket's pages
        print(f"| {so} | {ro} | {distance(HDR, so)} | {distance(ro, HDR)} | {med[i] * 1e6:.0f} | {med[i] / best:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
