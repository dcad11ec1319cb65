"""Counts and sizes as people write and read them: the argparse types of `zeroshard estimate` (7.5e9, 7B,
80GB, 40GiB) and the decimal units its tables print (31.4 GB, 7.5 B)."""

from __future__ import annotations

import argparse
import re

_SUFFIXES = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def count(text: str) -> int:
    """argparse type: a whole number of elements, such as 7.5e9, 124439808 or 7B."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMBT]?)\s*", text)
    try:
        value = float(match.group(1)) * _SUFFIXES[match.group(2)] if match else -1.0
    except ValueError:
        value = -1.0
    if value < 1 or not value.is_integer():
        raise argparse.ArgumentTypeError(f"expected a whole number of elements such as 7.5e9 or 7B, "
                                         f"got '{text}'")
    return int(value)


def threshold(text: str) -> int:
    """argparse type: a count of elements or 0 (a persistence threshold of 0: nothing stays whole)."""
    return 0 if text.strip() == "0" else count(text)


def memory_size(text: str) -> int:
    """argparse type: bytes with a unit, decimal (80GB = 80e9) or binary (80GiB = 80 × 2^30)."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?I?B)\s*", text.upper())
    if not match or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"expected a size with a unit such as 80GB or 40GiB, got '{text}'")
    return int(float(match.group(1)) * _UNITS[match.group(2)])



def human_bytes(n: float) -> str:
    """Decimal units with three significant digits, as the paper prints: 31.4 GB, 1.88 GB, 120 GB."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def human_count(n: int) -> str:
    for suffix, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {suffix}"
    return str(n)

