"""Start-up settings of the entry points: glibc malloc thresholds and the OpenMP policy."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from megalab.utils import runtime

LINUX_GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# A loop that allocates and frees the same 64 MB + 64 MB every "step", like a training loop's
# activations; count the minor page faults of its last steps. With glibc's defaults the freed
# blocks go back to the system and every page faults in again, every step; with the tuned
# allocator the heap settles after a few steps and its pages are reused.
_FAULTS = """
import json, os, resource
{prelude}
import torch
faults = []
for step in range(12):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.ones(16 << 20)
    y = x * 2
    del x, y
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
env = {{k: v for k, v in os.environ.items() if k.startswith("OMP_")}}
# the 3 quietest of the last 5 steps: a settled heap, even if a background thread's allocation
# (an imported library's) made the heap grow once more on one of those steps
print(json.dumps({{"faults": sum(sorted(faults[-5:])[:3]), "env": env}}))
"""


def _run(prelude: str, **env: str) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "MEGALAB_MALLOC"))}
    code = _FAULTS.format(prelude=prelude)
    out = subprocess.run(
        [sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not LINUX_GLIBC, reason="the malloc settings apply to Linux/glibc only")
def test_entry_point_settings_keep_freed_pages_and_set_passive_waiting():
    tuned = _run("import megalab.cli.train")
    plain = _run("", MEGALAB_MALLOC_TUNING="0")
    opted_out = _run(
        "from megalab.utils.runtime import configure_runtime; configure_runtime()",
        MEGALAB_MALLOC_TUNING="0",
    )
    pages = 3 * 2 * (64 << 20) // os.sysconf("SC_PAGE_SIZE")  # 3 steps of 2 x 64 MB
    # Without tuning all of it comes back from the system page by page, every step.
    assert plain["faults"] > pages // 2
    assert opted_out["faults"] > pages // 2
    assert tuned["faults"] < pages // 50
    assert tuned["env"]["OMP_WAIT_POLICY"] == "PASSIVE"


def test_user_settings_win():
    env = {"OMP_WAIT_POLICY": "ACTIVE", "OMP_NUM_THREADS": "3", "MEGALAB_MALLOC_TUNING": "0"}
    runtime._settings.clear()
    try:
        got = runtime.configure_runtime(env)
    finally:
        runtime._settings.clear()
    assert env["OMP_WAIT_POLICY"] == "ACTIVE" and env["OMP_NUM_THREADS"] == "3"
    assert got["omp_wait_policy"] == "ACTIVE (user)"
    assert got["threads"] == "3 (user)"
    assert got["malloc"].startswith("off (MEGALAB_MALLOC_TUNING=0)")


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ({"MEGALAB_MALLOC_TUNING": "off"}, "MEGALAB_MALLOC_TUNING=0"),
        ({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, "jemalloc preloaded"),
        ({"GLIBC_TUNABLES": "glibc.malloc.mmap_max=0"}, "set by the user"),
        ({"MALLOC_TRIM_THRESHOLD_": "1000000"}, "set by the user"),
    ],
)
def test_malloc_tuning_steps_aside(env, reason):
    assert reason in runtime.tune_malloc(env)


def test_unset_wait_policy_becomes_passive():
    env: dict[str, str] = {"MEGALAB_MALLOC_TUNING": "0", "OMP_NUM_THREADS": "1"}
    runtime._settings.clear()
    try:
        got = runtime.configure_runtime(env)
    finally:
        runtime._settings.clear()
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"
    # torch is already imported in this test process: the record says it came too late.
    assert got["omp_wait_policy"].startswith("PASSIVE")
    assert runtime.available_cpus() >= 1


# A burst of 256 MB allocated and freed (the memory plan's probes): with the tuned allocator it
# stays resident until `release_free_memory` hands it back.
_TRIM = """
import json, os
from megalab.utils.runtime import configure_runtime, release_free_memory
malloc = configure_runtime()["malloc"]
import torch
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
before = rss()
x = torch.ones(64 << 20)
del x
kept = rss()
released = release_free_memory()
print(json.dumps({"malloc": malloc, "before": before, "kept": kept, "after": rss(),
                  "released": released}))
"""


@pytest.mark.skipif(not LINUX_GLIBC, reason="the malloc settings apply to Linux/glibc only")
def test_freed_memory_goes_back_to_the_system_on_request():
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "MEGALAB_MALLOC"))}
    out = subprocess.run(
        [sys.executable, "-c", _TRIM], env=base, capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["malloc"].startswith("tuned") and got["released"]
    assert got["kept"] - got["before"] > 200 << 20  # the tuned heap kept the 256 MB
    assert got["after"] - got["before"] < 32 << 20  # and gave it back
