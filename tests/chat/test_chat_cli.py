"""``kvserve chat`` on a real pseudo-terminal against the real server: the answer streams, the
history grows turn by turn, Ctrl-C stops the current answer (the server cancels it) and the
session goes on, /reset clears the history, Ctrl-D quits with 0."""
from __future__ import annotations

import glob
import os
import platform
import pty
import re
import select
import shutil
import subprocess
import sys
import time

import pytest

from chat_helpers import TOKEN


# the syscalls a thread waiting on a terminal is blocked in: read, poll, select, pselect6, ppoll
_INPUT_SYSCALLS = {"x86_64": {"0", "7", "23", "270", "271"},
                   "aarch64": {"63", "72", "73"}}


class Pty:
    """The program on a new pseudo-terminal as its controlling terminal (util-linux
    ``setsid --ctty``; spawned by subprocess, not a bare fork of this threaded process), so that
    a Ctrl-C typed into the terminal is a real SIGINT from the terminal driver."""

    def __init__(self, argv, env):
        self.fd, slave = pty.openpty()
        self.proc = subprocess.Popen(["setsid", "--ctty", *argv], stdin=slave, stdout=slave,
                                     stderr=slave, env=env, close_fds=True)
        os.close(slave)
        self.pid = self.proc.pid
        self.buf = b""

    def expect(self, pattern: bytes, timeout: float = 60.0) -> bytes:
        end = time.monotonic() + timeout
        while not re.search(pattern, self.buf):
            left = end - time.monotonic()
            assert left > 0, f"no {pattern!r} in {self.buf[-2000:]!r}; {self.signal_state()}"
            r, _, _ = select.select([self.fd], [], [], left)
            if r:
                try:
                    data = os.read(self.fd, 4096)
                except OSError:  # EIO: the child closed the terminal
                    data = b""
                assert data, f"the program ended; no {pattern!r} in {self.buf[-2000:]!r}"
                self.buf += data
        m = re.search(pattern, self.buf)
        got, self.buf = self.buf[:m.end()], self.buf[m.end():]
        return got

    def signal_state(self) -> str:
        """Each thread of the program: its syscall and its pending, blocked and caught signal
        masks (/proc), for a failure message (where a Ctrl-C went)."""
        rows = []
        for task in sorted(glob.glob(f"/proc/{self.pid}/task/*")):
            try:
                with open(f"{task}/status") as f:
                    st = dict(line.split(":", 1) for line in f if ":" in line)
                with open(f"{task}/syscall") as f:
                    nr = f.read().split(maxsplit=1)[0]
            except (OSError, IndexError):
                continue
            rows.append(f"{st['Name'].strip()} syscall {nr} " + " ".join(
                f"{k} {st[k].strip()}" for k in ("SigPnd", "ShdPnd", "SigBlk", "SigIgn",
                                                 "SigCgt")))
        return "threads: " + "; ".join(rows)

    def send(self, data: bytes) -> None:
        os.write(self.fd, data)

    def wait_reading(self, timeout: float = 60.0) -> None:
        """Until the program's main thread is blocked waiting for terminal input (readline's
        select): a Ctrl-C sent before that is only seen with the next key (CPython's readline
        checks signals in its select loop), which a fixed sleep cannot rule out on a loaded
        machine. Read from /proc/PID/syscall (the syscall the thread is blocked in)."""
        waiting = _INPUT_SYSCALLS.get(platform.machine())
        if waiting is None or not os.path.exists(f"/proc/{self.pid}/syscall"):
            pytest.skip("needs /proc/PID/syscall on a known architecture")
        end = time.monotonic() + timeout
        while True:
            try:
                with open(f"/proc/{self.pid}/syscall") as f:
                    nr = f.read().split(maxsplit=1)[0]
            except (OSError, IndexError):
                nr = ""
            if nr in waiting:
                return
            assert time.monotonic() < end, f"kvserve chat never waited for input ({nr!r})"
            time.sleep(0.01)


    def wait(self, timeout: float = 20.0) -> int:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                os.close(self.fd)
                return self.proc.returncode
            try:
                r, _, _ = select.select([self.fd], [], [], 0.05)
                if r:
                    os.read(self.fd, 4096)
            except OSError:
                pass
        self.proc.kill()
        raise AssertionError("kvserve chat did not exit")


def _stats(blob: bytes) -> tuple[int, int]:
    m = re.search(rb"prompt (\d+) tokens, generated (\d+)", blob)
    return int(m[1]), int(m[2])


