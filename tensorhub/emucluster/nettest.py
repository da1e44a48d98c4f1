"""``python -m tensorhub.emucluster.nettest``: plain-TCP probes for emulated links.

Run the ends inside host namespaces (``EmulatedCluster.host_argv``); each prints one JSON
object on its last stdout line.

    sink --port P [--timeout-s T]           accept one stream, read it to EOF: bytes, seconds, gbit
    send --to IP:PORT --bytes N             connect and send N bytes (one stream)
    rtt  --to IP:PORT [--count N]           time N TCP connects (SYN -> SYN-ACK, one RTT each)
    listen --port P [--timeout-s T]         accept and close connections until killed (for rtt)

``sink`` times from the first byte to EOF, so connection setup is not counted; ``gbit`` is
the payload rate (TCP/IP headers excluded, about 3% below the line rate).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time

CHUNK_BYTES = 1 << 20


def sink(port: int, timeout_s: float) -> dict:
    with socket.create_server(("0.0.0.0", port), reuse_port=True) as srv:
        srv.settimeout(timeout_s)
        print(json.dumps({"listening": port}), flush=True)
        conn, _ = srv.accept()
    with conn:
        conn.settimeout(timeout_s)
        buf = bytearray(CHUNK_BYTES)
        n = conn.recv_into(buf)
        t0, total = time.perf_counter(), n
        while n:
            n = conn.recv_into(buf)
            total += n
        dt = time.perf_counter() - t0
    return {"bytes": total, "seconds": dt, "gbit": total * 8 / dt / 1e9 if dt > 0 else None}


def send(to: str, nbytes: int, timeout_s: float) -> dict:
    host, port = to.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:  # the sink may still be starting
        try:
            s = socket.create_connection((host, int(port)), timeout=timeout_s)
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with s:
        chunk = b"\0" * CHUNK_BYTES
        t0, left = time.perf_counter(), nbytes
        while left > 0:
            left -= s.send(chunk[:min(left, CHUNK_BYTES)])
        s.shutdown(socket.SHUT_WR)
        s.recv(1)  # wait for the sink to close: all bytes delivered
    return {"bytes": nbytes, "seconds": time.perf_counter() - t0}


def listen(port: int, timeout_s: float) -> dict:
    with socket.create_server(("0.0.0.0", port), reuse_port=True) as srv:
        srv.settimeout(timeout_s)
        print(json.dumps({"listening": port}), flush=True)
        n = 0
        try:
            while True:
                conn, _ = srv.accept()
                conn.close()
                n += 1
        except socket.timeout:
            return {"accepted": n}


def rtt(to: str, count: int, timeout_s: float) -> dict:
    host, port = to.rsplit(":", 1)
    samples = []
    deadline = time.monotonic() + timeout_s
    while len(samples) < count:
        t0 = time.perf_counter()
        try:
            s = socket.create_connection((host, int(port)), timeout=timeout_s)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
            continue
        samples.append((time.perf_counter() - t0) * 1000)
        s.close()
    samples.sort()
    return {"rtt_ms_min": samples[0], "rtt_ms_median": samples[len(samples) // 2], "samples_ms": samples}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tensorhub.emucluster.nettest", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("sink", "listen"):
        q = sub.add_parser(name)
        q.add_argument("--port", type=int, required=True)
        q.add_argument("--timeout-s", type=float, default=60.0)
    q = sub.add_parser("send")
    q.add_argument("--to", required=True)
    q.add_argument("--bytes", type=int, required=True)
    q.add_argument("--timeout-s", type=float, default=60.0)
    q = sub.add_parser("rtt")
    q.add_argument("--to", required=True)
    q.add_argument("--count", type=int, default=5)
    q.add_argument("--timeout-s", type=float, default=20.0)
    a = p.parse_args(argv)
    if a.cmd == "sink":
        out = sink(a.port, a.timeout_s)
    elif a.cmd == "listen":
        out = listen(a.port, a.timeout_s)
    elif a.cmd == "send":
        out = send(a.to, a.bytes, a.timeout_s)
    else:
        out = rtt(a.to, a.count, a.timeout_s)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())


def _last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def measure_stream(cluster, src: int, dst: int, nbytes: int, *, port: int = 5201, timeout_s: float = 60.0) -> dict:
    """One TCP stream of ``nbytes`` from host ``src`` to host ``dst`` (-1: the root namespace,
    i.e. the head/driver); returns the sink's JSON (``bytes``, ``seconds``, ``gbit``)."""
    import subprocess

    def argv(k, a):
        return cluster.host_argv(k, a) if k >= 0 else a

    me = [sys.executable, __file__]  # not -m: importing tensorhub would cost seconds
    dst_ip = cluster.host_ip(dst) if dst >= 0 else cluster.head_ip
    with subprocess.Popen(argv(dst, me + ["sink", "--port", str(port), "--timeout-s", str(timeout_s)]),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as sink_p:
        try:
            sink_p.stdout.readline()  # listening
            subprocess.run(argv(src, me + ["send", "--to", f"{dst_ip}:{port}", "--bytes", str(nbytes),
                                           "--timeout-s", str(timeout_s)]),
                           check=True, capture_output=True, timeout=timeout_s)
            out, err = sink_p.communicate(timeout=timeout_s)
        finally:
            if sink_p.poll() is None:
                sink_p.kill()
    return _last_json(out)


def measure_rtt_ms(cluster, src: int, dst: int, *, count: int = 5, port: int = 5202, timeout_s: float = 20.0) -> dict:
    """TCP connect times from host ``src`` to host ``dst`` (-1: root namespace): min, median."""
    import subprocess

    def argv(k, a):
        return cluster.host_argv(k, a) if k >= 0 else a

    me = [sys.executable, __file__]  # not -m: importing tensorhub would cost seconds
    dst_ip = cluster.host_ip(dst) if dst >= 0 else cluster.head_ip
    with subprocess.Popen(argv(dst, me + ["listen", "--port", str(port), "--timeout-s", str(timeout_s)]),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as lp:
        try:
            lp.stdout.readline()
            p = subprocess.run(argv(src, me + ["rtt", "--to", f"{dst_ip}:{port}", "--count", str(count)]),
                               check=True, capture_output=True, text=True, timeout=timeout_s)
        finally:
            lp.kill()
    return _last_json(p.stdout)
