"""Builds kvserve's native library (``native/*.cc``: the attention and SwiGLU ops) on the
machine that runs it, and finds it again.

The library is a shared object that onnxruntime loads (``register_custom_ops_library``); it
is compiled against onnxruntime's C/C++ API headers, which the onnxruntime wheel does not
ship. ``headers`` takes them from ``KVSERVE_ORT_INCLUDE`` (a directory holding
``onnxruntime_cxx_api.h``), else from Debian's ``libonnxruntime-dev`` package (1.21: API
version 21, which every later onnxruntime serves), downloaded once and checked against its
SHA-256 before it is unpacked. The API is versioned: a library built against the 1.21 headers
asks onnxruntime for version 21 and runs on any release since.

Where it lives: in the package (``native/lib``, put there by the package's build,
``setup.py``, when a compiler and the headers can be had), else in ``$KVSERVE_NATIVE_DIR``
(default ``~/.cache/kvserve/native``: ``kvserve native build``, or a build on first use when
the headers are already at hand; never a download at serve time); one directory per source
digest, compiler options and machine, with a stamp saying what it was built from and for and
the library's SHA-256. A library is loaded only where its stamp matches (the sources, the
machine, CPU flags this CPU has: AVX2/FMA where the building CPU had them) and only this user
or root can have written it (the directories, the stamp, the library: as ssh asks of keys).
This module needs nothing beyond the standard library (``setup.py`` runs it before anything
is installed).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import platform
import shutil
import subprocess
import tarfile
import tempfile
import urllib.request
from pathlib import Path

NATIVE = Path(__file__).resolve().parent / "native"
PACKAGED = NATIVE / "lib"  # where the package's own build puts it (setup.py)
LIB = "libkvs_attention.so"
DEB_URL = ("https://deb.debian.org/debian/pool/main/o/onnxruntime/"
           "libonnxruntime-dev_1.21.0+dfsg-1_amd64.deb")
DEB_SHA256 = "14f7d959d5deacbcf1504830d4189f91fc67382b399ed9ae9d3aa9c4050ced08"
HEADER = "onnxruntime_cxx_api.h"
VECTOR_FLAGS = ("avx2", "fma")  # built with -mavx2 -mfma where the building CPU has both


def cpu_flags() -> set[str]:
    """This CPU's feature flags (/proc/cpuinfo; empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cache_dir() -> Path:
    return Path(os.environ.get("KVSERVE_NATIVE_DIR")
                or Path.home() / ".cache" / "kvserve" / "native")


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _vector_flags() -> list[str]:
    return list(VECTOR_FLAGS) if set(VECTOR_FLAGS) <= cpu_flags() else []


def sources() -> list[Path]:
    """The library's C++ sources and headers (``native/``), in a fixed order."""
    return sorted([*NATIVE.glob("*.cc"), *NATIVE.glob("*.h")])


# the compiler's options beside the vector flags (-ffp-contract=off: no product and sum fused
# but where the source says so, so the same arithmetic at every place a query's scores are
# taken rounds the same)
OPTIONS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-fvisibility=hidden", "-ffp-contract=off")


def _key(flags: list[str]) -> str:
    """What a build is made of: the sources, the options and vector flags, the machine."""
    h = hashlib.sha256()
    for path in sources():
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    h.update(" ".join([*OPTIONS, *flags, platform.machine()]).encode())
    return h.hexdigest()[:16]


def _ar_member(data: bytes, prefix: str) -> tuple[str, bytes]:
    """The first member of a Unix ``ar`` archive (a .deb) whose name starts with ``prefix``."""
    if not data.startswith(b"!<arch>\n"):
        raise ValueError("not an ar archive")
    pos = 8
    while pos + 60 <= len(data):
        name = data[pos:pos + 16].decode().strip().rstrip("/")
        size = int(data[pos + 48:pos + 58].decode().strip())
        if name.startswith(prefix):
            return name, data[pos + 60:pos + 60 + size]
        pos += 60 + size + (size % 2)
    raise ValueError(f"no {prefix}* in the archive")


