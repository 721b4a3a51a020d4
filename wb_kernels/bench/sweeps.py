"""What the benchmark measures (the dashboard lesson): problems, sweeps over them, and the named presets.

A :class:`Config` is one problem (shapes, dtype, masking), a :class:`Sweep` is contenders x configs,
and :data:`PRESETS` names the sweeps ``--preset`` runs. Also here: the counts every record carries
(:func:`attention_flops`, :func:`minimum_bytes`, from :mod:`wb_kernels.attention_costs`), the key a record is stored under
(:func:`record_key`), the baselines' names, and :class:`Refused`. The decode presets' problems are
:class:`DecodeWorkload` (:data:`DECODE_PRESETS`; measured by :mod:`wb_kernels.bench.decode`). Plain data, no
torch, so that ``--help``, ``--list`` and the README table read it without touching a device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..attention_costs import ITEMSIZE, attention_flops, minimum_bytes

__all__ = ["Config", "Sweep", "PRESETS", "PRESET_HELP", "GPU_PRESETS", "ALL_PRESETS", "PUBLIC_CONFIGS",
           "LADDER_LENGTHS", "TOKENS", "BASELINES", "BASELINE_HELP", "attention_flops", "minimum_bytes", "record_key",
           "Refused", "RUNG_PRESETS", "DecodeWorkload", "DECODE_PRESETS", "DECODE_BAR", "DECODE_MQA_BAR",
           "DECODE_BAR_FRACTION", "DECODE_GOAL_FRACTION", "DECODE_LENGTHS", "DECODE_LAYOUTS",
           "DECODE_PAGE_SIZE", "decode_kv_bytes", "decode_record_key", "BACKWARD_PRESET_HELP"]

# The configurations other public attention-kernel projects report (B, H, L, D), so that numbers
# here can be set beside theirs: B*L = 16k tokens, 16 heads of 128, plus the small B=1 L=512 D=64.
PUBLIC_CONFIGS = ((1, 16, 512, 64), (32, 16, 512, 128), (16, 16, 1024, 128), (8, 16, 2048, 128),
                  (4, 16, 4096, 128), (2, 16, 8192, 128), (1, 16, 16384, 128))
LADDER_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
TOKENS = 16384  # B * L of the GPU sweeps


@dataclass(frozen=True)
class Config:
    """One problem: shapes, dtype and masking. Lq == Lk throughout the benchmark. ``Hk``: key/value heads, each shared
    by H // Hk query heads (grouped-query attention); None, the default, is H of them (multi-head attention)."""

    B: int
    H: int
    L: int
    D: int
    dtype: str
    causal: bool
    Hk: Optional[int] = None

    @property
    def kv_heads(self) -> int:
        return self.H if self.Hk is None else self.Hk

    @property
    def shape_key(self):
        """What the inputs depend on: (B, H, L, D), and Hk after them for grouped-query attention."""
        return (self.B, self.H, self.L, self.D) + (() if self.kv_heads == self.H else (self.kv_heads,))


@dataclass(frozen=True)
class Sweep:
    """Contenders x configurations; a preset is a list of sweeps."""

    name: str
    contenders: tuple  # stage names and baseline names; absent stages are dropped quietly
    configs: tuple  # of Config




