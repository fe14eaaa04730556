"""``kvserve chat`` on a real pseudo-terminal against the real server: the answer streams, the
history grows turn by turn, Ctrl-C stops the current answer (the server cancels it) and the
session goes on, /reset clears the history, Ctrl-D quits with 0."""
from __future__ import annotations

import os
import pty
import re
import select
import sys
import time

import pytest

from chat_helpers import TOKEN


class Pty:
    def __init__(self, argv, env):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the pty is its controlling terminal
            os.execvpe(argv[0], argv, env)
        self.buf = b""

    def expect(self, pattern: bytes, timeout: float = 60.0) -> bytes:
        end = time.monotonic() + timeout
        while not re.search(pattern, self.buf):
            left = end - time.monotonic()
            assert left > 0, f"no {pattern!r} in {self.buf[-2000:]!r}"
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

    def send(self, data: bytes) -> None:
        os.write(self.fd, data)

    def wait(self, timeout: float = 20.0) -> int:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
            try:
                os.read(self.fd, 4096)
            except OSError:
                pass
            time.sleep(0.05)
        os.kill(self.pid, 9)
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
        p.send(b"\x03")  # Ctrl-C at the prompt: a fresh prompt, not the end
        p.expect(rb"you> ")
        p.send(b"\x04")  # Ctrl-D quits
        assert p.wait() == 0
    finally:
        if p.pid:
            try:
                os.kill(p.pid, 9)
            except ProcessLookupError:
                pass


def test_ctrl_c_stops_the_answer_not_the_session(chat_app):
    env = {**os.environ, "KVSERVE_AUTH_TOKEN": TOKEN, "KVSERVE_LOG_LEVEL": "WARNING",
           "TERM": "dumb"}
    # a long answer: 600 tokens (the chat test model's context is 1024)
    p = Pty([sys.executable, "-m", "kvserve.cli", "chat", "--server",
             f"127.0.0.1:{chat_app.port}", "--max-new-tokens", "600", "--temperature", "1",
             "--seed", "3", "--stats"], env)
    try:
        p.expect(rb"you> ")
        stopped = False
        for _ in range(5):  # an answer that ended before the Ctrl-C landed: again
            before = chat_app.metrics.requests.get(rpc="Generate", outcome="cancelled")
            p.send(b"/reset\r")
            p.expect(rb"you> ")
            p.send(b"go\r")
            p.expect(rb"go\r?\n.")  # the echo, then the first text of the answer
            p.send(b"\x03")
            got = p.expect(rb"you> ")
            if b"[stopped]" not in got:
                continue
            end = time.monotonic() + 5
            while not stopped and time.monotonic() < end:  # the server cancelled it
                stopped = chat_app.metrics.requests.get(rpc="Generate",
                                                        outcome="cancelled") > before
                time.sleep(0.02)
            if stopped:
                break
        assert stopped, "Ctrl-C never stopped an answer that the server then cancelled"
        p.send(b"again\r")  # the session goes on
        p.expect(rb"\[(length|eos_token)[^\]]*\]")
        p.expect(rb"you> ")
        p.send(b"/exit\r")
        assert p.wait() == 0
    finally:
        try:
            os.kill(p.pid, 9)
        except ProcessLookupError:
            pass


@pytest.fixture(autouse=True)
def _no_pty_on_windows():
    if not hasattr(os, "fork"):
        pytest.skip("needs a POSIX pseudo-terminal")
