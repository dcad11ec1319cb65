"""The swap path's disk bandwidth on one directory (offload to nvme_path), beside dd's, and the checksum's cost.

It measures what the engine's swap files get: zeroshard.offload.measure_bandwidth
writes and reads one swap file through SwapDir / SwapFile (O_DIRECT where the
filesystem allows it, `--threads` workers, `--block-size` requests, crc32
per block included), best of `--rounds`. Beside it, dd on the same directory
with the page cache bypassed, the usual yardstick:

    dd if=/dev/zero of=DIR/dd.bin bs=8M count=64 oflag=direct    (write)
    dd if=DIR/dd.bin of=/dev/null bs=8M iflag=direct              (read)

`--checksums` also times the candidate checksums on a 64 MiB buffer in one
thread (GiB/s), the figures behind swap_file.py's choice of zlib.crc32.

    python benchmarks/disk_bandwidth.py /tmp --size-mib 256 --checksums
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import time
import zlib
from pathlib import Path

import torch

from zeroshard.offload import measure_bandwidth

GIB = 1 << 30


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", type=Path, help="the directory to measure (an nvme_path)")
    p.add_argument("--size-mib", type=int, default=256, help="MiB written and read per round")
    p.add_argument("--block-size", type=int, default=1 << 20, help="bytes per I/O request (a multiple of 4096)")
    p.add_argument("--threads", type=int, default=2, help="the SwapDir's worker threads")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-dd", action="store_true", help="skip dd's figures")
    p.add_argument("--checksums", action="store_true", help="also time crc32 and the alternatives")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    return p.parse_args()


def dd(path: Path, size_mib: int) -> dict:
    """dd's write and read rates with O_DIRECT, bytes/s (dd's own report), on a file it removes after."""
    target = path / f"zeroshard-dd-{os.getpid()}.bin"
    count = max(1, size_mib // 8)
    try:
        write = _dd_rate(["dd", "if=/dev/zero", f"of={target}", "bs=8M", f"count={count}", "oflag=direct"])
        read = _dd_rate(["dd", f"if={target}", "of=/dev/null", "bs=8M", "iflag=direct"])
    finally:
        target.unlink(missing_ok=True)
    return {"dd_write_bytes_per_s": write, "dd_read_bytes_per_s": read}


def _dd_rate(cmd: list[str]) -> float | None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    found = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", done.stderr)
    if done.returncode or not found:
        return None  # e.g. a filesystem that refuses O_DIRECT
    return int(found[1]) / float(found[2])


def checksums(nbytes: int = 64 << 20) -> dict:
    """GiB/s of each candidate checksum over `nbytes` random bytes, one thread, best of 5."""
    data = memoryview(torch.randint(0, 256, (nbytes,), dtype=torch.uint8).numpy())
    candidates = {"zlib.crc32": zlib.crc32, "zlib.adler32": zlib.adler32,
                  "hashlib.sha1": lambda b: hashlib.sha1(b).digest(),
                  "hashlib.sha256": lambda b: hashlib.sha256(b).digest(),
                  "hashlib.blake2b": lambda b: hashlib.blake2b(b).digest(),
                  "hashlib.md5": lambda b: hashlib.md5(b).digest()}
    rates = {}
    for name, fn in candidates.items():
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            fn(data)
            best = min(best, time.perf_counter() - start)
        rates[name] = nbytes / best / GIB
    return rates


def main() -> None:
    args = parse_args()
    result = measure_bandwidth(args.path, block_size=args.block_size, nbytes=args.size_mib << 20,
                               threads=args.threads, rounds=args.rounds)
    if not args.no_dd and shutil.which("dd"):
        result.update(dd(args.path, args.size_mib))
    if args.checksums:
        result["checksum_gib_per_s"] = checksums()
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"{args.path}: {'O_DIRECT' if result['direct'] else 'buffered I/O'}, {result['nbytes'] >> 20} MiB, "
          f"{result['block_size']}-byte requests, {result['threads']} threads, best of {result['rounds']}")
    print(f"  swap file write {result['write_bytes_per_s'] / 1e9:.2f} GB/s, read {result['read_bytes_per_s'] / 1e9:.2f}"
          " GB/s (crc32 per block included)")
    if result.get("dd_write_bytes_per_s"):
        print(f"  dd bs=8M direct: write {result['dd_write_bytes_per_s'] / 1e9:.2f} GB/s, "
              f"read {(result['dd_read_bytes_per_s'] or 0) / 1e9:.2f} GB/s")
    for name, rate in result.get("checksum_gib_per_s", {}).items():
        print(f"  {name:16s} {rate:6.2f} GiB/s (one thread, 64 MiB)")


if __name__ == "__main__":
    main()
