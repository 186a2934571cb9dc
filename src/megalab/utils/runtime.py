"""Process-wide settings that decide CPU speed: the malloc thresholds and the thread policy.

Called once by the entry points (`megalab.train`, `megalab.eval`) *before* torch is imported,
because OpenMP reads its environment when the library is loaded.

**Allocator.** glibc serves blocks of 128 KB and more with `mmap` and gives them back to the
system on `free`, and trims the heap top above 128 KB. A training step allocates and frees the
same large activations every step, so each step faults them in again page by page: for one Mega
layer at 64K tokens that was 2.25M minor page faults per step, system time about equal to user
time, and 42% of all CPU time of `experiment=mega_chunk/lra_listops` (docs/benchmarks.md).
`mallopt(M_MMAP_MAX, 0)` serves every block from the heap and `mallopt(M_TRIM_THRESHOLD, -1)`
never trims it (mallopt(3): -1 disables trimming), so the pages of one step are reused by the
next. (The same as `GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=<huge>`,
which only works when set before the process starts.) The price
is a higher resident set (25-45% more peak RSS in our runs: freed memory is kept, not returned).
The settings apply on Linux with glibc only, and are skipped when

- `MEGALAB_MALLOC_TUNING=0` (the opt-out),
- the user chose malloc parameters already (`GLIBC_TUNABLES` or `MALLOC_*_` variables), or
- another allocator is preloaded (`LD_PRELOAD` naming jemalloc, tcmalloc or mimalloc: those
  keep freed memory themselves). Preloading one is an alternative to the glibc settings, e.g.
  `LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 MALLOC_CONF=retain:true,...`.

**Threads.** A user's `OMP_NUM_THREADS` / `OMP_WAIT_POLICY` always win. Otherwise
`OMP_WAIT_POLICY=PASSIVE`: OpenMP's default lets idle threads spin for a while between
parallel regions, and on a machine shared with other jobs two spinning threads ran 5× slower
than with passive waiting. The intra-op thread count is left to torch (one per core) unless the
process may use fewer CPUs than the machine has (CPU affinity or a cgroup CPU quota), in which
case it is set to that number, since more threads than CPUs only contend.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import os
import platform
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# glibc <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
_PRELOADED = ("jemalloc", "tcmalloc", "mimalloc")

_settings: dict[str, Any] = {}


@functools.cache  # find_library runs ldconfig: once per process
def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def tune_malloc(environ: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """Apply the glibc malloc settings unless opted out; return what was done (for the logs)."""
    if environ.get("MEGALAB_MALLOC_TUNING", "1").strip().lower() in ("0", "false", "no", "off"):
        return "off (MEGALAB_MALLOC_TUNING=0)"
    preload = environ.get("LD_PRELOAD", "")
    for name in _PRELOADED:
        if name in preload:
            return f"off ({name} preloaded)"
    if "glibc.malloc" in environ.get("GLIBC_TUNABLES", "") or any(
        k.startswith("MALLOC_") and k.endswith("_") for k in environ
    ):
        return "off (malloc parameters set by the user)"
    libc = _glibc()
    if libc is None:
        return "off (not Linux/glibc)"
    ok = libc.mallopt(M_MMAP_MAX, 0) == 1
    ok = libc.mallopt(M_TRIM_THRESHOLD, -1) == 1 and ok
    return "tuned (mmap_max=0, no trimming)" if ok else "failed (mallopt returned 0)"


def resident_bytes() -> int | None:
    """The process's resident set now (Linux `/proc/self/statm`); None elsewhere."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def release_free_memory() -> bool:
    """Return the heap's free pages to the system (glibc's `malloc_trim(0)`); False elsewhere.

    With the settings above nothing freed leaves the process, so a burst of allocations that is
    over (the memory plan's probes, whose peak can exceed a training step's) would stay resident
    for the rest of the process. The first step after a trim faults its pages in again once;
    later steps reuse them as before.
    """
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def available_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup v2 CPU quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cpus


def configure_runtime(environ: dict[str, str] | os._Environ[str] = os.environ) -> dict[str, Any]:
    """Set the allocator and thread policy once per process; return the settings in effect."""
    if _settings:
        return dict(_settings)
    torch_loaded = "torch" in sys.modules
    wait = environ.get("OMP_WAIT_POLICY")
    if wait is None:
        environ["OMP_WAIT_POLICY"] = "PASSIVE"
        wait = "PASSIVE" + (" (too late: torch was imported first)" if torch_loaded else "")
    else:
        wait = f"{wait} (user)"
    threads: int | str = environ.get("OMP_NUM_THREADS", "")
    if threads:
        threads = f"{threads} (user)"
    else:
        cpus, machine = available_cpus(), os.cpu_count() or 1
        if cpus < machine:
            environ["OMP_NUM_THREADS"] = str(cpus)
            threads = f"{cpus} (CPUs available to the process)"
        else:
            threads = f"{machine} (torch default, one per core)"
    _settings.update(malloc=tune_malloc(environ), omp_wait_policy=wait, threads=threads)
    return dict(_settings)


def settings() -> dict[str, Any]:
    """The settings `configure_runtime` applied (empty if it was not called)."""
    return dict(_settings)


def log_settings() -> None:
    """Log the runtime settings (after logging is configured)."""
    if _settings:
        log.info(
            "runtime: malloc %s; OMP_WAIT_POLICY %s; threads %s",
            _settings["malloc"],
            _settings["omp_wait_policy"],
            _settings["threads"],
        )
