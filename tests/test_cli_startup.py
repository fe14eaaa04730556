"""The ``kvserve`` console script imports heavy modules (torch, onnxruntime, transformers, grpc,
onnx) only when a command runs: ``kvserve --help`` and ``kvserve COMMAND --help`` answer at
once, even on a busy machine. Each check runs in a fresh interpreter and reads sys.modules."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvserve.cli import COMMANDS

HEAVY = ("torch", "onnxruntime", "transformers", "grpc", "onnx", "safetensors", "matplotlib")

PROBE = """
import json, sys
from kvserve.cli import main
try:
    rc = main(sys.argv[1:])
except SystemExit as e:
    rc = e.code
print(json.dumps({"rc": rc, "heavy": sorted(m for m in %r if m in sys.modules)}))
""" % (HEAVY,)


def probe(*argv: str) -> dict:
    r = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", [["--help"], *([name, "--help"] for name in COMMANDS)],
                         ids=lambda a: " ".join(a))
def test_help_imports_no_heavy_module(argv):
    got = probe(*argv)
    assert got == {"rc": 0, "heavy": []}


def test_bad_server_address_is_one_line_before_any_import():
    got = probe("generate", "hi", "--server", "50071")
    assert got["rc"] == 2 and got["heavy"] == []
    r = subprocess.run([sys.executable, "-m", "kvserve.cli", "score", "in.txt", "--out", "o",
                        "--server", "50071"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "HOST:PORT expected, got '50071' (e.g. localhost:50071)" in r.stderr
    assert "Traceback" not in r.stderr


def test_export_precision_choices_match_the_pipeline():
    from kvserve.export import cli, pipeline

    assert cli.PRECISIONS == pipeline.PRECISIONS
    from kvserve.export import precision

    assert cli.BLOCKS == precision.BLOCKS


def test_version_is_the_package_version():
    import tomllib
    from pathlib import Path

    from kvserve import __version__

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml")
                              .read_text())
    assert __version__ == pyproject["project"]["version"]
    for flag in ("--version", "-V"):
        r = subprocess.run([sys.executable, "-m", "kvserve.cli", flag], capture_output=True,
                           text=True, timeout=120)
        assert (r.returncode, r.stdout, r.stderr) == (0, f"kvserve {__version__}\n", "")
    assert probe("--version") == {"rc": 0, "heavy": []}


@pytest.mark.parametrize("argv", [["export", "x", "--out", "y"], ["train", "--data", "x"],
                                  ["import-hf", "x", "--out", "y"]])
def test_a_command_without_torch_says_which_extra(argv):
    """The server-only install has no torch: the commands that need it say so in one line."""
    code = ("import sys; sys.modules['torch'] = None\n"
            "from kvserve.cli import main\n"
            f"sys.exit(main({argv!r}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().endswith("pip install 'kvserve[train]'")
    assert len(r.stderr.strip().splitlines()) == 1
