"""Rank programs for tests/app/tune/test_tune.py's trial runner: `python -m tests.app.tune.tune_programs ACTION ...`.

- `allocate BYTES CSV`: touch BYTES of memory, then write two steps' seconds to CSV (as the demo's --log-csv)
  on rank 0 and exit 0; a memory limit under BYTES ends it with MemoryError or the kernel's kill.
- `hang PIDFILE`: start a child that sleeps, write its pid to PIDFILE.rank<R>, and sleep: only a kill ends it.
- `fail`: print an error line and exit 3.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time


def main(argv: list[str]) -> int:
    action, rank = argv[0], int(os.environ["RANK"])
    if action == "allocate":
        block = bytearray(int(argv[1]))  # zero-filled by the allocator: its pages are touched
        block[::4096] = b"\x01" * len(block[::4096])
        if rank == 0:
            with open(argv[2], "w", encoding="utf-8") as csv:
                csv.write("step,loss,lr,step_seconds,tokens_per_second\n1,1.0,0.1,0.5,1.0\n2,1.0,0.1,0.25,1.0\n")
        return 0
    if action == "hang":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(f"{argv[1]}.rank{rank}", "w", encoding="utf-8") as pidfile:
            pidfile.write(str(child.pid))
        time.sleep(600)
    print(f"ValueError: rank {rank} was told to fail", flush=True)
    return 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
