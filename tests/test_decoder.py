"""Lesson 07 (decode): the end-to-end decoder, its KV caches (contiguous and paged), the attention it plugs
in, and the roofline of a decode step. All on the CPU, with the TINY model; LLAMA_1B is only counted.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from wb_kernels.models import llama_decoder as dec


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # TINY's matrices are a few KiB: a thread pool costs more than it saves, and far more on a busy machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def random_prompt(batch, length, vocab=dec.TINY.vocab_size, seed=1):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def recording(attend):
    """`attend`, keeping a copy of every output it returns (in call order) in its `.outputs`."""
    def recorded(*args, **kwargs):
        out = attend(*args, **kwargs)
        recorded.outputs.append(out.clone())
        return out

    recorded.outputs = []
    return recorded


def newest_key_only(q, k_cache, v_cache, cache_seqlens, block_table=None, **host_hints):
    """A wrong decode attention: attends the new token's own key, nothing before it."""
    start = cache_seqlens - 1
    if block_table is not None:
        k_cache = dec.gather_pages(k_cache, block_table, k_cache.shape[2] * block_table.shape[1])
        v_cache = dec.gather_pages(v_cache, block_table, v_cache.shape[2] * block_table.shape[1])
    batch = torch.arange(q.shape[0])
    return dec.sdpa_attend(q, k_cache[batch, :, start.long()][:, :, None], v_cache[batch, :, start.long()][:, :, None],
                           torch.ones_like(cache_seqlens))


# ---- the configuration ------------------------------------------------------------------------------------

def test_llama_1b_parameter_count_is_llama_3_2_1b():
    # Counted from the shape alone; nothing is allocated.
    assert 1.0e9 <= dec.LLAMA_1B.params() <= 1.4e9
    assert dec.LLAMA_1B.params() == 1_235_814_400  # Llama 3.2 1B's published count
    assert dec.LLAMA_1B_D128.params() == dec.LLAMA_1B.params()
    assert dec.LLAMA_1B.kv_bytes_per_token(2) == dec.LLAMA_1B_D128.kv_bytes_per_token(2) == 32 * 1024


@pytest.mark.parametrize("tied", [False, True])
def test_params_counts_the_weights_the_model_holds(tied):
    config = dataclasses.replace(dec.TINY, tie_embeddings=tied)
    model = dec.Decoder(config)
    tensors = [model.embedding, model.final_norm] + ([] if tied else [model.lm_head])
    tensors += [t for layer in model.layers for t in vars(layer).values()]
    assert sum(t.numel() for t in tensors) == config.params()
    assert (model.lm_head is model.embedding) == tied


