"""A tiny character-level GPT trained through ``wb.attention`` and its backward, beside the same model on SDPA
(lesson 08_backward; issue #29, "train something real but small with it").

The model is a GPT-2-shaped decoder (Radford et al., 2019): token and learned position embeddings, ``n_layers``
pre-norm blocks of causal self-attention and a GELU MLP, a final LayerNorm and a head tied to the token embedding.
Its attention is the only thing that changes between runs: ``stage="sdpa"`` calls PyTorch's
``scaled_dot_product_attention`` (the baseline), any other name calls ``wb.attention(q, k, v, stage=name,
causal=True)``, whose gradient is that stage's registered backward (``wb_kernels.stages.available_backwards()``).
Grouped-query attention is a config field (``n_kv_heads``), so the backward's GQA sums are trained through too.

The text is the one every Python installation carries: the standard library's ``pydoc_data.topics.topics`` (the
help pages of the language's keywords and statements), joined in sorted key order. No download, no network.

What makes two runs comparable: the same seed gives the same initial weights (drawn on the CPU, then moved) and the
same batches in the same order (a CPU generator of its own, not the global one); only the attention differs. On the
CPU in float32 the two loss curves agree to about 1e-5; on a GPU in bf16 they drift apart by rounding, and stay close.

    python -m wb_kernels.models.char_transformer --tiny --stage reference        # CPU, a few seconds
    python -m wb_kernels.models.char_transformer --stage mma --steps 300 \\
        --json results/train/char_transformer_h100.json --figure               # GPU: both curves into one file

Configurations: :data:`CPU_TINY` (2 layers, d_model 32, 2 heads, context 32, batch 8, 30 steps, float32) and
:data:`GPU_SMALL` (4 layers, d_model 512, 8 heads of D = 64, context 256, batch 32, 300 steps, bf16 autocast).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ModelConfig", "TrainConfig", "CPU_TINY", "GPU_SMALL", "corpus_text", "CharVocab", "CharTransformer",
           "attention_for", "batches", "train", "compare", "loss_figure", "main"]

SDPA = "sdpa"  # the baseline's name: PyTorch's scaled_dot_product_attention


@dataclass(frozen=True)
class ModelConfig:
    """The model's shape; every field is a count."""

    d_model: int = 32  # width of the residual stream
    n_layers: int = 2
    n_heads: int = 2  # query heads; head_dim = d_model // n_heads
    n_kv_heads: Optional[int] = None  # key/value heads (GQA); None: n_heads
    context: int = 32  # tokens per training sequence (the attention's L)
    mlp_ratio: int = 4  # the MLP's hidden width over d_model

    def __post_init__(self):
        for name in ("d_model", "n_layers", "n_heads", "context", "mlp_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name}: expected a positive int, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"ModelConfig: d_model={self.d_model} is not a multiple of n_heads={self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"ModelConfig: n_heads={self.n_heads} is not a multiple of n_kv_heads={self.kv_heads} "
                             "(each key/value head serves the same number of query heads)")

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass(frozen=True)
class TrainConfig:
    """How to train: steps, batch, optimiser, precision."""

    model: ModelConfig = ModelConfig()
    steps: int = 30
    batch: int = 8
    lr: float = 3e-3
    warmup: int = 5  # steps of linear learning-rate warm-up, then constant
    weight_decay: float = 0.0
    # the precision the attention sees: "float32" (no autocast), or "bfloat16"/"float16" autocast over float32
    # weights (the tensor-core stages take 16-bit inputs only); float16 adds a gradient scaler
    dtype: str = "float32"
    eval_batches: int = 4  # held-out batches for the final loss

    def __post_init__(self):
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"TrainConfig.dtype: 'float32', 'bfloat16' or 'float16', got {self.dtype!r}")
        if self.steps < 1 or self.batch < 1:
            raise ValueError(f"TrainConfig: steps={self.steps} and batch={self.batch} must be >= 1")


