"""Build hook: the gRPC stubs are generated from protos/ at build time, never committed."""
import runpy
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


class BuildPyWithProtos(build_py):
    def run(self):
        runpy.run_path(str(HERE / "scripts" / "gen_protos.py"))["generate"](HERE)
        super().run()


setup(cmdclass={"build_py": BuildPyWithProtos})