@pytest.mark.parametrize("change, message", [
    (dict(n_heads=6, n_kv_heads=4), "not a multiple of n_kv_heads"),
    (dict(head_dim=15), "must be even"),
    (dict(n_layers=0), "n_layers"),
    (dict(dim=64.0), "dim"),
    (dict(rope_theta=0.0), "rope_theta"),
])
def test_config_refuses_bad_shapes(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(dec.TINY, **change)


# ---- generation: the attention under test against float64 -------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("batch", [1, 3])
def test_sdpa_generates_the_float64_tokens(dtype, batch):
    model = dec.Decoder(dec.TINY, dtype=dtype, seed=0)
    prompt = random_prompt(batch, 10)
    tokens = model.generate(prompt, 32, dec.sdpa_attend)
    assert tokens.shape == (batch, 42) and torch.equal(tokens[:, :10], prompt)
    assert torch.equal(tokens, model.generate(prompt, 32, dec.float64_attend))


def test_a_wrong_attention_generates_other_tokens():
    # The token comparisons above could pass whatever attention returned if the model ignored it.
    model = dec.Decoder(dec.TINY, seed=0)
    prompt = random_prompt(3, 10)
    right = model.generate(prompt, 32, dec.sdpa_attend)
    wrong = model.generate(prompt, 32, newest_key_only)
    assert not torch.equal(right, wrong)


@pytest.mark.parametrize("attend", [dec.sdpa_attend, dec.float64_attend])
@pytest.mark.parametrize("page_size", [16, 5])
def test_paged_and_contiguous_caches_give_the_same_attention(attend, page_size):
    model = dec.Decoder(dec.TINY, seed=0)
    prompt = random_prompt(3, 10)
    contiguous, paged = recording(attend), recording(attend)
    tokens = model.generate(prompt, 24, contiguous)
    assert torch.equal(tokens, model.generate(prompt, 24, paged, paged=True, page_size=page_size))
    assert len(paged.outputs) == len(contiguous.outputs) == 23 * dec.TINY.n_layers
    for a, b in zip(contiguous.outputs, paged.outputs):
        assert torch.equal(a, b)


def prefilled_paged_cache(model, batch=3, length=37, page_size=8):
    cache = model.new_cache(batch, 48, paged=True, page_size=page_size)
    model.prefill(random_prompt(batch, length), cache)
    return cache


def test_pages_are_handed_out_shuffled():
    cache = prefilled_paged_cache(dec.Decoder(dec.TINY))
    table = cache.block_table
    assert table.dtype == torch.int32 and table.shape == (3, 6)
    assert sorted(table.flatten().tolist()) == list(range(18))  # every page used once ...
    assert not torch.equal(table.flatten(), torch.arange(18, dtype=torch.int32))  # ... but not in order


@pytest.mark.parametrize("attend", [dec.sdpa_attend, dec.float64_attend])
def test_a_broken_block_table_changes_the_output(attend):
    model = dec.Decoder(dec.TINY)
    cache = prefilled_paged_cache(model)
    q = torch.randn(3, dec.TINY.n_heads, dec.TINY.head_dim, generator=torch.Generator().manual_seed(2))
    k, v, lengths, table = cache.keys[0], cache.values[0], cache.cache_seqlens, cache.block_table
    right = attend(q, k, v, lengths, table)
    in_pool_order = torch.arange(table.numel(), dtype=torch.int32).view_as(table)  # a kernel that ignores the table
    rows_swapped = table[[1, 0, 2]]
    used_and_empty_swapped = table[:, [5, 1, 2, 3, 4, 0]]  # 37 keys fill pages 0-4 of 8 slots; page 5 holds none
    for broken in (in_pool_order, rows_swapped, used_and_empty_swapped):
        wrong = attend(q, k, v, lengths, broken)
        assert not torch.allclose(right, wrong, atol=1e-3)
    # Two full pages of one sequence swapped: the same keys in another order, which attention cannot tell
    # (each key carries its position in its RoPE rotation, not in its slot).
    torch.testing.assert_close(attend(q, k, v, lengths, table[:, [1, 0, 2, 3, 4, 5]]), right)


def test_attend_functions_agree_on_ragged_random_caches():
    generator = torch.Generator().manual_seed(3)
    batch, n_heads, kv_heads, capacity, head_dim = 4, 8, 2, 40, 16
    q = torch.randn(batch, n_heads, head_dim, generator=generator, dtype=torch.float64)
    k = torch.randn(batch, kv_heads, capacity, head_dim, generator=generator, dtype=torch.float64)
    v = torch.randn(batch, kv_heads, capacity, head_dim, generator=generator, dtype=torch.float64)
    lengths = torch.tensor([1, 40, 17, 33], dtype=torch.int32)
    expected = dec.float64_attend(q, k, v, lengths)
    torch.testing.assert_close(dec.sdpa_attend(q, k, v, lengths), expected, rtol=1e-12, atol=1e-12)
    # One key only: the output is that key's value, for every query head of its group.
    torch.testing.assert_close(expected[0], v[0, :, 0].repeat_interleave(n_heads // kv_heads, dim=0))
    # The keys beyond a sequence's length must not count, whatever they hold.
    k_garbage, v_garbage = k.clone(), v.clone()
    k_garbage[2, :, 17:], v_garbage[2, :, 17:] = 1e3, -1e3
    for attend in (dec.sdpa_attend, dec.float64_attend):
        torch.testing.assert_close(attend(q, k_garbage, v_garbage, lengths), expected, rtol=1e-12, atol=1e-12)


def test_ragged_prompts_decode_as_if_each_ran_alone():
    model = dec.Decoder(dec.TINY, dtype=torch.float64, seed=0)
    prompt_lens = [5, 12, 1]
    prompts = random_prompt(3, 12)
    steps = 6
    logits = {}
    for paged in (False, True):
        cache = model.new_cache(3, 12 + steps, paged=paged, page_size=4)
        token = model.prefill(prompts, cache, prompt_lens=prompt_lens).argmax(-1)
        for _ in range(steps):
            step_logits = model.decode_step(token, cache, dec.sdpa_attend)
            token = step_logits.argmax(-1)
        assert cache.cache_seqlens.tolist() == [n + steps for n in prompt_lens]
        logits[paged] = step_logits
    assert torch.equal(logits[False], logits[True])
    for b, n in enumerate(prompt_lens):
        alone = model.new_cache(1, n + steps)
        token = model.prefill(prompts[b:b + 1, :n], alone).argmax(-1)
        for _ in range(steps):
            alone_logits = model.decode_step(token, alone, dec.float64_attend)
            token = alone_logits.argmax(-1)
        torch.testing.assert_close(logits[False][b], alone_logits[0], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_stays_finite_for_hundreds_of_steps(dtype):
    model = dec.Decoder(dataclasses.replace(dec.TINY, n_layers=4), dtype=dtype, seed=0)
    cache = model.new_cache(2, 260)
    logits = model.prefill(random_prompt(2, 8), cache)
    for _ in range(250):
        logits = model.decode_step(logits.argmax(-1), cache, dec.sdpa_attend)
        assert torch.isfinite(logits).all()


# ---- timing and the roofline --------------------------------------------------------------------------------

@pytest.mark.parametrize("paged", [False, True])
def test_time_decode_reports_consistent_numbers(paged):
    model = dec.Decoder(dec.TINY)
    result = dec.time_decode(model, batch=2, prompt_len=8, new_tokens=5, attend=dec.sdpa_attend, paged=paged, warmup=2)
    assert result["device"] == "cpu" and result["paged"] == paged
    assert result["tokens_per_s"] == pytest.approx(2 * 1e3 / result["ms_per_step"])
    assert 0 < result["attention_ms_per_step"] < result["ms_per_step"]
    assert 0 < result["attention_share"] < 1


def test_roofline_of_a_hand_countable_model():
    config = dec.DecoderConfig(vocab_size=10, dim=4, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=2, ffn_dim=8)
    # embedding 10*4 = 40; q 4*4 + k 4*2 + v 4*2 + o 4*4 = 48; gate, up, down 3*4*8 = 96; norms 4 + 4 + 4
    assert config.params() == 40 + 48 + 96 + 12 == 196
    r = dec.decode_step_roofline(config, batch=2, context_len=3, dtype_bytes=2, bandwidth_bytes_per_s=440.0)
    assert r["weight_bytes"] == 196 * 2
    assert r["kv_cache_bytes"] == 2 * 1 * 2 * 3 * 1 * 2 * 2  # K and V, layers, sequences, keys, KV heads, D, bytes
    assert r["bytes_per_step"] == 440 and r["kv_share"] == pytest.approx(48 / 440)
    # matrix multiplies: 2 FLOPs x (48 + 96 + 40 LM head) x 2 tokens; q.K and p.V: 4 x H x D x keys x layers x B
    assert r["flops_per_step"] == 2 * 184 * 2 + 4 * 2 * 2 * 3 * 1 * 2 == 832
    assert r["arithmetic_intensity"] == pytest.approx(832 / 440)
    assert r["step_time_s"] == pytest.approx(1.0) and r["tokens_per_s"] == pytest.approx(2.0)
    compute_bound = dec.decode_step_roofline(config, batch=2, context_len=3, dtype_bytes=2, bandwidth_bytes_per_s=440.0,
                                             peak_flops_per_s=416.0)
    assert compute_bound["step_time_s"] == pytest.approx(2.0)
    untied = dec.decode_step_roofline(dataclasses.replace(config, tie_embeddings=False), batch=2, context_len=3,
                                      dtype_bytes=2, bandwidth_bytes_per_s=440.0)
    assert untied["weight_bytes"] == 196 * 2  # the LM head is read; the embedding table only for B rows
    assert untied["flops_per_step"] == 832


def test_decode_is_weight_bound_at_batch_1_and_cache_bound_at_large_batch():
    def kv_share(batch):
        return dec.decode_step_roofline(dec.LLAMA_1B, batch=batch, context_len=8192, dtype_bytes=2,
                                        bandwidth_bytes_per_s=3.35e12)["kv_share"]

    assert kv_share(1) < 0.15 < 0.8 < kv_share(64)


def test_draw_decode_roofline(tmp_path, monkeypatch):
    from wb_kernels.plots import save

    model = dec.Decoder(dec.TINY)
    measured = dec.time_decode(model, batch=2, prompt_len=4, new_tokens=2, attend=dec.sdpa_attend, warmup=0)
    fig = dec.draw_decode_roofline(dec.LLAMA_1B, dtype_bytes=2, bandwidth_bytes_per_s=3.35e12,
                                   context_lens=(512, 8192), measured=[measured])
    speed_ax, share_ax = fig.axes
    assert len(speed_ax.lines) == 3 and len(share_ax.lines) == 2
    monkeypatch.setenv("WB_FIGURES_DIR", str(tmp_path))
    assert save(fig, "decode_roofline").stat().st_size > 0


# ---- bad input ----------------------------------------------------------------------------------------------

def test_bad_input_gets_clear_errors():
    model = dec.Decoder(dec.TINY)
    prompt = random_prompt(2, 8)
    with pytest.raises(ValueError, match="exceeds max_seq_len=512"):
        model.generate(random_prompt(1, 513), 1, dec.sdpa_attend)
    with pytest.raises(ValueError, match="exceeds max_seq_len=512"):
        model.generate(prompt, 505, dec.sdpa_attend)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 256\)"):
        model.generate(prompt + 250, 2, dec.sdpa_attend)
    with pytest.raises(TypeError, match="integer torch tensor"):
        model.generate(prompt.float(), 2, dec.sdpa_attend)
    with pytest.raises(ValueError, match="2 dimensions"):
        model.generate(prompt[0], 2, dec.sdpa_attend)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(prompt, -1, dec.sdpa_attend)
    with pytest.raises(ValueError, match=r"attend returned \(2, 4, 8\)"):
        model.generate(prompt, 3, lambda q, *rest, **hints: q[..., :8])
    with pytest.raises(ValueError, match="page_size"):
        model.new_cache(2, 16, paged=True, page_size=0)
    with pytest.raises(ValueError, match="capacity=600"):
        model.new_cache(2, 600)
    cache = model.new_cache(2, 9)
    with pytest.raises(ValueError, match="prompt_lens"):
        model.prefill(prompt, cache, prompt_lens=[3, 9])
    token = model.prefill(prompt, cache).argmax(-1)
    token = model.decode_step(token, cache, dec.sdpa_attend).argmax(-1)
    with pytest.raises(ValueError, match="the cache is full"):
        model.decode_step(token, cache, dec.sdpa_attend)
    with pytest.raises(ValueError, match="batch"):
        dec.time_decode(model, batch=0, prompt_len=4, new_tokens=2, attend=dec.sdpa_attend)


def test_the_series_kernel_generates_the_same_tokens_as_sdpa():
    """wb.decode (the numba split-KV kernel here, on the simulator) in the decoder: the same greedy tokens."""
    model = dec.Decoder(dec.TINY, dtype=torch.float32, seed=4)
    prompt = torch.randint(0, dec.TINY.vocab_size, (2, 5), generator=torch.Generator().manual_seed(4))
    expected = model.generate(prompt, 4, dec.sdpa_attend)
    assert torch.equal(model.generate(prompt, 4, dec.wb_attend), expected)
    assert torch.equal(model.generate(prompt, 4, dec.wb_attend, paged=True, page_size=4), expected)
