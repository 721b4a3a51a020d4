"""``wb.decode``'s names at the module path earlier releases documented (``wb_kernels.decoding.seqlen_bucket``,
``wb_kernels.decoding.decode_problems``), kept so that code written against them still imports. Nothing in the package
imports this module: the entry point is :func:`wb_kernels.api.decode`, its checks are in :mod:`wb_kernels.validation`
and its run in :mod:`wb_kernels.execution`; new code calls ``wb.decode``, ``wb.seqlen_bucket`` and
``wb.decode_problems``.
"""

from .api import decode, decode_problems
from .execution import decode_eager, reference_decode
from .validation import (DECODE_STAGES, KV_LAYOUTS, MAX_NUM_SPLITS, as_hnd, check_decode_options, seqlen_bucket,
                         validate_decode)

__all__ = ["decode", "validate_decode", "DECODE_STAGES", "KV_LAYOUTS", "MAX_NUM_SPLITS", "reference_decode",
           "seqlen_bucket", "decode_problems", "as_hnd", "decode_eager", "check_decode_options"]
