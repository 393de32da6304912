"""The engine computes what the reference path computes: each fast path against its reference.

Tolerances: float32 within 1e-5 (fused kernels sum in another order); bfloat16 within one or
two bf16 ulps (2**-8 relative); dropout by its keep statistics; whole models by equal loss
curves over 50 updates with dropout 0.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attnkit
from attnkit import MultiHeadAttention, Transformer, attend, preset, soft_attention
from attnkit.engine import ByteDropout, SharedMemoryState, fast_attend, to_eager
from attnkit.engine.attention import BF16_SOFTMAX_CPU_MIN_KEYS, FUSED_BF16_CPU_MIN_KEYS, soft_attention_in_dtype
from attnkit.engine.decoding import shared_rows
from attnkit.engine.eager import EagerMultiHeadAttention
from attnkit.search import beam_search, greedy_search
from test_loss import assert_same_loss_and_gradients
from test_transformer import batch, small_model


def qkv(B: int, H: int, T_q: int, T_k: int, d: int, seed: int = 1, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T_q, d, generator=g)
    k, v = torch.randn(B, H, T_k, d, generator=g), torch.randn(B, H, T_k, d, generator=g)
    mask = torch.rand(B, 1, T_q, T_k, generator=g) > 0.3
    mask[0, 0, 1] = False  # a query with nothing to attend to
    return q.to(dtype), k.to(dtype), v.to(dtype), mask


@pytest.mark.parametrize("score", ["dot", "scaled_dot"])
@pytest.mark.parametrize("need_weights", [True, False])
def test_fast_attend_equals_attend_in_float32(score: str, need_weights: bool) -> None:
    q, k, v, mask = qkv(4, 2, 6, 9, 16)
    ref, ref_w = attend(q, k, v, mask, score=score, beta=0.7)
    fast, fast_w = fast_attend(q, k, v, mask, score=score, beta=0.7, need_weights=need_weights)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(fast[0, :, 1], torch.zeros_like(fast[0, :, 1]))  # empty row: zeros, not NaN
    if need_weights:
        torch.testing.assert_close(fast_w, ref_w, atol=1e-6, rtol=1e-5)
    else:
        assert fast_w is None


@pytest.mark.parametrize("T_k", [BF16_SOFTMAX_CPU_MIN_KEYS - 8, BF16_SOFTMAX_CPU_MIN_KEYS + 8,
                                 FUSED_BF16_CPU_MIN_KEYS + 8])
def test_fast_attend_equals_attend_in_bfloat16_on_every_path(T_k: int) -> None:
    """Below / above the float32-weights threshold, and above the fused-kernel threshold."""
    q, k, v, mask = qkv(2, 2, 5, T_k, 16, dtype=torch.bfloat16)
    ref, _ = attend(q, k, v, mask)
    fast, w = fast_attend(q, k, v, mask, need_weights=False)
    assert w is None and fast.dtype == torch.bfloat16
    torch.testing.assert_close(fast.float(), ref.float(), atol=2e-2, rtol=2 ** -7)


def test_fast_attend_hard_and_parameterised_scores_equal_attend() -> None:
    from attnkit import AdditiveScore

    q, k, v, mask = qkv(2, 1, 4, 7, 8)
    for kwargs in ({"normalizer": "hard"}, {"score": AdditiveScore(8)}):
        ref, ref_w = attend(q, k, v, mask, **kwargs)
        fast, fast_w = fast_attend(q, k, v, mask, **kwargs)
        torch.testing.assert_close(fast, ref)
        torch.testing.assert_close(fast_w, ref_w)


def test_weights_in_the_compute_dtype_equal_float32_weights_rounded() -> None:
    """bf16 softmax output is the float32 softmax rounded once; masked keys and empty rows stay 0."""
    torch.manual_seed(9)
    e = (3 * torch.randn(3, 2, 5, 9)).bfloat16()
    mask = torch.ones(3, 1, 1, 9, dtype=torch.bool)
    mask[0, ..., 6:] = False
    mask[1] = False  # nothing to attend to
    for beta in (1.0, 0.7):
        kept = soft_attention_in_dtype(e, mask, beta)
        assert kept.dtype == torch.bfloat16
        reference = soft_attention(e, mask, beta=beta).to(torch.bfloat16)  # float32, then rounded
        torch.testing.assert_close(kept.float(), reference.float(), rtol=2 ** -8, atol=1e-6)  # <= 1 bf16 ulp
        assert (kept[0, ..., 6:] == 0).all() and (kept[1] == 0).all()


def test_grouped_queries_equal_repeated_keys() -> None:
    """Beam search's g hypotheses per memory row: the same as copying the memory g times."""
    q, _, _, _ = qkv(6, 2, 3, 5, 8)
    _, k, v, mask = qkv(2, 2, 3, 5, 8, seed=2)
    mask = mask[:, :, :1]  # (A, 1, 1, S): a padding mask, as cross-attention has
    grouped, w = fast_attend(q, k, v, mask)
    rep = torch.arange(2).repeat_interleave(3)
    ref, ref_w = attend(q, k[rep], v[rep], mask[rep])
    torch.testing.assert_close(grouped, ref)
    torch.testing.assert_close(w, ref_w)
    with pytest.raises(ValueError, match="same number"):
        fast_attend(q[:5], k, v, mask)


