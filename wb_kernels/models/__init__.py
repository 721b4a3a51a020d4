"""Models that use the package's attention, not rungs of the ladder (the arrows run lessons -> models -> api ->
stages).

- :mod:`.char_transformer`: a tiny character-level GPT trained through ``wb.attention`` and its backward, beside
  the same model on PyTorch's SDPA (lesson 08_backward: "train something real but small with it";
  ``python -m wb_kernels.models.char_transformer --help``).

- :mod:`.llama_decoder`: a LLaMA-shaped decoder (random weights, contiguous or paged KV cache) whose decode
  attention is pluggable: SDPA, the float64 reference, or ``wb.decode`` (lesson 07_decode generates with it);
- :mod:`.decoder_graphs`: the same decoder without its host overhead: a static KV cache, one CUDA graph per batch
  bucket, ``torch.compile(mode="reduce-overhead")``, and whether ``wb.decode`` can be captured;
- :mod:`.decoder_greedy`: the greedy check: two ways of running it in lockstep, identical tokens or a near tie;
- :mod:`.decoder_roofline`: its steps on the roofline chart (bytes per step against time per step, the copy ceiling);
Its tokens-per-second benchmark against the step's roofline is the benchmark's, not a model:
``wb_kernels/bench/decoder_tokens.py`` (``python -m wb_kernels.bench.decoder_tokens``, into
``results/decode/decoder_<gpu>.json``, which lesson 07 reads), with ``decoder_variants.py`` and ``decoder_shared.py``.

``NOTES.md`` beside them says what changed and what has run where. Nothing under ``wb_kernels/stages/`` imports
this package: the rungs do not know their users.
Submodules import torch; this package's ``__init__`` does not, so ``import wb_kernels.models`` stays cheap.
"""
