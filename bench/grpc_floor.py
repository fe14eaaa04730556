"""What one large request costs a bare grpcio server, with no kvserve code in it: the floor
under the per-request memory that ``tests/hardening/test_wire.py`` measures on ``kvserve
serve``.

A generic unary handler with an identity deserializer (as ``server/wire.py`` serves every
method) refuses each request at once; the peak RSS of the server process over its RSS before
the request (VmHWM reset through ``/proc/PID/clear_refs``) is recorded per call, with glibc's
default allocator settings and with a fixed mmap threshold (where freed buffers go back to the
kernel at once, so that the peak shows what is live rather than what the heap reuses).

  python bench/grpc_floor.py [--mb 3.2] [--calls 12] [--out bench/results/grpc-floor.json]

Linux only (/proc).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc

from kvserve.bench.common import proc_memory

METHOD = "/floor.Floor/Refuse"


def rss_peak_during(pid: int, call):
    """Run ``call()``: (the peak RSS of process ``pid`` meanwhile over its RSS before, in
    bytes; what ``call`` returned). The peak is VmHWM, first reset to VmRSS through
    ``/proc/PID/clear_refs``. Also used by tests/hardening/test_wire.py on ``kvserve serve``."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = proc_memory(pid)["VmRSS"]
    out = call()
    return proc_memory(pid)["VmHWM"] - before, out


def serve(port_file: str) -> None:
    def refuse(raw, context):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"refused {len(raw)} bytes")

    handler = grpc.method_handlers_generic_handler("floor.Floor", {
        "Refuse": grpc.unary_unary_rpc_method_handler(refuse)})
    server = grpc.server(futures.ThreadPoolExecutor(8),
                         options=[("grpc.max_receive_message_length", 64 << 20)])
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    Path(port_file).write_text(str(port))
    server.wait_for_termination()


def measure(size: int, calls: int, env: dict[str, str], tmp: Path) -> list[int]:
    port_file = tmp / "port"
    port_file.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port_file)],
                            env={**os.environ, **env})
    try:
        ch = grpc.insecure_channel(f"127.0.0.1:{_wait(port_file, proc)}",
                                   options=[("grpc.max_send_message_length", 64 << 20)])
        call = ch.unary_unary(METHOD)
        data = b"\x01" * size
        def refused():
            try:
                call(data, timeout=30)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e

        refused()  # the first call sets up gRPC's own buffers
        peaks = [rss_peak_during(proc.pid, refused)[0] for _ in range(calls)]
        ch.close()
        return peaks
    finally:
        proc.kill()
        proc.wait()


def _wait(port_file: Path, proc) -> int:
    import time

    for _ in range(500):
        if port_file.exists() and port_file.read_text():
            return int(port_file.read_text())
        if proc.poll() is not None:
            raise RuntimeError("the bare server exited")
        time.sleep(0.01)
    raise RuntimeError("the bare server did not start")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--mb", type=float, default=3.2, help="request size in MB (default 3.2: "
                    "about kvserve's default receive limit)")
    ap.add_argument("--calls", type=int, default=12)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    a = ap.parse_args(argv)
    if a.serve:
        serve(a.serve)
        return 0
    import tempfile

    size = int(a.mb * 1e6)
    out = {"request_bytes": size, "grpcio": grpc.__version__, "settings": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for label, env in (("glibc defaults", {}),
                           ("MALLOC_MMAP_THRESHOLD_=262144", {"MALLOC_MMAP_THRESHOLD_": "262144"})):
            peaks = measure(size, a.calls, env, Path(tmp))
            ratios = [p / size for p in peaks]
            out["settings"][label] = {"peak_bytes": peaks,
                                      "median_x": round(statistics.median(ratios), 2),
                                      "max_x": round(max(ratios), 2)}
            print(f"{label}: peak RSS per {size / 1e6:.1f} MB request: median "
                  f"{statistics.median(ratios):.2f}x, max {max(ratios):.2f}x the request")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