def _tokens_configs(lengths, D, dtypes, causals, H=16, tokens=TOKENS, Hk=None):
    return tuple(Config(max(1, tokens // L), H, L, D, dtype, causal, Hk)
                 for dtype in dtypes for causal in causals for L in lengths)


def _preset_sweeps() -> dict:
    ladder_configs = tuple(c for D in (64, 128) for c in _tokens_configs(LADDER_LENGTHS, D, ("float32",), (False,)))
    tensor_configs = _tokens_configs(LADDER_LENGTHS, 128, ("float16", "bfloat16"), (False, True))
    flash_configs = tuple(c for D in (64, 128)
                          for c in _tokens_configs(LADDER_LENGTHS[1:], D, ("float32",), (False,)))
    public_configs = tuple(Config(B, H, L, D, dtype, causal) for dtype in ("float16",)
                           for causal in (False, True) for (B, H, L, D) in PUBLIC_CONFIGS)
    # The mma rung against what it replaces (wmma) and what a PyTorch user would pick instead (SDPA's
    # backends, FlexAttention), at both head dims the rung takes, plus the small public problem: kernels that
    # win at 16k tokens can lose at B=1 L=512, where launch cost and a few blocks per GPU dominate.
    small_public = tuple(Config(1, 16, 512, 64, "float16", causal) for causal in (False, True))
    mma_configs = tuple(c for D in (64, 128)
                        for c in _tokens_configs(LADDER_LENGTHS, D, ("float16", "bfloat16"), (False, True)))
    # The hopper rung's bar (issue 31): the mma preset's problems (fp16/bf16, D 64/128, L 512..16384 at 16k tokens,
    # causal and not) and grouped-query attention with 32 query heads on 8 key/value heads, timed against the rung
    # below it and the fastest kernels a PyTorch user has on Hopper: SDPA's FLASH (FlashAttention-2) and cuDNN
    # backends, and FlashInfer's FA3 (FlashAttention-3's Hopper kernels) where installed.
    gqa_configs = _tokens_configs((4096,), 128, ("float16", "bfloat16"), (False, True), H=32, Hk=8)
    every_baseline = ("sdpa", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "sdpa-math", "torch-eager", "flex",
                      "flash_attn", "vllm", "flashinfer-fa2", "flashinfer-fa3")
    return {
        "smoke": [Sweep("smoke", ("reference", "naive", "tiled", "flash", "sdpa", "sdpa-math", "torch-eager"),
                        (Config(1, 1, 32, 16, "float32", False), Config(1, 1, 33, 16, "float32", True)))],
        "ladder": [Sweep("ladder", ("naive", "tiled", "sdpa", "sdpa-math"), ladder_configs)],
        "flash-fp32": [Sweep("flash-fp32", ("flash", "sdpa", "sdpa-efficient", "sdpa-math"), flash_configs)],
        "tensor-cores": [Sweep("tensor-cores", ("wmma", "sdpa", "sdpa-flash", "sdpa-cudnn", "flash_attn"),
                               tensor_configs)],
        "public": [Sweep("public", ("mma", "wmma", "flash", "tiled", "naive") + every_baseline, public_configs)],
        "mma": [Sweep("mma", ("wmma", "mma", "sdpa-flash", "sdpa-cudnn", "sdpa", "flex", "flashinfer-fa2",
                              "flashinfer-fa3"),
                      mma_configs + small_public)],
        # ("hopper" is the stage as users call it, its default version; hopper-v2 to -v4 the later versions)
        "hopper-bar": [Sweep("hopper-bar", ("hopper", "hopper-v2", "hopper-v3", "hopper-v4", "mma", "sdpa-flash",
                                            "sdpa-cudnn", "flashinfer-fa3"), mma_configs + gqa_configs)],
    }


PRESETS = _preset_sweeps()
PRESET_HELP = {
    "smoke": "B=1 H=1 L=32/33 D=16 fp32: every stage that runs on the simulator (the CPU preset)",
    "ladder": "naive, tiled vs SDPA default/MATH: fp32, D=64/128, L=512..16384, B*L=16k, H=16",
    "flash-fp32": "flash vs SDPA (fp32 -> EFFICIENT) and MATH: fp32, D=64/128, L=1024..16384, B*L=16k",
    "tensor-cores": "wmma vs SDPA default/FLASH/cuDNN, flash_attn: fp16/bf16, D=128, L=512..16384, "
                    "causal and not",
    "public": "every stage and baseline at the configurations other projects report (fp16)",
    "mma": "mma vs wmma, SDPA default/FLASH/cuDNN, FlexAttention, FlashInfer fa2/fa3 (where installed): fp16/bf16, "
           "D=64/128, L=512..16384, B*L=16k, H=16, causal and not; and B=1 H=16 L=512 D=64 fp16",
    "hopper-bar": "the hopper rung's bar (issue 31): hopper (and its versions v2, v3, v4) vs mma, SDPA FLASH/cuDNN "
                  "and FlashInfer fa3 (where installed): fp16/bf16, D=64/128, L=512..16384, B*L=16k, H=16, causal and not; GQA H=32 Hk=8 "
                  "B=4 L=4096 D=128. Own file: results/hopper/bench_<gpu>.json, with TFLOP/s and the ratios to cuDNN "
                  "printed (about 4 min on an H100)",
    "honesty": "the honest-benchmarking demonstrations of the dashboard lesson (GPU only)",
    "all": "public + ladder + flash-fp32 + tensor-cores + mma + honesty (the committed GPU run)",
    "decode": "one new token per sequence against a KV cache: wb.decode and its kernel alone vs SDPA's backends "
              "(enable_gqa), FlexAttention and a copy of the same bytes; H=32, Hk=32/8/1, B=1/8/64, Lk=1k..128k, "
              "fp16 D=128, contiguous and paged (page 16); bf16 and D=64 at Hk=8; per-call overhead. Own file: "
              "results/decode/bench_<gpu>.json (about 5 min on an H100: --time-budget 480)",
    "decode-bar": "the decode preset's bar shapes and their Lk sweeps (fp16 D=128 H=32 Hk=8, B=1 and 8), the MQA "
                  "rows (Hk=1: B=8 Lk=8192, B=1 Lk=2048) and the per-call overhead (about 2.5 min on an H100, most of it FlexAttention's compilations; same file "
                  "as decode)",
    "decode-smoke": "the decode preset at tiny sizes (B<=2, H=4, Lk=32, D=16; fp32, fp16, bf16): what runs on the "
                    "simulator",
}
# The gradients' presets (wb_kernels/bench/backward.py), each into a file of its own like the decode ones; the
# command line offers them beside PRESET_HELP's.
BACKWARD_PRESET_HELP = {
    "backward": "the gradients, fwd+bwd and bwd alone: mma (wb.attention + autograd, and its bare backward) vs SDPA "
                "default/FLASH/cuDNN/EFFICIENT backward, FlexAttention (fp16); fp16/bf16, D=64/128, L=1k/4k/16k, B*L=16k, "
                "H=16, causal and not; GQA H=32 Hk=8; and the numba flash backward vs SDPA EFFICIENT in fp32 "
                "(B*L=4k). Own file: results/backward/bench_<gpu>.json (wb_kernels/bench/backward.py)",
    "backward-bar": "the backward preset's bar problems only (fp16 B4 H16 L4096 D=64/128 causal and not, GQA H=32 "
                    "Hk=8 D=128; the numba flash backward at L=1024 fp32): a few minutes on an H100, same file",
    "backward-smoke": "the backward preset at a tiny size (B=1 H=2 Hk=1 L=33 D=16 fp32, causal): what runs on the "
                      "simulator (a few minutes: the flash rows' calls take seconds each)",
}
GPU_PRESETS = ("ladder", "flash-fp32", "tensor-cores", "public", "mma", "hopper-bar", "honesty", "all", "decode",
               "decode-bar", "backward", "backward-bar")
# A rung's own presets: {preset: rung}. Each writes results/<rung>/bench_<gpu>.json (its lesson reads it by name) and
# draws no figures, so that neither the ladder's newest results/bench/ file nor its figures come from a rung's run.
RUNG_PRESETS = {"hopper-bar": "hopper"}
# What --preset all runs. A configuration that several presets share is measured once (measure.plan). The decode
# presets are not in it: they measure other problems, into a file of their own.
ALL_PRESETS = ("public", "ladder", "flash-fp32", "tensor-cores", "mma", "honesty")


# A record's identity in the results file: a resumed run skips the keys already there.
def record_key(contender: str, config: Config) -> str:
    kv_heads = "" if config.kv_heads == config.H else f"Hk{config.kv_heads}|"
    return (f"{contender}|{config.dtype}|B{config.B}|H{config.H}|{kv_heads}L{config.L}|D{config.D}|"
            f"{'causal' if config.causal else 'full'}")


# The baselines by name; what each one runs is measure.py's. Presets and --baselines name them,
# --list describes them and the README table orders its columns by them.
BASELINE_HELP = {
    "sdpa": "scaled_dot_product_attention, PyTorch's own choice of kernel",
    "sdpa-flash": "SDPA forced to FLASH_ATTENTION (FlashAttention-2 inside PyTorch)",
    "sdpa-efficient": "SDPA forced to EFFICIENT_ATTENTION (memory-efficient, xformers' kernel)",
    "sdpa-cudnn": "SDPA forced to CUDNN_ATTENTION",
    "sdpa-math": "SDPA forced to MATH (plain PyTorch ops, materializes L x L)",
    "torch-eager": "softmax(q k^T / sqrt(D)) v written as PyTorch ops, softmax in float32",
    "flex": "FlexAttention (torch.nn.attention.flex_attention) compiled by torch.compile into a Triton kernel, "
            "causal through a block mask; needs a CUDA GPU and triton",
    "flash_attn": "flash_attn.flash_attn_func, when the flash-attn package is installed",
    "vllm": "vLLM's flash_attn_varlen_func, when vllm is installed",
    "flashinfer-fa2": "FlashInfer's batched ragged prefill (BatchPrefillWithRaggedKVCacheWrapper), backend fa2, planned "
                      "once outside the timing; when flashinfer is installed (pip install .[contenders]) on a GPU",
    "flashinfer-fa3": "the same with backend fa3 (FlashAttention-3's Hopper kernels); sm_90 only",
}
BASELINES = tuple(BASELINE_HELP)


# ----------------------------------------------------------------------------------------------
# Decode: one new query per sequence against a KV cache (the decode rung, wb.decode)
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DecodeWorkload:
    """One decode problem: B sequences of Lk cached keys each (all full), H query heads reading Hk KV heads
    (GQA: H // Hk query heads share one), one new query per sequence and head. ``flex``: FlexAttention is timed
    here too (it compiles one kernel per shape, seconds each, so only for the shapes the figure draws)."""

    B: int
    H: int
    Hk: int
    Lk: int
    D: int
    dtype: str
    flex: bool = False

    @property
    def key(self) -> str:
        return f"{self.dtype}|B{self.B}|H{self.H}|Hk{self.Hk}|Lk{self.Lk}|D{self.D}"

    @property
    def kv_bytes(self) -> float:
        return decode_kv_bytes(self.B, self.Hk, self.Lk, self.D, ITEMSIZE[self.dtype])

    @property
    def family(self) -> tuple:
        """What a line of the figure shares: everything but Lk."""
        return (self.dtype, self.D, self.H, self.Hk, self.B)


def decode_kv_bytes(B: int, Hk: int, Lk: int, D: int, itemsize: int) -> float:
    """The bytes a decode step cannot avoid reading, K and V once: 2 * B * Hk * Lk * D * itemsize. (q and the
    output are B * H * D each: under 0.1% of it from Lk = 1024 on.)"""
    return 2.0 * B * Hk * Lk * D * itemsize


def decode_record_key(contender: str, layout: str, workload: DecodeWorkload) -> str:
    return f"{contender}|{layout}|{workload.key}"


DECODE_LAYOUTS = ("contiguous", "paged")  # the cache as (B, Hk, L, D), or pages of DECODE_PAGE_SIZE keys
DECODE_PAGE_SIZE = 16  # vLLM's default block size
DECODE_LENGTHS = (1024, 4096, 8192, 32768, 131072)
# The bar, (B, H, Hk, Lk, D, dtype): a batch of 8 at 8k keys and one long sequence of 32k, GQA with 4 query
# heads per KV head, as Llama-3-8B's attention layers have (32 query heads, 8 KV heads, D = 128).
DECODE_BAR = ((8, 32, 8, 8192, 128, "float16"), (1, 32, 8, 32768, 128, "float16"))
# Issue #30's MQA rows (Hk = 1, 32 query heads on one KV head, the rung's tensor-core kernel): timed with the bar
# shapes, against SDPA's fastest in the same run (bar: >= 80 % of copy and >= 1.0x SDPA)
DECODE_MQA_BAR = ((8, 32, 1, 8192, 128, "float16"), (1, 32, 1, 2048, 128, "float16"))
DECODE_BAR_FRACTION = 0.70  # the decode rung's bar: wb.decode at this fraction of the copy ceiling at DECODE_BAR
DECODE_GOAL_FRACTION = 0.85  # its goal (with: faster than every SDPA backend in the same run)


def _decode_presets() -> dict:
    figure = {(B, Hk, D, dtype) for B, _, Hk, _, D, dtype in DECODE_BAR}  # the bar shapes' Lk sweeps

    def workload(B, Hk, Lk, D, dtype):
        return DecodeWorkload(B, 32, Hk, Lk, D, dtype, flex=(B, Hk, D, dtype) in figure)

    grid = [workload(B, Hk, Lk, 128, "float16") for Hk in (32, 8, 1) for B in (1, 8, 64) for Lk in DECODE_LENGTHS]
    other = [workload(B, 8, Lk, D, dtype) for D, dtype in ((128, "bfloat16"), (64, "float16"))
             for B in (1, 8, 64) for Lk in DECODE_LENGTHS]
    mqa = [workload(B, Hk, Lk, D, dtype) for B, _, Hk, Lk, D, dtype in DECODE_MQA_BAR]
    grid += [w for w in mqa if w not in grid]  # B1 Lk2048 is off the grid's lengths
    smoke = [DecodeWorkload(2, 4, 2, 32, 16, "float32", flex=True), DecodeWorkload(1, 4, 1, 32, 16, "float16"),
             DecodeWorkload(1, 4, 4, 32, 16, "bfloat16")]
    return {"decode": tuple(grid + other),
            "decode-bar": tuple(w for w in grid if w.flex) + tuple(mqa),
            "decode-smoke": tuple(smoke)}


DECODE_PRESETS = _decode_presets()


# Here, below every other module, because the README update, the sweep and the CLI all raise it.
class Refused(Exception):
    """The request cannot run on this machine (printed as a clear message, exit code 2)."""