# The lesson's checked cells: seconds on two CPU cores with stage="reference".
CPU_TINY = TrainConfig(ModelConfig(d_model=32, n_layers=2, n_heads=2, context=32), steps=30, batch=8, lr=3e-3)
# The H100 run: head dim 64 (a size the mma stage takes), bf16 autocast.
GPU_SMALL = TrainConfig(ModelConfig(d_model=512, n_layers=4, n_heads=8, context=256), steps=300, batch=32, lr=1e-3,
                        warmup=30, weight_decay=0.1, dtype="bfloat16")


# ----------------------------------------------------------------------------------------------
# The text
# ----------------------------------------------------------------------------------------------

def corpus_text() -> str:
    """The standard library's help topics, joined in sorted key order (the same text on every machine with the
    same Python minor version; the JSON records its length and vocabulary)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


class CharVocab:
    """Characters <-> ids, in sorted order of the characters the text holds."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        unknown = sorted(set(text) - set(self.index))
        if unknown:
            raise ValueError(f"characters outside the vocabulary: {unknown[:10]}")
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


def batches(data: torch.Tensor, *, batch: int, context: int, steps: int, seed: int):
    """`steps` batches (inputs, targets), each (batch, context) int64: windows of `data` at offsets drawn by a CPU
    generator seeded with `seed` (so the order is the same for every stage, device and run); targets are the
    inputs shifted by one character."""
    if data.numel() <= context + 1:
        raise ValueError(f"the text ({data.numel()} characters) is shorter than context + 1 = {context + 1}")
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, data.numel() - context - 1, (batch,), generator=generator)
        window = torch.stack([data[s:s + context + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------

def attention_for(stage: str) -> Callable:
    """``attend(q, k, v) -> out``, causal, q (B, H, L, D), k and v (B, Hk, L, D): SDPA for "sdpa", else
    ``wb.attention`` with that stage. A stage that does not exist or has no backward is refused here, with the
    names of those that have one, before any weight is drawn."""
    if stage == SDPA:
        def attend(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])

        return attend
    from ..api import attention
    from ..stages import get_backward

    get_backward(stage)

    def attend(q, k, v):
        # check_finite=False: a NaN would show in the loss at once; the pass costs a host sync per call
        return attention(q, k, v, stage=stage, causal=True, check_finite=False)

    return attend


class Block(nn.Module):
    """Pre-norm: x + attention(LayerNorm(x)), then x + MLP(LayerNorm(x))."""

    def __init__(self, config: ModelConfig, attend: Callable):
        super().__init__()
        self.config, self.attend = config, attend
        D, H, Hk = config.head_dim, config.n_heads, config.kv_heads
        self.norm1, self.norm2 = nn.LayerNorm(config.d_model), nn.LayerNorm(config.d_model)
        self.qkv = nn.Linear(config.d_model, (H + 2 * Hk) * D)
        self.proj = nn.Linear(H * D, config.d_model)
        hidden = config.mlp_ratio * config.d_model
        self.mlp = nn.Sequential(nn.Linear(config.d_model, hidden), nn.GELU(), nn.Linear(hidden, config.d_model))

    def forward(self, x):  # x (B, L, d_model)
        B, L, _ = x.shape
        D, H, Hk = self.config.head_dim, self.config.n_heads, self.config.kv_heads
        q, k, v = self.qkv(self.norm1(x)).split([H * D, Hk * D, Hk * D], dim=-1)
        # (B, L, heads, D) -> (B, heads, L, D), contiguous: the layout every stage reads (and copies to otherwise)
        q, k, v = (t.view(B, L, -1, D).transpose(1, 2).contiguous() for t in (q, k, v))
        out = self.attend(q, k, v)  # (B, H, L, D)
        x = x + self.proj(out.transpose(1, 2).reshape(B, L, H * D))
        return x + self.mlp(self.norm2(x))


class CharTransformer(nn.Module):
    """Token ids (B, L) -> logits (B, L, vocab)."""

    def __init__(self, config: ModelConfig, vocab_size: int, attend: Callable):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(vocab_size, config.d_model)
        self.position = nn.Embedding(config.context, config.d_model)
        self.blocks = nn.ModuleList(Block(config, attend) for _ in range(config.n_layers))
        self.norm = nn.LayerNorm(config.d_model)
        for name, p in self.named_parameters():
            # GPT-2's initialisation: N(0, 0.02), residual projections scaled down by depth, biases zero
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * config.n_layers) if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, ids):
        L = ids.shape[1]
        if L > self.config.context:
            raise ValueError(f"sequence of {L} tokens is longer than the model's context {self.config.context}")
        x = self.embed(ids) + self.position(torch.arange(L, device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.embed.weight.T  # the head tied to the embedding


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------

def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _run(stage: str, config: TrainConfig, seed: int, device: str, progress: bool) -> dict:
    """Train one model; {"losses", "eval_loss", "seconds"} (seconds: the training loop's wall time, synchronised)."""
    attend = attention_for(stage)
    text = corpus_text()
    vocab = CharVocab(text)
    data = vocab.encode(text)
    split = int(0.9 * data.numel())  # the last tenth is held out for the final loss
    train_data, held_out = data[:split], data[split:]
    torch.manual_seed(seed)  # the weights are drawn on the CPU: the same for every device and stage
    model = CharTransformer(config.model, len(vocab), attend).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay,
                                  betas=(0.9, 0.95))
    warmup = max(1, config.warmup)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
    autocast = config.dtype != "float32"
    amp_dtype = getattr(torch, config.dtype)
    scaler = torch.amp.GradScaler(device.split(":")[0], enabled=config.dtype == "float16")

    def loss_of(inputs, targets):
        with torch.autocast(device.split(":")[0], dtype=amp_dtype, enabled=autocast):
            logits = model(inputs.to(device))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.to(device).flatten())

    from ..widgets import progress as show_progress

    steps = batches(train_data, batch=config.batch, context=config.model.context, steps=config.steps, seed=seed)
    losses = []
    _synchronize(device)
    started = time.perf_counter()
    for inputs, targets in show_progress(steps, description=f"train ({stage})", unit="steps", disable=not progress):
        loss = loss_of(inputs, targets)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        schedule.step()
        losses.append(loss.item())
    _synchronize(device)
    seconds = time.perf_counter() - started
    with torch.no_grad():
        held = batches(held_out, batch=config.batch, context=config.model.context, steps=config.eval_batches,
                       seed=seed + 1)
        eval_loss = sum(loss_of(i, t).item() for i, t in held) / config.eval_batches
    return {"losses": losses, "eval_loss": eval_loss, "seconds": seconds,
            "tokens_per_s": config.steps * config.batch * config.model.context / seconds}


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def train(stage: str, steps: Optional[int] = None, *, config: TrainConfig = CPU_TINY, seed: int = 0,
          device: Optional[str] = None, progress: bool = False) -> list:
    """Train the model of `config` (its step count unless `steps`) with `stage`'s attention ("sdpa": PyTorch's);
    return the training loss of every step. Same `seed`: same initial weights and the same batches in the same
    order, whatever the stage. `progress`: a progress bar (tqdm in a terminal)."""
    config = config if steps is None else replace(config, steps=steps)
    return _run(stage, config, seed, device or _default_device(), progress)["losses"]