@pytest.mark.parametrize("p", [0.1, 0.3])
def test_byte_dropout_keeps_as_often_as_nn_dropout(p: float) -> None:
    torch.manual_seed(0)
    x = torch.ones(400_000)
    fast, ref = ByteDropout(p)(x), torch.nn.Dropout(p)(x)
    keep_fast, keep_ref = (fast > 0).float().mean().item(), (ref > 0).float().mean().item()
    assert abs(keep_fast - (1 - round(256 * p) / 256)) < 0.003  # p rounded to 1/256: the documented deviation
    assert abs(keep_fast - keep_ref) < 0.006
    assert abs(fast.mean().item() - 1.0) < 0.006 and abs(ref.mean().item() - 1.0) < 0.006  # unbiased
    assert torch.equal(ByteDropout(p).eval()(x), x)


def test_to_eager_swaps_paths_and_keeps_parameters() -> None:
    torch.manual_seed(0)
    model = Transformer(preset("tiny"), 40, 40)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    n_dropout = sum(type(m) is torch.nn.Dropout for m in model.modules())
    to_eager(model)
    assert sum(isinstance(m, ByteDropout) for m in model.modules()) == n_dropout > 0
    assert not any(type(m) is torch.nn.Dropout for m in model.modules())
    assert all(type(m) is EagerMultiHeadAttention for m in model.modules() if isinstance(m, MultiHeadAttention))
    assert type(model.init_decoder(torch.tensor([[5, 6, 3]]))) is SharedMemoryState
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_fast_decoding_equals_reference_decoding() -> None:
    """Greedy and beam search (shared memory, fast kernel) give the reference's hypotheses and scores (to 1e-5)."""
    torch.manual_seed(3)
    reference = Transformer(preset("tiny", dropout=0.0), 40, 40).eval()
    fast = to_eager(Transformer(preset("tiny", dropout=0.0), 40, 40)).eval()
    fast.load_state_dict(reference.state_dict())
    src = torch.randint(4, 40, (5, 7))
    src[1, 4:] = 0  # padding
    with torch.inference_mode():
        for search in (lambda m: [[h] for h in greedy_search(m, src)],
                       lambda m: beam_search(m, src, beam_size=4, n_best=2)):
            a, b = search(reference), search(fast)
            assert [[h.tokens for h in n] for n in a] == [[h.tokens for h in n] for n in b]
            scores = [torch.tensor([[(h.score, h.norm_score) for h in n] for n in hyps]) for hyps in (a, b)]
            torch.testing.assert_close(scores[0], scores[1], rtol=1e-5, atol=1e-5)


