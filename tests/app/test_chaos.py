"""A run that loses a rank: `zeroshard train --max-restarts` resumes it, bitwise, after SIGKILL.

The shortened form of scripts/chaos.py (which kills at least 10 times over
6 configurations): one rank killed inside an asynchronous save's background
write (the previous checkpoint stays 'latest' and is the one resumed); the restarted ranks resume from the
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
    # Rank 1 dies writing step 4's checkpoint (step 2's stays 'latest'), while the ranks train step 5.
    kills = [{"rank": 1, "point": "async_save", "after": 2}]
    problems = chaos.chaos(tmp_path, "bf16:3:async", 5, 2, kills, data=str(text))
    assert problems == [], problems
    output = " ".join((tmp_path / "chaos" / "output.txt").read_text().split())  # rich wraps long lines
    assert output.count("failed (exitcode: -9)") == 1, output[-3000:]
    squeezed = "".join(output.split())  # rich also breaks long paths
    # The kill in step 4's write left step 2's checkpoint 'latest': the first restart resumed from it.
    assert "ck/global_step2atstep2(torchrunrestart1)" in squeezed, output[-3000:]
