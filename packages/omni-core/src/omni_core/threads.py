"""A worker's thread count, applied to libraries that loaded before it was known.

OpenMP and OpenBLAS read ``OMP_NUM_THREADS`` once, when they load. A worker forked from
the pipeline's zygote inherits libraries the zygote loaded before the worker's own
environment existed, so its count is applied after the fork the ways torch and OpenBLAS
allow (:func:`apply_thread_env`); a stage calls it after importing a library that sizes
a thread pool at import (``omni_core.plugin`` exports it).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys

THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
# OpenBLAS's thread-count setter, by build (plain, 64-bit interface, numpy's scipy-openblas)
BLAS_SET_THREADS = (
    "openblas_set_num_threads",
    "openblas_set_num_threads64_",
    "scipy_openblas_set_num_threads64_",
    "scipy_openblas_set_num_threads",
)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which a container or
    ``taskset`` narrows; the machine's count where the platform has none), read when
    asked: what a thread count of "every core" means on the machine it runs on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def openblas_libs() -> list[ctypes.CDLL]:
    """The OpenBLAS builds loaded in this process (numpy's, scipy's)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line and ".so" in line}
    except OSError:
        return []
    libs = []
    for path in sorted(paths):
        with contextlib.suppress(OSError):
            libs.append(ctypes.CDLL(path))
    return libs


def apply_thread_env() -> None:
    """OpenMP and OpenBLAS read ``OMP_NUM_THREADS`` when they loaded in the zygote: set
    a worker's own count the ways torch and OpenBLAS allow after loading."""
    n = next(
        (int(v) for k in THREAD_ENV if (v := os.environ.get(k, "")).isdigit() and int(v) > 0),
        None,
    )
    if n is None:
        return
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(n)
    for lib in openblas_libs():
        for name in BLAS_SET_THREADS:
            fn = getattr(lib, name, None)
            if fn is not None:
                fn(n)
                break
