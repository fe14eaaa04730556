"""The ``kvserve`` console script. Each subcommand lives in its own module, imported only when
chosen (so ``kvserve serve`` never imports torch). A command module provides
``add_arguments(parser)`` and ``main(args) -> int``.

Logging is configured here, in the entry point, and nowhere else.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("kvserve.model.train_cli", "train a model (default: the `small` preset on the "
                                     "Python stdlib sources)"),
    "import-hf": ("kvserve.model.hf_import_cli", "convert a local Hugging Face directory (GPT-2, "
                                                 "Llama, Mistral, Qwen, Gemma, Phi-3, SmolLM) "
                                                 "into a kvserve checkpoint"),
    "export": ("kvserve.export.cli", "export a checkpoint to an ONNX artifact (the fused graph; "
                                     "--portable: standard-ops prefill/decode graphs) with a "
                                     "parity gate and a manifest"),
    "verify": ("kvserve.artifact.verify", "check an artifact directory against its manifest"),
    "native": ("kvserve.artifact.native_cli", "build kvserve's native CPU attention kernel "
                                              "(or say which one serving would use: status)"),
    "sign": ("kvserve.artifact.signing", "sign an artifact's manifest (Ed25519), or make a key "
                                         "pair"),
    "serve": ("kvserve.server.main", "serve an artifact directory over gRPC (and the "
                                     "OpenAI-compatible HTTP API with --http-port)"),
    "generate": ("kvserve.clients.generate", "stream a completion from a server"),
    "score": ("kvserve.clients.score", "score a file of texts against a server"),
    "chat": ("kvserve.clients.chat", "chat with a server's model in the terminal (streamed; "
                                     "its chat template)"),
    "bench": ("kvserve.bench.main", "run the benchmarks and write the tables"),
}


def _usage() -> str:
    lines = ["usage: kvserve COMMAND [options]   (kvserve COMMAND --help for details; "
             "kvserve --version)", "",
             "commands:"]
    for name, (module, help_) in COMMANDS.items():
        available = importlib.util.find_spec(module.rsplit(".", 1)[0]) is not None
        lines.append(f"  {name:<10} {help_}" + ("" if available else "  [not installed]"))
    return "\n".join(lines)


def setup_logging(level: str | None = None) -> None:
    level = (level or os.environ.get("KVSERVE_LOG_LEVEL", "INFO")).upper()
    logging.basicConfig(level=level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _missing(name: str, e: ModuleNotFoundError) -> int:
    print(f"kvserve {name}: needs a package that is not installed ({e.name}); for "
          f"training/export install the extra: pip install 'kvserve[train]'", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from kvserve import __version__

        print(f"kvserve {__version__}")
        return 0
    name = argv[0]
    if name not in COMMANDS:
        print(f"kvserve: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(COMMANDS[name][0])
    except ModuleNotFoundError as e:
        return _missing(name, e)
    parser = argparse.ArgumentParser(prog=f"kvserve {name}", description=COMMANDS[name][1])
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING (env "
                                                          "KVSERVE_LOG_LEVEL)")
    module.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    setup_logging(args.log_level)
    try:
        return int(module.main(args) or 0)
    except ModuleNotFoundError as e:  # (a command imports torch when it runs, not for --help)
        if (e.name or "").split(".")[0] == "kvserve":
            raise
        return _missing(name, e)
    except KeyboardInterrupt:
        print(f"kvserve {name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
