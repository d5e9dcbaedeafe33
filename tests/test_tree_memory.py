"""``bench.lab.tree_memory``: the peak of a process tree's memory, children included, shared pages once."""
import subprocess
import sys
import time

from labsupport.bench.lab.tree_memory import TreeMemory, tree_memory
from waiting import wait_until

HOLD = "import sys, time; b = bytearray({n}); b[::4096] = b'x' * len(b[::4096]); print('ready', flush=True); time.sleep(30)"


def test_the_peak_counts_children_and_a_shared_page_once(tmp_path):
    before, _, each = tree_memory()
    assert [name for name, _ in each][0] == "this process"
    already = len(each) - 1  # children an earlier test of this worker left, e.g. multiprocessing's resource tracker
    pythons = sum(name == "python" for name, _ in each) + 2
    memory = TreeMemory(interval_s=0.1).start()
    kids = [subprocess.Popen([sys.executable, "-c", HOLD.format(n=200 << 20)], stdout=subprocess.PIPE, text=True)
            for _ in range(2)]
    try:
        assert all(k.stdout.readline().strip() == "ready" for k in kids)
        wait_until(lambda: memory.peak_processes >= 3 + already and memory.peak - before > 2 * (200 << 20), 20)
        memory.stop()
        assert memory.peak_processes == 3 + already
        assert memory.peak - before > 2 * (200 << 20)  # both children's private 200 MB
        if memory.has_pss:  # two Pythons: their shared libraries are in each RSS, once in the PSS sum
            assert memory.peak_rss > memory.peak
        assert f"peak memory of this kernel and its {2 + already} child processes" in memory.report()
        assert f"{pythons} x python" in memory.report()
    finally:
        for k in kids:
            k.kill()
            k.wait()


def test_the_sampler_ends_with_its_object():
    import gc
    import threading
    TreeMemory(interval_s=0.05).start()
    gc.collect()
    wait_until(lambda: not [t for t in threading.enumerate() if t.name == "tree-memory"], 10)