def test_shared_rows_groups_consecutive_rows_of_one_sentence() -> None:
    assert shared_rows(torch.tensor([0, 0, 1, 1, 2, 2])).tolist() == [0, 1, 2]
    assert shared_rows(torch.tensor([2, 2, 2, 0, 0, 0])).tolist() == [2, 0]
    assert shared_rows(torch.tensor([1, 0, 2])).tolist() == [1, 0, 2]  # greedy: groups of one
    assert shared_rows(torch.tensor([0, 0, 1])) is None  # uneven groups
    assert shared_rows(torch.tensor([0, 0, 1, 2])) is None  # a group holding two sentences


@pytest.mark.parametrize("use_cache", [True, False])
def test_beam_rows_share_one_memory_row_per_sentence_and_decode_like_separate_rows(use_cache: bool) -> None:
    model = to_eager(small_model())
    src, tgt = batch()
    state = model.init_decoder(src, use_cache=use_cache)
    beams = state.select(torch.arange(3).repeat_interleave(4))  # 3 sentences x 4 beams
    assert beams.memory is state.memory  # not copied
    rows = torch.arange(3).repeat_interleave(4)  # the sentence each beam row decodes
    for t, reorder in enumerate([torch.arange(12), torch.tensor([3, 3, 0, 1, 4, 4, 4, 4, 11, 8, 9, 9])]):
        beams, rows = beams.select(reorder), rows[reorder]
        logits, beams, attn = model.decode_step(tgt[rows, t], beams, need_weights=True)
        assert beams.memory.size(0) == 3  # reordering beams within their sentence re-selects no memory
        torch.testing.assert_close(logits, model(src[rows], tgt[rows, : t + 1])[:, t], atol=1e-5, rtol=1e-5)
        ref_attn = model.cross_attention(src[rows], tgt[rows, : t + 1])[-1][:, :, t].mean(dim=1)  # (12, S)
        torch.testing.assert_close(attn, ref_attn, atol=1e-6, rtol=1e-5)
    left = beams.select(torch.tensor([8, 9, 10, 11]))  # sentences 0 and 1 finished
    assert left.memory.size(0) == 1
    logits, _, _ = model.decode_step(tgt[rows[8:], 2], left)
    torch.testing.assert_close(logits, model(src[rows[8:]], tgt[rows[8:], :3])[:, 2], atol=1e-5, rtol=1e-5)


def train_losses(engine: str, updates: int = 50) -> list[float]:
    """The loss curve of a tiny Transformer trained ``updates`` steps under ``engine`` (dropout 0)."""
    from attnkit.engine.loss import FusedSeq2SeqLoss
    from attnkit.tasks.objectives import Seq2SeqLoss

    torch.manual_seed(0)
    model = Transformer(preset("tiny", dropout=0.0, d_model=32, d_ff=64), 30, 30)
    objective = Seq2SeqLoss(model)
    if engine == "fast":
        objective = FusedSeq2SeqLoss(to_eager(model))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(updates):
        src = torch.randint(4, 30, (8, 9), generator=g)
        tgt = torch.cat([torch.full((8, 1), 1), src.flip(1)], dim=1)  # learn to reverse
        scored = torch.ones(8, 9, dtype=torch.bool)
        loss = objective(src, tgt[:, :-1], scored, tgt[:, 1:][scored], 0.1) / scored.sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_fifty_updates_give_the_same_loss_curve_under_both_engines() -> None:
    fast, reference = train_losses("fast"), train_losses("reference")
    assert reference[-1] < 0.8 * reference[0]  # it learned something
    torch.testing.assert_close(torch.tensor(fast), torch.tensor(reference), atol=2e-3, rtol=1e-3)


