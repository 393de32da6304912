"""Continuous sampling from a language model (attnkit.engine.continuous_lm): prompts that join a running batch
mid-way and leave it as they end are continued exactly as :func:`attnkit.sampling.generate` continues each alone,
greedy and seeded, for every kind of positions (a table read per row, RoPE rotated per row, ALiBi and the sliding
window by distance), with the textbook kernel and the engine's; rows taken out leave the others unchanged."""

from __future__ import annotations

import copy

import pytest
import torch

from attnkit.engine import to_eager
from attnkit.engine.continuous_lm import ContinuousSampler, Sampling
from attnkit.lm import LanguageModel
from attnkit.positions import RotaryPositions
from attnkit.sampling import generate
from attnkit.transformer import TransformerConfig
from attnkit.vocab import EOS_ID
from test_lm_model import spread_weights_

VOCAB, MAX_LEN = 40, 64

#: Model options under test: every kind of positions, grouped-query attention and sliding windows.
CONFIGS: dict[str, dict] = {
    "learned": {"positions": "learned"},
    "sinusoidal": {"positions": "sinusoidal"},
    "rope": {"positions": "rope"},
    "alibi": {"positions": "alibi"},
    "none": {"positions": "none"},
    "rope-gqa-window3": {"positions": "rope", "n_kv_heads": 2, "window": 3},
    "alibi-window4": {"positions": "alibi", "window": 4},
    "learned-window2-post-norm": {"positions": "learned", "window": 2, "norm_first": False},
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_lm(fast: bool = False, eos_bias: float = 2.0, **options) -> LanguageModel:
    """A random tiny language model with unit-variance activations (GPT-2's N(0, 0.02) would make attention
    nearly uniform, and positions barely matter) and a raised ``</s>``, so rows end after a few tokens, at
    different steps."""
    torch.manual_seed(3)
    cfg = TransformerConfig(d_model=32, n_heads=4, d_ff=64, decoder_layers=2, dropout=0.0, max_len=MAX_LEN,
                            **options)
    model = LanguageModel(cfg, VOCAB)
    spread_weights_(model, seed=4)
    bias = torch.zeros(VOCAB)
    bias[EOS_ID] = eos_bias
    model.out_proj.register_forward_hook(lambda _module, _inputs, logits: logits + bias)
    model = to_eager(copy.deepcopy(model)) if fast else model
    return model.eval()


def requests(n: int, seed: int = 5) -> list[dict]:
    """Prompts of 1..12 tokens, every other one greedy, the others sampled (some with top-k / top-p), each with
    its own seed and budget."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(1, 13, (1,), generator=g))
        prompt = torch.randint(4, VOCAB, (length,), generator=g).tolist()
        top_k, top_p = (0, 5)[i % 4 == 1], (1.0, 0.9)[i % 3 == 0]
        sampling = Sampling(0.0) if i % 2 == 0 else Sampling(1.0, top_k=top_k, top_p=top_p)
        out.append({"prompt": prompt, "max_new_tokens": 4 + 5 * (i % 4), "sampling": sampling, "seed": 100 + i})
    return out


def alone(model: LanguageModel, r: dict) -> list[int]:
    """``generate``'s tokens for one request, ``</s>`` included when it ended there."""
    s = r["sampling"]
    generator = torch.Generator().manual_seed(r["seed"])
    out: list[int] = []
    for token in generate(model, [r["prompt"]], r["max_new_tokens"], temperature=s.temperature, top_k=s.top_k,
                          top_p=s.top_p, generator=generator):
        out.append(int(token[0]))
        if out[-1] == EOS_ID:
            break
    return out


def run_staggered(sampler: ContinuousSampler, reqs: list[dict], join_every: int = 3, group: int = 2,
                  drop: dict[int, int] | None = None) -> dict[int, list[int]]:
    """Add ``group`` requests every ``join_every`` steps, then step until every row ended; request index -> its
    tokens. ``drop``: request index -> after how many of its tokens it is taken out."""
    out: dict[int, list[int]] = {}
    index: dict[int, int] = {}
    pending, step, drop = list(range(len(reqs))), 0, drop or {}

    def take(token) -> None:
        i = index[token.handle]
        out[i].append(token.id)
        if drop.get(i) == len(out[i]) and token.finish is None:
            sampler.drop([token.handle])

    while pending or sampler.running:
        if pending and step % join_every == 0:
            for i in pending[:group]:
                r = reqs[i]
                first = sampler.add(r["prompt"], r["max_new_tokens"], r["sampling"],
                                    torch.Generator().manual_seed(r["seed"]))
                index[first.handle], out[i] = i, []
                take(first)
            pending = pending[group:]
        for token in sampler.step():
            take(token)
        step += 1
        assert step < 500
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("fast", [False, True], ids=["textbook", "engine"])
def test_rows_that_join_and_leave_are_continued_as_generate_alone(name: str, fast: bool) -> None:
    model = make_lm(fast, **CONFIGS[name])
    reqs = requests(12)
    got = run_staggered(ContinuousSampler(model), reqs)
    assert sorted(got) == list(range(len(reqs)))
    for i, r in enumerate(reqs):
        assert got[i] == alone(model, r), f"request {i} ({r['sampling']})"
    lengths = {len(tokens) for tokens in got.values()}
    assert len(lengths) > 2  # the rows ended at different steps: rows really left a running batch
    assert any(tokens[-1] == EOS_ID for tokens in got.values())
    assert any(tokens[-1] != EOS_ID for tokens in got.values())  # some ran to their budget


def test_a_seeded_row_is_the_same_alone_and_among_others() -> None:
    """The same seeded request, alone and joining a batch mid-way beside different company: the same tokens."""
    model = make_lm(eos_bias=-2.0, positions="rope")
    mine = {"prompt": [5, 6, 7], "max_new_tokens": 20, "sampling": Sampling(1.2, top_p=0.95), "seed": 7}
    solo = run_staggered(ContinuousSampler(model), [mine])[0]
    company = requests(6, seed=9)
    crowded = run_staggered(ContinuousSampler(model), [*company[:3], mine, *company[3:]], join_every=2)[3]
    assert crowded == solo == alone(model, mine)
    assert len(solo) == 20


def test_rows_taken_out_leave_the_others_unchanged_and_free_their_columns() -> None:
    model = make_lm(eos_bias=-1.0, positions="alibi")
    reqs = requests(8, seed=11)
    sampler = ContinuousSampler(model)
    got = run_staggered(sampler, reqs, drop={0: 2, 3: 1, 5: 3})
    assert [len(got[i]) for i in (0, 3, 5)] == [2, 1, 3]
    for i, r in enumerate(reqs):
        assert got[i] == alone(model, r)[: len(got[i])]
        if i not in (0, 3, 5):
            assert got[i] == alone(model, r)
    assert sampler.running == 0 and sampler.width == 0 and sampler.caches == []


def test_a_long_prompt_joining_a_short_batch_pads_the_running_rows() -> None:
    """A prompt longer than the running cache: the running rows are padded on the left instead, and the columns
    no row uses any more are cut when it leaves."""
    model = make_lm(eos_bias=-5.0, positions="learned")
    sampler = ContinuousSampler(model)
    short = sampler.add([5, 6], 10)
    sampler.step()
    assert sampler.width == 3
    long = sampler.add(list(range(4, 24)), 2)  # 20 tokens
    assert sampler.width == 20 and sampler.valid.sum(dim=1).tolist() == [3, 20]
    tokens = sampler.step()  # the long row ends: its budget is 2
    assert [t.handle for t in tokens] == [short.handle, long.handle] and tokens[1].finish == "length"
    assert sampler.running == 1 and sampler.width == 4  # the short row's own 4 positions


@pytest.mark.parametrize("name", ["rope-gqa-window3", "learned", "alibi-window4"])
def test_prompts_of_one_length_started_together_are_continued_as_generate_alone(name: str) -> None:
    """``add_many``: one prefill for several prompts of one length, joining a running batch; each row's tokens are
    still ``generate``'s alone (greedy and seeded, a row ending at its first token among them)."""
    model = make_lm(eos_bias=0.0, **CONFIGS[name])
    reqs = [{**r, "prompt": (r["prompt"] * 6)[:6]} for r in requests(5, seed=21)]  # five prompts of 6 tokens
    reqs[2]["max_new_tokens"] = 1  # ends at its first token: never joins
    sampler = ContinuousSampler(model)
    early = sampler.add([7, 8, 9], 12)  # a row already running, of another length
    sampler.step()
    firsts = sampler.add_many([r["prompt"] for r in reqs], [r["max_new_tokens"] for r in reqs],
                              [r["sampling"] for r in reqs], [torch.Generator().manual_seed(r["seed"]) for r in reqs])
    assert firsts[2].finish == "length" and firsts[2].handle not in {row.handle for row in sampler.rows}
    out = {t.handle: [t.id] for t in firsts}
    while sampler.running:
        for token in sampler.step():
            out.setdefault(token.handle, []).append(token.id)
    for r, first in zip(reqs, firsts, strict=True):
        assert out[first.handle] == alone(model, r)
    assert early.handle not in {t.handle for t in firsts}
    with pytest.raises(ValueError, match="one length"):
        sampler.add_many([[5, 6], [5]], [3, 3], [Sampling(0.0)] * 2, [None, None])


def test_a_token_that_ends_the_row_at_once_never_joins() -> None:
    model = make_lm(positions="rope")
    sampler = ContinuousSampler(model)
    first = sampler.add([5, 6, 7], 1)
    assert first.finish in ("eos", "length") and sampler.running == 0


def test_rope_with_a_position_per_row_equals_each_row_at_its_own_offset() -> None:
    rope = RotaryPositions(8)
    x = torch.randn(3, 2, 4, 8)  # (B, H, T, d)
    offsets = torch.tensor([0, 5, 17])
    per_row = rope(x, offsets)
    for b, offset in enumerate(offsets.tolist()):
        torch.testing.assert_close(per_row[b], rope(x[b: b + 1], offset)[0])


def test_a_row_that_cannot_choose_ends_alone_and_the_others_go_on() -> None:
    """A row whose choice fails (options torch refuses; logits gone NaN mid-way, as a hook makes them here) ends with
    a token that carries the error, at its join or at any later step; every other row is continued exactly as
    ``generate`` continues it alone."""
    model = make_lm(eos_bias=-3.0, positions="rope")
    sampler = ContinuousSampler(model)
    poisoned: list[int] = []  # the handle whose logits the next step makes NaN

    def poison(_module, _inputs, logits: torch.Tensor) -> torch.Tensor | None:
        if not poisoned:
            return None
        row = [r.handle for r in sampler.rows].index(poisoned.pop())
        logits = logits.clone()
        logits[row] = float("nan")
        return logits

    model.out_proj.register_forward_hook(poison)
    reqs = [{**r, "max_new_tokens": 12} for r in requests(6, seed=13)]  # even: greedy; odd: sampled
    out: dict[int, list[int]] = {}
    handles = []
    for r in reqs:
        first = sampler.add(r["prompt"], r["max_new_tokens"], r["sampling"], torch.Generator().manual_seed(r["seed"]))
        handles.append(first.handle)
        out[first.handle] = [first.id]
    refused = sampler.add([5, 6, 7], 10, Sampling(1.0, top_k=-1), torch.Generator().manual_seed(1))  # k < 0
    assert refused.finish == "error" and isinstance(refused.error, RuntimeError)
    assert refused.handle not in {row.handle for row in sampler.rows}
    errors = {}
    for step in range(20):
        if step == 3:
            poisoned.append(handles[3])  # a sampled row, three tokens in
        for token in sampler.step():
            if token.finish == "error":
                errors[token.handle] = token.error
            else:
                out[token.handle].append(token.id)
        if not sampler.running:
            break
    assert list(errors) == [handles[3]] and "probability tensor" in str(errors[handles[3]])
    assert sampler.running == 0
    for i, (r, handle) in enumerate(zip(reqs, handles, strict=True)):
        expected = alone(model, r)
        assert out[handle] == (expected[:4] if i == 3 else expected), i
