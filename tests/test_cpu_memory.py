"""``kernels/cpu_memory.py``: freed activation memory stays in the process, so the next step's tensors
of the same size do not fault their pages in again. Counted with the kernel's own page-fault counter
(``getrusage``), in fresh interpreters: the setting is process-wide and applied once."""
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="the malloc settings are glibc's")

PROBE = """
import resource, sys, torch
import labsupport.llm  # an engine process's imports (transformers, ...): the heap an engine's steps meet
from labsupport.kernels import cpu_memory
applied = cpu_memory.keep_freed_memory() if sys.argv[1] == "keep" else False
torch.empty(16 << 20).fill_(1)  # 64 MB, the size of a prefill step's gate/up product
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    torch.empty(16 << 20).fill_(1)
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode, env=None):
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True,
                         env={**os.environ, **(env or {})}).stdout.split()
    return out[0] == "True", int(out[1])


def test_a_reused_64_mb_tensor_faults_its_pages_in_once_not_every_time():
    applied, kept = faults("keep")
    _, default = faults("default")
    pages = (64 << 20) // 4096
    assert applied
    assert default >= 8 * pages, f"glibc's default should map and unmap each time ({default} faults)"
    # reused in place: at most one of the ten lands on fresh pages (the heap's top moves now and then)
    assert kept <= 2 * pages, f"the freed block should be reused in place ({kept} faults)"


def test_the_environment_variable_leaves_malloc_alone():
    applied, faulted = faults("keep", {"LABSUPPORT_KEEP_FREED_MEMORY": "0"})
    assert not applied and faulted >= 8 * (64 << 20) // 4096