def headers(download: bool = True) -> Path | None:
    """A directory holding onnxruntime's API headers: ``KVSERVE_ORT_INCLUDE``, the cached
    copy, or (``download``) Debian's package fetched and checked now. None when none."""
    env = os.environ.get("KVSERVE_ORT_INCLUDE")
    if env:
        return Path(env) if (Path(env) / HEADER).is_file() else None
    home = cache_dir() / "ort-headers-1.21"
    if (home / HEADER).is_file():
        return home
    if not download:
        return None
    with urllib.request.urlopen(DEB_URL, timeout=60) as r:  # noqa: S310 (a fixed https URL)
        deb = r.read()
    if hashlib.sha256(deb).hexdigest() != DEB_SHA256:
        raise RuntimeError(f"{DEB_URL}: SHA-256 differs from the pinned one; not unpacked")
    _, data = _ar_member(deb, "data.tar")
    home.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=home.parent))  # (the same file system: an atomic rename)
    try:
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            for m in tar.getmembers():
                parts = Path(m.name).parts
                if m.isfile() and "include" in parts and m.name.endswith(".h") \
                        and ".." not in parts:
                    rel = Path(*parts[parts.index("onnxruntime", parts.index("include")) + 1:])
                    out = tmp / rel
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_bytes(tar.extractfile(m).read())
        try:
            os.replace(tmp, home)
        except OSError:  # (another process unpacked them first)
            if not (home / HEADER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return home


def build(out_dir: Path | None = None, download: bool = True) -> Path:
    """Compiles the library (if this source and these flags were not built yet) and returns
    its path. Raises with the reason when it cannot."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++) found")
    inc = headers(download)
    if inc is None:
        raise RuntimeError("no onnxruntime headers (set KVSERVE_ORT_INCLUDE)")
    flags = _vector_flags()
    home = (out_dir or cache_dir()) / _key(flags)
    lib = home / LIB
    if lib.is_file() and _stamp_ok(home):
        return lib
    home.mkdir(parents=True, exist_ok=True)
    for d in (home.parent, home):  # (writable by this user alone: _private)
        if d.stat().st_uid == os.getuid():
            d.chmod(d.stat().st_mode & ~0o022)
    fd, name = tempfile.mkstemp(prefix=f".{LIB}.", dir=home)
    os.close(fd)
    tmp = Path(name)
    cmd = [cxx, *OPTIONS, *[f"-m{f}" for f in flags], f"-I{inc}", f"-I{NATIVE}",
           *[str(p) for p in sources() if p.suffix == ".cc"], "-o", str(tmp)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"compiling {NATIVE}/*.cc failed:\n{done.stderr[-2000:]}")
        tmp.chmod(0o755)
        stamp = home / "stamp.json"
        stamp.write_text(json.dumps(
            {"source": _key([]), "flags": flags, "machine": platform.machine(),
             "compiler": cxx, "sha256": hashlib.sha256(tmp.read_bytes()).hexdigest()},
            indent=1))
        stamp.chmod(0o644)
        os.replace(tmp, lib)
    finally:
        tmp.unlink(missing_ok=True)
    return lib


def stamp_problem(home: Path, private: bool) -> str:
    """Why the library in ``home`` may not be loaded ("": it may): built from other sources,
    for another machine or CPU flags this CPU lacks, not the file its build wrote, or
    (``private``: the cache's, not the package's own) writable by another user."""
    try:
        stamp = json.loads((home / "stamp.json").read_text())
        lib = home / LIB
        if not isinstance(stamp, dict) or not isinstance(stamp.get("flags", []), list):
            return "its stamp is not one kvserve wrote"
        if private:
            loose = [str(p) for p in (home.parent, home, home / "stamp.json", lib)
                     if not _private(p)]
            if loose:
                return f"{loose[0]} is writable by another user, or not owned by this user " \
                       f"or root"
        if stamp.get("source") != _key([]) or stamp.get("machine") != platform.machine():
            return "it was built from other sources or for another machine"
        if not set(stamp.get("flags", [])) <= cpu_flags():
            return f"it was built for CPU flags this CPU lacks ({', '.join(stamp['flags'])})"
        if stamp.get("sha256") != hashlib.sha256(lib.read_bytes()).hexdigest():
            return "it is not the file its build wrote (SHA-256)"
    except (OSError, ValueError, TypeError) as e:
        return f"its stamp or library cannot be read ({e})"
    return ""


def _stamp_ok(home: Path) -> bool:
    return not stamp_problem(home, private=home.parent != PACKAGED)


def _private(path: Path) -> bool:
    """Owned by this user or root, and writable by no one else (as ssh asks of its keys)."""
    st = path.stat()
    return st.st_uid in (os.getuid(), 0) and not st.st_mode & 0o022


def library() -> tuple[str | None, str]:
    """(path, "") of a library built from these sources for this machine: the package's own
    (trusted as its Python files are), else the cache's (only where no other user can have
    written it), building it into the cache now when a compiler and cached headers are at
    hand; (None, why) otherwise."""
    key = _key(_vector_flags())
    why = []
    for home, private in ((PACKAGED / key, False), (cache_dir() / key, True)):
        if (home / LIB).is_file():
            problem = stamp_problem(home, private)
            if not problem:
                return str(home / LIB), ""
            why.append(f"{home / LIB}: {problem}")
    try:
        lib = build(download=False)
        problem = stamp_problem(lib.parent, private=True)
        if problem:
            raise RuntimeError(f"{lib}: {problem}")
        return str(lib), ""
    except (RuntimeError, OSError) as e:
        why.append(str(e).splitlines()[0])
        return None, f"the native library is not usable ({'; '.join(why)}; `kvserve native " \
                     f"build` builds it)"
