"""``usable_cores``: the cores the process may run on, read when asked (a narrowed CPU
affinity, as a container's or ``taskset``'s, is what counts)."""

import os
import subprocess
import sys

import pytest
from omni_core.plugin import usable_cores


def test_usable_cores_is_the_processs_affinity():
    assert usable_cores() == len(os.sched_getaffinity(0)) >= 1


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to narrow")
def test_a_narrowed_affinity_is_read_at_the_call():
    one = min(os.sched_getaffinity(0))
    code = (
        "import os; from omni_core.plugin import usable_cores; a = usable_cores(); "
        f"os.sched_setaffinity(0, {{{one}}}); print(a, usable_cores())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, after = map(int, out.stdout.split())
    assert before == len(os.sched_getaffinity(0)) and after == 1
