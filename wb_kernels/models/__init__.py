"""Models that use the package's attention, not rungs of the ladder (the arrows run lessons -> models -> api ->
stages).

- :mod:`.char_transformer`: a tiny character-level GPT trained through ``wb.attention`` and its backward, beside
  the same model on PyTorch's SDPA (lesson 08_backward: "train something real but small with it";
  ``python -m wb_kernels.models.char_transformer --help``).

The LLaMA-shaped decoder that lesson 07 generates with lives with its rung, ``wb_kernels/stages/decode/decoder.py``.
Submodules import torch; this package's ``__init__`` does not, so ``import wb_kernels.models`` stays cheap.
"""
