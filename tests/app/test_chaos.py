"""A run that loses a rank: `zeroshard train --max-restarts` resumes it, bitwise, after SIGKILL.

The shortened form of scripts/chaos.py (which kills at least 10 times over
6 configurations): one rank killed inside an asynchronous save's background
write (the previous checkpoint stays 'latest' and is the one resumed), then the other inside backward; the restarted ranks resume from the
latest complete checkpoint, and the final checkpoint equals the
uninterrupted run's bit for bit (fp32 masters, optimizer state, counters,
LR schedule). Reference: the same command without kills.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import chaos  # noqa: E402


def test_killed_ranks_restart_and_end_bitwise_equal_to_the_uninterrupted_run(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("In the beginning God created the heaven and the earth. " * 200)
    # Rank 1 dies writing step 4's checkpoint (step 2's stays 'latest'); rank 0 dies in backward after resuming.
    kills = [{"rank": 1, "point": "async_save", "after": 2}, {"rank": 0, "point": "backward", "after": 20}]
    problems = chaos.chaos(tmp_path, "bf16:3:async", 6, 2, kills, data=str(text))
    assert problems == [], problems
    output = " ".join((tmp_path / "chaos" / "output.txt").read_text().split())  # rich wraps long lines
    assert output.count("failed (exitcode: -9)") == 2, output[-3000:]
    assert "resumed from" in output and "torchrun restart" in output, output[-3000:]
