"""What the group's secret costs: bootstrap of 4 tcp ranks and one control datagram, with and without it.

Usage: ``python benches/bench_secret.py``. Prints the median of each and the
ratio with a secret over without (the anchor: the same bootstrap, in the
same run, without a secret). The data path is the same with or without a
secret (its frames carry no tag), so collectives cost the same.
"""

from __future__ import annotations

import socket
import statistics
import sys
import time

sys.path.insert(0, ".")

from gradcoll.observe.diagnosis import STATUS, ControlChannel  # noqa: E402
from gradcoll.store import HashStore  # noqa: E402
from gradcoll.testing import gather_ranks  # noqa: E402
from gradcoll.transport import tcp  # noqa: E402

RANKS, ROUNDS, DATAGRAMS = 4, 15, 2000


def bootstrap(secret: str | None) -> float:
    store = HashStore(30)
    t0 = time.perf_counter()
    ts, errors = gather_ranks(lambda r: tcp.create(store, r, RANKS, timeout=30, secret=secret), RANKS)
    dt = time.perf_counter() - t0
    assert errors == [None] * RANKS, errors
    for t in ts:
        t.close()
    return dt


def datagrams(key: bytes | None) -> float:
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    addrs = [s.getsockname() for s in socks]
    chans = [ControlChannel(socks[r], r, 2, addrs, b"12345678", host="127.0.0.1", backend="tcp", options={}, key=key)
             for r in range(2)]
    t0 = time.perf_counter()
    for i in range(DATAGRAMS):
        chans[0].send(1, STATUS, seq=i, text="running")
        chans[1].poll(1.0)
    dt = (time.perf_counter() - t0) / DATAGRAMS
    assert chans[1].replies[0][1] == DATAGRAMS - 1
    for c in chans:
        c.close()
    return dt


def main() -> None:
    plain = [bootstrap(None) for _ in range(ROUNDS)]
    keyed = [bootstrap("s3cret") for _ in range(ROUNDS)]
    p, k = statistics.median(plain), statistics.median(keyed)
    print(f"tcp bootstrap, {RANKS} ranks: {p * 1e3:.1f} ms without a secret, {k * 1e3:.1f} ms with: ratio {k / p:.2f}")
    dp, dk = datagrams(None), datagrams(b"s3cret")
    print(f"control datagram send + receive: {dp * 1e6:.1f} us without, {dk * 1e6:.1f} us with: ratio {dk / dp:.2f}")


if __name__ == "__main__":
    main()
