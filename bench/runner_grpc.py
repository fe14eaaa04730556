"""``kvserve serve`` in a subprocess, driven over gRPC by the Python client (``grpc``)."""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

from .common import memory_mb
from .runner_base import Runner


class Server:
    """``kvserve serve`` in a subprocess on a free port; its peak RSS read from /proc."""

    def __init__(self, artifact: str, threads: int, max_batch: int, workdir: Path):
        import subprocess

        port_file = workdir / f"port-{os.getpid()}.json"
        port_file.unlink(missing_ok=True)
        self.log = open(workdir / "server.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvserve.cli", "serve", artifact, "--port", "0",
             "--port-file", str(port_file), "--threads", str(threads), "--max-batch",
             str(max_batch), "--max-queue", "64", "--no-verify", "--log-level", "WARNING"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while not port_file.is_file():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start; see {workdir / 'server.log'}")
            time.sleep(0.1)
        self.port = json.loads(port_file.read_text())["port"]

    def peak_rss_mb(self) -> float:
        return memory_mb("VmHWM", self.proc.pid)

    def stop(self) -> None:
        import signal

        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except Exception:
            self.proc.kill()
        self.log.close()


class GrpcRunner(Runner):
    """``kvserve serve`` in a subprocess driven by the Python gRPC client: a batch of B prompts
    is B concurrent streams (one thread each), a batch of 1 is one stream. The server's
    ``--max-batch`` is the largest batch asked for."""
    name = "grpc"

    def __init__(self, artifact: str, threads: int, max_batch: int, workdir: Path):
        from kvserve.clients.client import Client

        workdir.mkdir(parents=True, exist_ok=True)
        self.server = Server(artifact, threads, max_batch=max_batch, workdir=workdir)
        self.client = Client(f"127.0.0.1:{self.server.port}", timeout=600)

    def _one(self, prompt, n) -> list[int]:
        ids = np.asarray(prompt, np.int64).tolist()  # (as the engine runner's requests)
        return [ev.id for ev in self.client.generate_stream(ids, max_new_tokens=n,
                                                            ignore_eos=True)
                if ev.type == "token"]

    def generate(self, prompts, n):
        out: list = [None] * len(prompts)

        def worker(i):
            out[i] = self._one(prompts[i], n)

        if len(prompts) == 1:
            worker(0)
        else:
            threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        if any(o is None or len(o) != n for o in out):
            raise RuntimeError(f"a stream did not deliver {n} tokens")
        return np.array(out, np.int64)

    def extra(self) -> dict:
        return {"server_rss_peak_mb": self.server.peak_rss_mb()}

    def close(self):
        self.client.close()
        self.server.stop()