def test_fused_mlm_loss_equals_the_reference_loss_and_gradients() -> None:
    from attnkit.engine import FusedMLMLoss
    from attnkit.mlm import MaskedLanguageModel, MLMLoss, mask_tokens
    from attnkit.transformer import TransformerConfig

    torch.manual_seed(0)
    model = MaskedLanguageModel(TransformerConfig(d_model=32, n_heads=2, d_ff=64, encoder_layers=2, dropout=0.0), 300)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(5, 300, (6, 40), generator=g)
    tokens[2, 25:] = 0
    inputs, selected = mask_tokens(tokens, mask_id=4, special_ids=(1, 2, 3), vocab_size=300, generator=g)
    assert_same_loss_and_gradients(model, FusedMLMLoss(model), MLMLoss(model), inputs, selected, tokens[selected], 0.1)


def test_a_growing_cache_holds_what_concatenation_holds_through_every_growth_and_reorder() -> None:
    """GrowingKVCache == KVCache.append's concatenation: prompts, single steps and chunks across the buffer's
    growth (FIRST_ROOM, then doubling), a reorder (beam search's select), and earlier caches left as they were."""
    from attnkit.engine.decoding import FIRST_ROOM, GrowingKVCache
    from attnkit.multihead import KVCache

    g = torch.Generator().manual_seed(0)
    reference, growing = KVCache(), GrowingKVCache()
    earlier = []
    for step, T in enumerate([5] + [1] * (FIRST_ROOM + 3) + [40, 1, 1, 70]):
        k, v = torch.randn(3, 2, T, 4, generator=g), torch.randn(3, 2, T, 6, generator=g)
        with torch.no_grad():
            reference, growing = reference.append(k, v), growing.append(k, v)
        assert isinstance(growing, GrowingKVCache)
        assert torch.equal(growing.k, reference.k) and torch.equal(growing.v, reference.v)
        earlier.append((growing, reference.k.clone()))
        if step == 30:
            index = torch.tensor([2, 0, 0])
            reference, growing = reference.select(index), growing.select(index)
            assert torch.equal(growing.k, reference.k)
    for cache, k in earlier[-5:]:
        assert torch.equal(cache.k, k)  # later appends wrote past the end of earlier caches only
    assert growing.room is not None and growing.room[0].size(2) >= growing.k.size(2)
    with torch.enable_grad():  # training: concatenation, so the backward pass sees no in-place write
        k = torch.randn(3, 2, 1, 4, requires_grad=True)
        grown = growing.append(k, torch.randn(3, 2, 1, 6))
        grown.k.sum().backward()
        assert k.grad is not None and type(grown) is KVCache


HOLD_AND_COUNT_FAULTS = """
import resource, sys, torch
from attnkit.engine.memory import hold_freed_memory
if sys.argv[1] == "hold" and not hold_freed_memory():
    raise SystemExit("not set")
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for mb in (64, 63):
    before = faults()
    torch.empty(mb << 18).fill_(1.0)  # mb MB, freed at once
    print(faults() - before)
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_held_memory_serves_the_next_tensor_without_page_faults() -> None:
    """After hold_freed_memory a freed 64 MB tensor's pages serve the next one, of 63 MB (16,128 pages: a few
    faults at most); glibc's default maps and faults them in again (a block that large is always mmap'd). The next
    tensor is a little smaller: one of the same size was faulted in again in about one run of four on 2026-11-28
    (erratic: not the address layout, `setarch -R` changed nothing; not yet explained)."""
    counts = {}
    for mode in ("default", "hold"):
        done = subprocess.run([sys.executable, "-c", HOLD_AND_COUNT_FAULTS, mode], capture_output=True, text=True,
                              check=True, env={**os.environ, "PYTHONPATH": str(Path(attnkit.__file__).parents[1])})
        counts[mode] = [int(n) for n in done.stdout.split()]
    pages = (63 << 20) // 4096
    assert counts["default"][1] > pages // 2  # faulted in again
    assert counts["hold"][1] < pages // 16  # reused
