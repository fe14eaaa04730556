"""``kvserve chat --server HOST:PORT``: an interactive chat in the terminal, streamed.

The conversation is kept and sent whole each turn (the server renders it with the model's chat
template). ``/reset`` clears it (keeping ``--system``), ``/exit`` or Ctrl-D quits. Ctrl-C while an
answer streams stops that answer (the call is cancelled, the server frees the slot) and keeps
what was said so far; Ctrl-C at the prompt only clears the line. The server's model is checked
at start-up (ModelInfo): a server that cannot be reached, or a model without a chat template,
is said in one line before the first prompt and the command exits 1.
"""
from __future__ import annotations

import argparse
import contextlib
import queue
import signal
import sys
import threading

from .common import add_connection_arguments, client_from_args, fail, uint32, uint64

PROMPT = "you> "
_END = object()
HELP = "[/reset clears the history, /exit or Ctrl-D quits, Ctrl-C stops an answer]"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_connection_arguments(parser, timeout=300.0, retries=2, resume=True)
    parser.add_argument("--system", default=None, help="a system message opening the chat")
    s = parser.add_argument_group("sampling (defaults: greedy)")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    s.add_argument("--top-p", type=float, default=None, help="(0, 1]; unset = off")
    s.add_argument("--seed", type=uint64, default=None)
    s.add_argument("--max-new-tokens", type=uint32, default=0, help="0 = the server's default")
    s.add_argument("--stats", action="store_true",
                   help="after each answer, a line with the finish reason and token counts")


def _fresh(args: argparse.Namespace) -> list[dict]:
    return [{"role": "system", "content": args.system}] if args.system else []


def main(args: argparse.Namespace) -> int:
    try:
        import readline  # noqa: F401 - line editing and history for input()
    except ImportError:  # pragma: no cover
        pass
    out = sys.stdout
    history = _fresh(args)
    opts = dict(temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                max_new_tokens=args.max_new_tokens)
    _own_ctrl_c()
    with contextlib.ExitStack() as stack:
        with _sigint_blocked():
            client = stack.enter_context(client_from_args(args))
            why = _cannot_chat(client, args.server)
        if why:
            print(f"kvserve chat: {why}", file=sys.stderr, flush=True)
            return 1
        print(f"kvserve chat with {args.server} {HELP}", file=sys.stderr, flush=True)
        while True:
            try:
                line = input(PROMPT)
            except EOFError:
                out.write("\n")
                return 0
            except KeyboardInterrupt:  # clears the line, not the session
                out.write("\n")
                continue
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/quit"):
                return 0
            if text == "/reset":
                history = _fresh(args)
                print("[history cleared]", file=sys.stderr, flush=True)
                continue
            if text.startswith("/"):
                print(f"[unknown command {text.split()[0]}] {HELP}", file=sys.stderr,
                      flush=True)
                continue
            history.append({"role": "user", "content": line})
            try:
                rc = _turn(client, history, opts, args.stats, args.server)
            except KeyboardInterrupt:  # landed between the stream's end and the next prompt
                out.write("\n")
                rc = None
            if history and history[-1]["role"] == "user" and rc is None:
                history.append({"role": "assistant", "content": ""})
            if rc is not None:
                return rc


def _own_ctrl_c() -> None:
    """Ctrl-C at the prompt clears the line (a KeyboardInterrupt in ``input``), whatever this
    process inherited: a parent that ignored SIGINT or blocked it when it started us would
    otherwise leave Ctrl-C doing nothing."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _no_sigint_here() -> None:
    """For a helper thread: SIGINT blocked in it (and in the threads gRPC starts from it), so
    the kernel delivers a Ctrl-C to the main thread, where Python runs its handler."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


@contextlib.contextmanager
def _sigint_blocked():
    """SIGINT blocked in this thread for the block: threads started in it (gRPC's, by the
    channel and its first call) inherit it blocked, so a Ctrl-C always reaches the main thread.
    Delivered to one of gRPC's threads, it would leave readline's select() waiting until the
    next key (Python runs signal handlers in the main thread only, and nothing wakes it). A
    no-op where the platform has no pthread_sigmask."""
    if not hasattr(signal, "pthread_sigmask"):  # pragma: no cover
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _cannot_chat(client, server: str) -> str:
    """Why the server's model cannot chat ("" when it can), from one ModelInfo call."""
    from .client import KvserveError
    from .common import error_line

    try:
        info = client.model_info()
    except KvserveError as e:
        return error_line(e, server)
    if not info.chat_template_available:
        return (f"the model at {server} cannot chat: it has no usable chat template (none in "
                "its tokenizer_config.json, or one the server refused: see its log; models made "
                "by `kvserve train` have ChatML's). `kvserve generate` makes plain completions")
    return ""


def _turn(client, history: list[dict], opts: dict, stats: bool, server: str) -> int | None:
    """One answer, streamed; appends it to ``history``. Returns an exit code to stop with.

    The stream is read on a helper thread. While it runs, Ctrl-C (SIGINT) is handled, not
    raised: the handler marks the answer stopped and cancels the call from a short-lived thread,
    so no KeyboardInterrupt lands inside gRPC's or this loop's code."""
    import grpc  # here, not at import: `kvserve chat --help` stays light

    from .client import Completion, KvserveError, TokenEvent

    out = sys.stdout
    answer, done = [], None
    events: queue.SimpleQueue = queue.SimpleQueue()
    calls: list = []
    stop = threading.Event()

    def pump() -> None:
        _no_sigint_here()
        try:
            for ev in client.generate_stream(list(history), on_call=calls.append, **opts):
                events.put(ev)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            events.put(e)
        finally:
            events.put(_END)

    def cancel_all() -> None:
        _no_sigint_here()
        for call in list(calls):
            call.cancel()  # the server stops this answer and frees the slot

    def on_sigint(signum, frame) -> None:
        stop.set()
        threading.Thread(target=cancel_all, daemon=True).start()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        reader = threading.Thread(target=pump, name="kvserve-chat-stream", daemon=True)
        reader.start()
        error = None
        while True:
            ev = events.get()
            if ev is _END:
                break
            if isinstance(ev, BaseException):
                error = ev
            elif stop.is_set():
                continue
            elif isinstance(ev, TokenEvent):
                if ev.text:
                    answer.append(ev.text)
                    out.write(ev.text)
                    out.flush()
            elif isinstance(ev, Completion):
                done = ev
        reader.join()
    finally:
        signal.signal(signal.SIGINT, previous)
    if stop.is_set():
        out.write(" [stopped]")
    elif error is not None:
        history.pop()
        if isinstance(error, KvserveError) and \
                error.code == grpc.StatusCode.FAILED_PRECONDITION:
            return fail("chat", error, server)
        out.write("\n")
        fail("chat", error, server)
        return None
    history.append({"role": "assistant", "content": "".join(answer)})
    out.write("\n")
    out.flush()
    if stats and done is not None:
        print(f"[{done.finish_reason}; prompt {done.prompt_tokens} tokens, generated "
              f"{done.generated_tokens}]", file=sys.stderr, flush=True)
    return None
