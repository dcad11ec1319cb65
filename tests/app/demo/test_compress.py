"""`zeroshard train --compress`: the demo's gradients through a codec, end to end (2 ranks, the tiny GPT).

Each run's report.json holds what every rank's comm_stats() recorded in the
last step beside the formula of estimate/compression.py (or
estimate/powersgd.py) that the report computes bucket by bucket: they must
be equal, and the losses near the exact run's. (PowerSGD's formula is held
to comm_stats() in tests/comm/compress/test_powersgd.py; the report sums it.)
"""

from __future__ import annotations

from tests.app.demo.test_offload import _train


def _run(tmp_path, name: str, stage: int, *flags: str) -> dict:
    return _train(tmp_path, name, "--stage", str(stage), *flags)[1]


def test_the_report_counts_the_compressed_bytes(tmp_path):
    stage, codec = 2, "fp8"
    report = _run(tmp_path, codec, stage, "--compress", codec)
    assert report["config"]["communication_compression"]["gradients"]["codec"] == {"fp8": "fp8_e4m3"}.get(codec, codec)
    formula = report["estimate"]["comm"]
    for comm in report["comm_stats"]:  # every rank
        for op in ("all_reduce", "reduce_scatter"):
            assert comm[op]["bytes"] == formula[op], (op, comm, formula)
    plain = _run(tmp_path, "plain", stage)
    exact = plain["comm_stats"][0]["reduce_scatter"]["bytes"]
    assert report["comm_stats"][0]["reduce_scatter"]["bytes"] < 0.3 * exact  # fp8: about 0.26x, scales included
    assert max(abs(a - b) / b for a, b in zip(report["losses"], plain["losses"])) < 0.05
