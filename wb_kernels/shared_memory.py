"""Shared-memory banks, as the lessons' bank-conflict pictures count them (lessons 03 and 06).

Shared memory is split into 32 banks of 4-byte words; word w lives in bank w % 32 (NVIDIA, *CUDA C++ Programming
Guide*, "Shared Memory" in the compute capability sections). A bank serves one word per cycle: when the threads of
one request ask one bank for different words, it serves them one after the other (a conflict); threads reading the
same word share it (a broadcast).
"""

from __future__ import annotations

__all__ = ["BANKS", "WORD_BYTES", "conflict_degree"]

BANKS = 32
WORD_BYTES = 4


def conflict_degree(rows) -> int:
    """How many different words of one bank a request asks for at once, from (thread, word, bank) rows: the loads
    that bank serves one by one, so the request's number of passes (wavefronts)."""
    words = {}
    for _, word, bank in rows:
        words.setdefault(bank, set()).add(word)
    return max(len(w) for w in words.values())
