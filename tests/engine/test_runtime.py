"""`runtime.release_openmp_pool`: the thread that steps an engine is the process's only OpenMP
pool (libgomp's barriers sleep in futexes once the pools outnumber the CPUs)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from yuebing.engine import runtime

SCRIPT = r"""
import os, threading, time, torch
from yuebing.engine import runtime

def tasks():
    return len(os.listdir("/proc/self/task"))

def settle(n):  # released workers exit on their own: wait for the count
    end = time.monotonic() + 10
    while tasks() != n and time.monotonic() < end:
        time.sleep(0.01)
    return tasks()

torch.set_num_threads(2)
before = tasks()
big = torch.ones(1 << 22)  # the main thread's parallel region starts its pool
pooled = tasks()
released = runtime.release_openmp_pool()
after = settle(before)
big.mul_(1.0)  # the main thread alone now
again = tasks()
seen = {}

def helper():
    runtime.release_openmp_pool()
    n = tasks()
    big.mul_(1.0)
    seen["helper"] = (tasks() - n, torch.get_num_threads())

def driver():
    n = tasks()
    big.mul_(1.0)
    seen["driver"] = (tasks() - n, torch.get_num_threads())

for fn in (helper, driver):
    t = threading.Thread(target=fn)
    t.start()
    t.join()
print(pooled - before, released, after - before, again - before, torch.get_num_threads(),
      *seen["helper"], *seen["driver"])
"""


@pytest.mark.skipif(runtime._libgomp() is None, reason="torch runs another OpenMP runtime here")
def test_released_threads_run_parallel_regions_alone_and_the_driver_keeps_its_pool() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    pooled, released, after, again, main_threads, helper_new, helper_threads, driver_new, \
        driver_threads = out
    assert pooled == "1" and released == "True"  # a 2-thread pool: one worker besides main
    assert after == "0" and again == "0"  # the worker exited; main's next region starts none
    assert main_threads == "1"
    assert (helper_new, helper_threads) == ("0", "1")  # a helper's region: no pool
    assert (driver_new, driver_threads) == ("1", "2")  # torch's default: the driver's pool
