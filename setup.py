"""Build hook: the gRPC stubs are generated from protos/ at build time, never committed; the
native CPU attention library (artifact/native/attention.cc) is compiled for this machine when
a C++ compiler and onnxruntime's headers can be had (artifact/native_build.py: without them
the package installs all the same and serving uses onnxruntime's attention kernel, or the
library already in artifact/native/lib/ when it was built from the same sources for this
machine, as in the Docker images' wheel stage; KVSERVE_NO_NATIVE=1 skips it)."""
import os
import runpy
import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def build_native() -> None:
    if os.environ.get("KVSERVE_NO_NATIVE") == "1":
        return
    native = runpy.run_path(str(HERE / "artifact" / "native_build.py"))
    try:
        lib = native["build"](out_dir=native["PACKAGED"])
        print(f"kvserve: native attention library built: {lib}")
        for old in native["PACKAGED"].iterdir():  # (earlier sources' builds: not packaged)
            if old.is_dir() and old != lib.parent and \
                    "other sources" in native["stamp_problem"](old, False):
                shutil.rmtree(old, ignore_errors=True)
    except Exception as e:  # (any failure: the package still installs, without it)
        print(f"kvserve: native attention library not built ({str(e).splitlines()[0]}); "
              f"serving uses onnxruntime's attention kernel (`kvserve native build` later)",
              file=sys.stderr)


class BuildPyWithProtos(build_py):
    def run(self):
        runpy.run_path(str(HERE / "scripts" / "gen_protos.py"))["generate"](HERE)
        build_native()
        super().run()


setup(cmdclass={"build_py": BuildPyWithProtos})