def test_chat_on_a_terminal(chat_app):
    env = {**os.environ, "KVSERVE_AUTH_TOKEN": TOKEN, "KVSERVE_LOG_LEVEL": "WARNING",
           "TERM": "dumb"}
    p = Pty([sys.executable, "-m", "kvserve.cli", "chat", "--server",
             f"127.0.0.1:{chat_app.port}", "--system", "Be brief.", "--max-new-tokens", "8",
             "--stats"], env)
    try:
        p.expect(rb"you> ")
        p.send(b"hello there\r")
        first = _stats(p.expect(rb"\]\r?\n"))
        p.expect(rb"you> ")
        p.send(b"hello there\r")  # the history goes with it: a longer prompt
        second = _stats(p.expect(rb"\]\r?\n"))
        assert second[0] > first[0] + first[1]
        p.expect(rb"you> ")
        p.send(b"/reset\r")
        p.expect(rb"\[history cleared\]")
        p.expect(rb"you> ")
        p.send(b"hello there\r")
        assert _stats(p.expect(rb"\]\r?\n"))[0] == first[0]
        p.expect(rb"you> ")
        p.send(b"/bogus\r")
        p.expect(rb"unknown command /bogus")
        p.expect(rb"you> ")
        # Ctrl-C at the prompt: a fresh prompt, not the end. Pressed once the prompt waits:
        # a SIGINT that lands between readline writing the prompt and entering its select()
        # is only seen with the next key (CPython's readline; no person types that fast)
        p.wait_reading()
        p.send(b"\x03")
        p.expect(rb"you> ")
        p.send(b"\x04")  # Ctrl-D quits
        assert p.wait() == 0
    finally:
        if p.proc.poll() is None:
            p.proc.kill()


def test_ctrl_c_stops_the_answer_not_the_session(chat_app):
    env = {**os.environ, "KVSERVE_AUTH_TOKEN": TOKEN, "KVSERVE_LOG_LEVEL": "WARNING",
           "TERM": "dumb"}
    # a long answer: 600 tokens (the chat test model's context is 1024), sampled: greedy, this
    # random model loops and speculation makes the 600 tokens in ~50 ms, mostly done before a
    # Ctrl-C typed at the first text reaches the server; sampled, it drafts little (~150 ms)
    p = Pty([sys.executable, "-m", "kvserve.cli", "chat", "--server",
             f"127.0.0.1:{chat_app.port}", "--max-new-tokens", "600", "--temperature", "1.0",
             "--seed", "7", "--stats"], env)
    try:
        p.expect(rb"you> ")

        def reset():
            # an empty line first: a Ctrl-C that landed as the prompt was drawn is only seen
            # with the next key (see above), and would otherwise swallow the /reset, leaving
            # the history (and the next prompt) growing with every round
            p.send(b"\r")
            p.expect(rb"you> ")
            p.send(b"/reset\r")
            p.expect(rb"\[history cleared\]")
            p.expect(rb"you> ")

        stopped, seen = False, []
        for _ in range(10):  # an answer that ended before the Ctrl-C landed: again
            reset()
            before = _generate_outcomes(chat_app)
            p.send(b"hello there\r")
            p.expect(rb"there\r?\n.")  # the echo, then the first text of the answer
            p.send(b"\x03")
            got = p.expect(rb"you> ")
            if b"[stopped]" not in got:  # (the answer had ended: the Ctrl-C met the prompt)
                seen.append((got[-120:], None))
                continue
            # how the server ended the request: cancelled, or done before the Ctrl-C reached it
            end, ended = time.monotonic() + 60, {}  # (a deadline on state: returns once held)
            while not ended and time.monotonic() < end:
                now = _generate_outcomes(chat_app)
                ended = {k: v - before.get(k, 0) for k, v in now.items()
                         if v > before.get(k, 0)}
                time.sleep(0.02)
            seen.append((got[-120:], ended))
            if "cancelled" in ended:  # and nothing else: the client did not resume it
                assert ended == {"cancelled": 1.0}, seen
                stopped = True
                break
        assert stopped, f"Ctrl-C never stopped an answer that the server cancelled: {seen}"
        reset()  # (the stopped answer's history plus 600 new tokens could pass the context)
        p.send(b"again\r")  # the session goes on
        p.expect(rb"\[(length|eos_token)[^\]]*\]")
        p.expect(rb"you> ")
        p.send(b"/exit\r")
        assert p.wait() == 0
    finally:
        if p.proc.poll() is None:
            p.proc.kill()


def _generate_outcomes(app) -> dict[str, float]:
    """The server's Generate requests so far, by outcome (its Prometheus counter)."""
    c = app.metrics.requests
    return {s.labels["outcome"]: s.value for m in c.counter.collect() for s in m.samples
            if s.name == c.sample_name and s.labels.get("rpc") == "Generate"}


@pytest.fixture(autouse=True)
def _needs_a_pty():
    if not hasattr(os, "openpty") or shutil.which("setsid") is None:
        pytest.skip("needs a POSIX pseudo-terminal and util-linux setsid")
