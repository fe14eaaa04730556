"""How much host memory this process may use: the machine's (``/proc/meminfo``) or, tighter,
its control group's limit (cgroup v2 ``memory.max``, v1 ``memory.limit_in_bytes``, over the
group and its ancestors: a container's limit, which ``/proc/meminfo`` does not show), and how
much of that is free now. Read where something allocates by a user's size (the prefix pool),
so that a size beyond the limit is refused at start instead of the process being killed when
the memory is finally touched."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# a v1 group's "no limit" is the largest page-aligned int64; anything this large is none
_UNLIMITED = 1 << 60


@dataclass(frozen=True)
class HostMemory:
    limit: int | None  # bytes this process may use at most (None: unknown)
    available: int | None  # bytes free for it now (None: unknown)
    source: str  # what set the limit: "this machine" or "its control group (…)"


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value < _UNLIMITED else None


def _meminfo(proc: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[key] = int(parts[0]) << 10  # (kB)
    except OSError:
        pass
    return out


def _groups(proc: Path) -> tuple[str | None, str | None]:
    """This process's cgroup v2 path and v1 memory-controller path (each None if absent)."""
    v2 = v1 = None
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def _tightest(base: Path, path: str, limit_file: str, usage_file: str
              ) -> tuple[int | None, int | None]:
    """The smallest limit over the group at ``path`` under ``base`` and its ancestors, and
    the usage of the group that sets it. A container that mounts its own group at ``base``
    sees a path that is not there: then ``base`` itself is the group."""
    best: tuple[int | None, int | None] = (None, None)
    here = base / path.strip("/")
    if not here.is_dir():
        here = base
    while True:
        limit = _read_int(here / limit_file)
        if limit is not None and (best[0] is None or limit < best[0]):
            best = (limit, _read_int(here / usage_file))
        if here == base or base not in here.parents:
            return best
        here = here.parent


def host_memory(proc: Path = Path("/proc"), cgroup: Path = Path("/sys/fs/cgroup")
                ) -> HostMemory:
    info = _meminfo(proc)
    limit, available = info.get("MemTotal"), info.get("MemAvailable")
    source = "this machine"
    v2, v1 = _groups(proc)
    for path, base, files, kind in (
            (v2, cgroup, ("memory.max", "memory.current"), "v2"),
            (v1, cgroup / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes"), "v1")):
        if path is None or not base.is_dir():
            continue
        group_limit, usage = _tightest(base, path, *files)
        if group_limit is not None and (limit is None or group_limit < limit):
            limit, source = group_limit, f"its control group ({kind})"
            free = group_limit - usage if usage is not None else None
            available = free if available is None or free is None else min(available, free)
    return HostMemory(limit, available, source)
