"""How a measurement that could not be made is told apart and recorded (lessons 07, 08 and 11's benchmarks): a
size a stage's validation refused, an out-of-memory error, and any error as the one line a record keeps.

Every benchmark module (the prefill sweep, decode, backward, the honesty demonstrations, the decoder's tokens per
second) uses these; they import nothing of the benchmark, so that none of those modules needs another for them.
"""

from __future__ import annotations

__all__ = ["SizeRefused", "error_line", "is_out_of_memory", "is_refusal", "REFUSAL_PHRASES"]


class SizeRefused(Exception):
    """A stage's validate() refused the configuration (memory, simulator time): recorded as skipped."""

    def __init__(self, original: BaseException):
        super().__init__(str(original))
        self.original = original


def error_line(error: BaseException) -> str:
    """`error` as a record keeps it: its type and the first line of its message (300 characters at most)."""
    if isinstance(error, SizeRefused):
        error = error.original
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300] if text else ''}".rstrip(": ")


def is_out_of_memory(error: BaseException) -> bool:
    text = str(error).lower()
    return isinstance(error, MemoryError) or "out of memory" in text or "out_of_memory" in text


# what libraries say when they have no kernel for a problem (SDPA's backends, FlashInfer): a row skipped, not failed
REFUSAL_PHRASES = ("no available kernel", "no viable backend")


def is_refusal(error: BaseException, *also: str) -> bool:
    """Whether `error` says the measurement cannot be made here (a size the stage's validation refused, out of
    memory, a library with no kernel for the problem, or one of the phrases `also`): the row is recorded as
    skipped, with the reason; any other error makes it failed."""
    text = str(error).lower()
    return isinstance(error, SizeRefused) or is_out_of_memory(error) or any(
        phrase in text for phrase in REFUSAL_PHRASES + also)
