"""KV transfer benchmark: each backend's bandwidth next to the machine's limits measured in the
same run, and TTFT of disaggregated vs colocated serving at low load.

    python bench/kv_transfer.py                      # everything
    python bench/kv_transfer.py --no-ttft            # bandwidth only
    python bench/kv_transfer.py --sizes-mib 64 --backends zmq shm

Bandwidth: the sender (this process) ships ``size`` MiB of contiguous KV pages (the default
model's layout) to a receiver process that installs them and acknowledges; time = send call to
acknowledgement, best of ``--repeats``. Baselines: ``memcpy`` (a large torch copy, one thread)
and raw loopback TCP (``sendall`` to a process doing ``recv_into``). Goals (issue 7): shm >= 50%
of memcpy; zmq >= 80% of TCP; mooncake >= zmq. TTFT: a 1-token completion per prompt length,
colocated and disaggregated clusters up at once and measured alternately; goal <= 10% overhead.
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import os
import socket
import statistics
import time

import torch
import zmq

from splitserve.engine.kv_pool import KVLayout, KVPool
from splitserve.ipc import Inbox, Outbox, free_tcp_addr
from splitserve.kv_transfer.base import layout_to_msg
from splitserve.kv_transfer.registry import create_kv_pool, create_kv_receiver, create_kv_sender
from splitserve.messages import KVBootstrap

LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, page_size=16, dtype="float32")
MIB = 2**20


def gbps(num_bytes: int, seconds: float) -> float:
    return num_bytes / seconds / 1e9


# ---- baselines -------------------------------------------------------------------------------


def memcpy_gbps(size: int, repeats: int) -> float:
    torch.set_num_threads(1)
    src = torch.ones(size, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return gbps(size, best)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _tcp_sink(port_q, size: int, repeats: int) -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    buf = memoryview(bytearray(size))
    for _ in range(repeats):
        got = 0
        while got < size:
            got += conn.recv_into(buf[got:], size - got)
        conn.sendall(b"k")
    conn.close()


def tcp_gbps(size: int, repeats: int) -> float:
    q = mp.Queue()
    p = mp.Process(target=_tcp_sink, args=(q, size, repeats))
    p.start()
    sock = socket.create_connection(("127.0.0.1", q.get(timeout=30)))
    data = memoryview(bytearray(b"\1" * size))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sock.sendall(data)
        sock.recv(1)
        times.append(time.perf_counter() - t0)
    sock.close()
    p.join()
    return gbps(size, min(times))


# ---- backends --------------------------------------------------------------------------------


def _receiver(backend: str, num_pages: int, conn) -> None:
    pool = create_kv_pool(backend, "decode", LAYOUT, num_pages)
    receiver = create_kv_receiver(backend, pool)
    ctx = zmq.Context()
    inbox = Inbox(ctx, free_tcp_addr())
    conn.send((inbox.addr, receiver.endpoint()))
    ack_addr = conn.recv()
    ack = Outbox(ctx)
    while True:
        if not inbox.poll(1000):
            if conn.poll():
                break
            continue
        item = inbox.recv()
        if item is None:
            continue
        header, frames = item
        receiver.install(header, frames)
        if header.last:
            ack.send(ack_addr, header)
    receiver.close()
    ack.close()
    inbox.close()
    ctx.term()


def backend_gbps(backend: str, size: int, repeats: int) -> float:
    n = size // LAYOUT.page_bytes
    num_bytes = n * LAYOUT.page_bytes
    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=_receiver, args=(backend, n + 1, child))
    proc.start()
    dst_addr, endpoint = parent.recv()
    ctx = zmq.Context()
    acks = Inbox(ctx, free_tcp_addr())
    parent.send(acks.addr)
    pool = KVPool(LAYOUT, n + 1)
    pool.buffer.fill_(1.0)
    sender = create_kv_sender(backend, pool, Outbox(ctx))
    pages = list(range(1, n + 1))

    def one(rid: str, count: int) -> float:
        boot = KVBootstrap(rid=rid, dst_addr=dst_addr, page_ids=pages[:count],
                           layout=layout_to_msg(LAYOUT), kv_transfer=backend, endpoint=endpoint)
        t0 = time.perf_counter()
        sender.send(boot, pages[:count], pages[:count], last=True, first_token=0)
        while True:
            sender.poll()
            if acks.poll(1) and acks.recv() is not None:
                break
        elapsed = time.perf_counter() - t0
        while not sender.is_done(rid):
            time.sleep(0.001)
        return elapsed

    one("warmup", 2)
    best = min(one(f"r{i}", n) for i in range(repeats))
    parent.send("stop")
    proc.join(30)
    sender.close()
    acks.close()
    ctx.destroy(linger=0)
    return gbps(num_bytes, best)


# ---- TTFT ------------------------------------------------------------------------------------


def ttft(args) -> None:
    import httpx

    from splitserve.default_model import ensure_default_model
    from splitserve.launcher import Cluster, ClusterSpec

    path = str(ensure_default_model())
    common = {"model_path": path, "kv_cache_mb": args.kv_cache_mb, "threads_per_worker": 1,
                  "max_batch_tokens": args.max_batch_tokens, "transfer_timeout_s": 120.0}
    specs = {"colocated": ClusterSpec(colocated=True, port=_port(), **common)}
    for b in args.ttft_backends:
        specs[f"disagg-{b}"] = ClusterSpec(kv_transfer=b, port=_port(), **common)
    clusters = {k: Cluster(s).start() for k, s in specs.items()}
    try:
        results: dict[tuple[str, int], list[float]] = {}
        for length in args.prompt_lens:
            for rep in range(args.ttft_repeats + 1):  # the first round warms up
                for name, cluster in clusters.items():
                    ids = [(length * 7 + rep * 31 + i * 13) % 40000 + 100 for i in range(length)]
                    body = {"model": "default", "prompt": ids, "max_tokens": 1, "temperature": 0}
                    t0 = time.perf_counter()
                    r = httpx.post(cluster.spec.url + "/v1/completions", json=body, timeout=600)
                    dt = time.perf_counter() - t0
                    assert r.status_code == 200, r.text
                    if rep:
                        results.setdefault((name, length), []).append(dt)
        print(f"\nTTFT at low load (1 request at a time, median of {args.ttft_repeats}), "
              f"load {os.getloadavg()[0]:.1f}")
        print(f"{'prompt':>7} {'colocated s':>12} " + " ".join(
            f"{n + ' s':>16} {'overhead':>9}" for n in clusters if n != "colocated"))
        for length in args.prompt_lens:
            base = statistics.median(results[("colocated", length)])
            row = f"{length:>7} {base:>12.3f} "
            for name in clusters:
                if name != "colocated":
                    t = statistics.median(results[(name, length)])
                    row += f"{t:>16.3f} {100 * (t / base - 1):>+8.1f}% "
            print(row + "  (goal <= +10%)")
    finally:
        for c in clusters.values():
            c.stop()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes-mib", type=int, nargs="+", default=[64, 512])
    avail = ["zmq", "shm"] + (["mooncake"] if importlib.util.find_spec("mooncake") else [])
    p.add_argument("--backends", nargs="+", default=avail)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-ttft", action="store_true")
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--ttft-backends", nargs="+", default=["zmq"])
    p.add_argument("--ttft-repeats", type=int, default=2)
    p.add_argument("--kv-cache-mb", type=int, default=320)
    p.add_argument("--max-batch-tokens", type=int, default=512)
    args = p.parse_args()
    print(f"cpus {os.cpu_count()}, load {os.getloadavg()[0]:.1f}, page {LAYOUT.page_bytes} B "
          f"({LAYOUT.num_layers} layers, {LAYOUT.dtype}); best of {args.repeats}")
    for mib in args.sizes_mib:
        size = mib * MIB
        mem, tcp = memcpy_gbps(size, args.repeats), tcp_gbps(size, args.repeats)
        print(f"\n{mib} MiB: memcpy {mem:.2f} GB/s, loopback TCP {tcp:.2f} GB/s")
        got = {}
        for b in args.backends:
            got[b] = backend_gbps(b, size, args.repeats)
            ref, name, goal = {"shm": (mem, "memcpy", 0.5), "zmq": (tcp, "TCP", 0.8)}.get(
                b, (got.get("zmq", 0.0), "zmq", 1.0))
            ratio = got[b] / ref if ref else float("nan")
            ok = "ok" if ratio >= goal else "below goal"
            print(f"  {b:>9}: {got[b]:6.2f} GB/s = {ratio:5.2f} x {name} "
                  f"(goal >= {goal:.2f}: {ok})")
    if not args.no_ttft:
        ttft(args)


if __name__ == "__main__":
    main()