def compare(stage: str, *, config: TrainConfig = CPU_TINY, seed: int = 0, device: Optional[str] = None,
            progress: bool = False) -> dict:
    """Train with `stage` and with SDPA from the same seed: {"runs": {stage: run, "sdpa": run}, "comparison": ...};
    each run holds its losses, held-out loss, seconds and tokens per second; the comparison the largest and the
    final (mean of the last tenth of the steps) difference of the two loss curves."""
    device = device or _default_device()
    runs = {name: _run(name, config, seed, device, progress) for name in (stage, SDPA)}
    a, b = runs[stage]["losses"], runs[SDPA]["losses"]
    tail = max(1, len(a) // 10)
    comparison = {"max_abs_diff": max(abs(x - y) for x, y in zip(a, b)),
                  "final_mean_diff": abs(sum(a[-tail:]) - sum(b[-tail:])) / tail,
                  "eval_loss_diff": abs(runs[stage]["eval_loss"] - runs[SDPA]["eval_loss"])}
    return {"runs": runs, "comparison": comparison}


def loss_figure(runs: dict, title: Optional[str] = None):
    """Both loss curves on one plot: `runs` is {name: {"losses": [...]}} or {name: [...]} (a matplotlib Figure)."""
    from ..plots import STAGE_COLORS, new_figure

    fig, ax = new_figure()
    for name, run in runs.items():
        losses = run["losses"] if isinstance(run, dict) else run
        ax.plot(range(1, len(losses) + 1), losses, label=name, color=STAGE_COLORS.get(name), lw=1.2,
                ls="--" if name == SDPA else "-")
    ax.set(xlabel="step", ylabel="training loss (nats per character)",
           title=title or "character-level transformer: " + " vs ".join(runs))
    ax.legend()
    return fig


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m wb_kernels.models.char_transformer",
                                     description="Train the tiny character-level transformer with a stage's "
                                                 "attention and with SDPA (same seed); print and save both loss "
                                                 "curves.")
    parser.add_argument("--stage", help="the stage to train with (default: mma on a GPU, reference without one)")
    parser.add_argument("--steps", type=int, help="training steps (default: the configuration's)")
    parser.add_argument("--tiny", action="store_true", help="the CPU configuration (default without a GPU)")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--kv-heads", type=int, help="key/value heads (GQA; default: as many as query heads)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="autocast dtype")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write both curves, the GPU, versions and date to this file")
    parser.add_argument("--figure", nargs="?", const=True, metavar="PNG",
                        help="draw both curves (default figures/train_<stage>_vs_sdpa.png)")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    on_gpu = torch.cuda.is_available()
    config = CPU_TINY if args.tiny or not on_gpu else GPU_SMALL
    stage = args.stage or ("mma" if on_gpu else "reference")
    changes = {k: v for k, v in (("steps", args.steps), ("batch", args.batch), ("dtype", args.dtype)) if v}
    config = replace(config, **changes)
    if args.kv_heads:
        config = replace(config, model=replace(config.model, n_kv_heads=args.kv_heads))
    try:
        result = compare(stage, config=config, seed=args.seed, device="cuda" if on_gpu else "cpu",
                         progress=not args.no_progress)
    except ValueError as refusal:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    for name, run in result["runs"].items():
        print(f"{name:10s} loss {run['losses'][0]:.4f} -> {run['losses'][-1]:.4f}, held-out {run['eval_loss']:.4f}, "
              f"{run['seconds']:.1f} s ({run['tokens_per_s']:.0f} tokens/s)")
    print("curves differ by at most {max_abs_diff:.2e}; final {final_mean_diff:.2e}".format(**result["comparison"]))
    if args.json:
        from ..results_files import REPO_ROOT, environment, recorded_arguments

        text = corpus_text()
        now = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        # paths as the repository shows them (no machine paths in a committed file)
        shown = recorded_arguments(argv if argv is not None else sys.argv[1:], REPO_ROOT, ("--json", "--figure"))
        record = {"schema": 1, "kind": "train", "date": now, "environment": environment(),
                  "command": f"python -m wb_kernels.models.char_transformer {shown}", "stage": stage, "seed": args.seed,
                  "config": asdict(config), "corpus": {"source": "pydoc_data.topics.topics", "characters": len(text),
                                                       "vocab": len(CharVocab(text)),
                                                       "python": sys.version.split()[0]}, **result}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.figure:
        from ..plots import save

        fig = loss_figure(result["runs"])
        if args.figure is True:
            path = save(fig, f"train_{stage}_vs_sdpa")
        else:
            Path(args.figure).parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(args.figure)
            path = args.figure
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
