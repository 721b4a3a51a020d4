"""``wb.decode``'s names where earlier code imports them (lesson 07's tests, ``wb_kernels.decoding.seqlen_bucket``
in the decode launcher's messages). The entry point is :func:`wb_kernels.api.decode`, its checks are in
:mod:`wb_kernels.validation` and its run in :mod:`wb_kernels.execution`; new code imports from those.
"""

from .api import decode, decode_problems
from .execution import decode_eager, reference_decode
from .validation import (DECODE_STAGES, KV_LAYOUTS, MAX_NUM_SPLITS, as_hnd, check_decode_options, seqlen_bucket,
                         validate_decode)

__all__ = ["decode", "validate_decode", "DECODE_STAGES", "KV_LAYOUTS", "MAX_NUM_SPLITS", "reference_decode",
           "seqlen_bucket", "decode_problems", "as_hnd", "decode_eager", "check_decode_options"]

_check_options = check_decode_options  # its earlier name (tests/test_decode_robustness.py)
