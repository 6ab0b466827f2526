"""What the group's secret and TLS cost: bootstrap, one control datagram, and tcp allreduces.

Usage: ``python benches/bench_secret.py`` (``--rounds 5``). Prints the
median of each and the ratio over the anchor measured in the same run:

- bootstrap of 4 tcp ranks and one control datagram, with and without a
  secret (anchor: without);
- allreduce (float32 mean, the group's default algorithm) of 4 KiB and 64 MiB
  over tcp between 2 rank processes on 127.0.0.1, plain (the anchor: the
  compiled path, untagged frames), with a secret (every frame carries
  integrity tags), with TLS (``ssl_context=``, a throwaway self-signed
  certificate made by the ``openssl`` command; skipped without it) and with
  both. The ranks hold one group of each kind and time them in alternating
  rounds, so a busy machine slows all alike; each figure is the median
  over the rounds of the mean time per allreduce.
"""

from __future__ import annotations

import argparse
import multiprocessing
import queue
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, ".")

from gradcoll.observe.diagnosis import STATUS, ControlChannel  # noqa: E402
from gradcoll.store import HashStore, PrefixStore, TCPStore  # noqa: E402
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


#: Allreduce sizes (bytes) and how many allreduces one round times at each.
SIZES = {4 << 10: 400, 64 << 20: 3}
KINDS = ("plain", "secret", "tls", "tls+secret")


def _rank(rank: int, port: int, cert: tuple[str, str] | None, rounds: int, out: Any) -> None:
    import numpy as np

    from gradcoll.group.process_group import ProcessGroup

    store = TCPStore(port=port, timeout=60)
    groups = {}
    for kind in KINDS if cert else KINDS[:2]:
        ctx = tcp.tls_contexts(*cert) if cert and kind.startswith("tls") else None
        t = tcp.create(PrefixStore(kind, store), rank, 2, timeout=60, secret="s3cret" if "secret" in kind else None,
                       ssl_context=ctx)
        groups[kind] = ProcessGroup(t, timeout=60, stall_warning_s=None)
    times: dict[str, list[float]] = {f"{kind} {size}": [] for kind in groups for size in SIZES}
    bufs = {size: np.ones(size // 4, np.float32) for size in SIZES}
    for _ in range(rounds):
        for size, reps in SIZES.items():
            for kind, g in groups.items():
                g.allreduce(bufs[size], op="mean")  # warm
                t0 = time.perf_counter()
                for _ in range(reps):
                    g.allreduce(bufs[size], op="mean")
                times[f"{kind} {size}"].append((time.perf_counter() - t0) / reps)
    for g in groups.values():
        g.close()
    out.put((rank, times))


def _cert(directory: str) -> tuple[str, str] | None:
    if shutil.which("openssl") is None:
        print("openssl is not installed: the TLS rows are skipped (apt-get install openssl)")
        return None
    cert, key = f"{directory}/c.pem", f"{directory}/k.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", key, "-out", cert, "-days", "1", "-subj", "/CN=gradcoll-bench"],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def allreduces(rounds: int) -> None:
    ctx = multiprocessing.get_context("forkserver")
    master = TCPStore(is_master=True, timeout=60)
    with tempfile.TemporaryDirectory(prefix="gradcoll-bench-") as tmp:
        cert, out = _cert(tmp), ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(r, master.port, cert, rounds, out)) for r in range(2)]
        for p in procs:
            p.start()
        got: dict[int, Any] = {}
        while len(got) < 2:
            try:
                rank, times = out.get(timeout=5)
                got[rank] = times
            except queue.Empty:
                if not all(p.is_alive() for p in procs):
                    raise SystemExit("a rank died (its traceback is above)") from None
        for p in procs:
            p.join(30)
    master.close()
    med = {k: statistics.median(v) for k, v in got[0].items()}
    for size in SIZES:
        anchor = med[f"plain {size}"]
        row = [f"plain {anchor * 1e6:.0f} us"] + [
            f"{kind} {med[f'{kind} {size}'] * 1e6:.0f} us (x{med[f'{kind} {size}'] / anchor:.2f})"
            for kind in KINDS[1:] if f"{kind} {size}" in med]
        label = f"{size >> 10} KiB" if size < 1 << 20 else f"{size >> 20} MiB"
        print(f"tcp allreduce, 2 ranks, {label}: " + ", ".join(row))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds of the allreduce timings")
    args = ap.parse_args()
    allreduces(args.rounds)
    plain = [bootstrap(None) for _ in range(ROUNDS)]
    keyed = [bootstrap("s3cret") for _ in range(ROUNDS)]
    p, k = statistics.median(plain), statistics.median(keyed)
    print(f"tcp bootstrap, {RANKS} ranks: {p * 1e3:.1f} ms without a secret, {k * 1e3:.1f} ms with: ratio {k / p:.2f}")
    dp, dk = datagrams(None), datagrams(b"s3cret")
    print(f"control datagram send + receive: {dp * 1e6:.1f} us without, {dk * 1e6:.1f} us with: ratio {dk / dp:.2f}")


if __name__ == "__main__":
    main()
