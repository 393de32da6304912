"""``attnkit generate`` and the sampling under it (attnkit.sampling, attnkit.inference.language_model).

References are computed here independently: greedy decoding by hand with a full forward pass over the whole
sequence at every step, sampling by recomputing full forward passes instead of the key/value cache, top-k and
the nucleus on hand-made logits. The command is run in-process on a tiny character model trained once.
"""

from __future__ import annotations

import io
import math
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo
from torch import nn

from attnkit.common.errors import UserError
from attnkit.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, save_characters
from attnkit.inference.language_model import (
    DEFAULT_NEW_TOKENS,
    MAX_NEW_TOKENS,
    ContextLimit,
    context_limit,
    continue_text,
    prompt_ids,
    score_text_file,
)
from attnkit.runs.load import LoadedRun
from attnkit.sampling import choose_next, filter_logits, generate
from attnkit.tasks import load_run
from test_lm_task import assert_one_line_error, cli, corpus, lm_config, train_lm

PROMPT = "ROMEO:\n"  # 7 tokens; with 40 new ones the model's 48 positions are nearly full


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory) -> Path:
    """A tiny character model (learned positions, max_len 48) trained enough to prefer some characters."""
    tmp = tmp_path_factory.mktemp("generate")
    (tmp / "train.txt").write_text(corpus(300), encoding="utf-8")
    options = {"max_updates": 100, "valid_every": 100, "lr": 1e-2, "warmup": 10}
    train_lm(lm_config(tmp / "train.txt", train_options=options), tmp / "run")
    return tmp / "run"


@pytest.fixture(scope="module")
def lm(lm_run) -> LoadedRun:
    return load_run(lm_run)


def greedy_by_hand(run: LoadedRun, prompt: str, n: int) -> str:
    """Greedy decoding with a full forward pass over prompt + continuation at every step (no cache)."""
    ids = run.tok.encode_src([prompt])[0]
    new: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = run.model(torch.tensor([ids + new]))[0, -1].double()  # (V,)
            logits[[PAD_ID, UNK_ID, BOS_ID]] = -math.inf
            token = int(logits.argmax())
            if token == EOS_ID:
                break
            new.append(token)
    return run.tok.decode_src([new])[0]


def generated(capsys, run: Path, *options: str, prompt: str = PROMPT) -> str:
    code, out, err = cli(capsys, "generate", run, "--prompt", prompt, *options)
    assert code == 0, err
    return out


# -- the same seed, the same text -------------------------------------------------------------


def test_a_seed_gives_the_same_text_every_time(lm_run, capsys):
    options = ("--max-new-tokens", "40", "--temperature", "1")
    first = generated(capsys, lm_run, *options, "--seed", "1")
    assert first.startswith(PROMPT) and first.endswith("\n")
    assert generated(capsys, lm_run, *options, "--seed", "1") == first
    others = [generated(capsys, lm_run, *options, "--seed", str(s)) for s in (2, 3)]
    assert len({first, *others}) == 3


# -- greedy decoding ----------------------------------------------------------------------------


def test_temperature_zero_is_greedy_decoding_by_hand(lm_run, lm, capsys):
    greedy = greedy_by_hand(lm, PROMPT, 40)
    assert len(greedy) >= 12 and len(set(greedy)) >= 4  # a real continuation: not </s> at once, not one character
    assert generated(capsys, lm_run, "--max-new-tokens", "40", "--temperature", "0") == PROMPT + greedy + "\n"
    assert generated(capsys, lm_run, "--max-new-tokens", "40", "--temperature", "0", "--no-echo") == greedy + "\n"


@pytest.mark.parametrize("engine", ["reference", "eager", "compiled"])
def test_every_engine_decodes_the_same_text(lm_run, lm, capsys, engine):
    """``--engine reference | eager | compiled``: greedy text by hand, and the same sample for a seed."""
    torch._dynamo.reset()  # a fresh compile cache: this test's graphs do not count towards another's recompile limit
    greedy = greedy_by_hand(lm, PROMPT, 40)
    assert generated(capsys, lm_run, "--max-new-tokens", "40", "--temperature", "0", "--engine", engine) == \
        PROMPT + greedy + "\n"
    sample = ("--max-new-tokens", "40", "--temperature", "1", "--seed", "3")
    assert generated(capsys, lm_run, *sample, "--engine", engine) == generated(capsys, lm_run, *sample)


def test_quantize_int8_decodes_the_int8_model_s_greedy_text(lm_run, lm, capsys):
    """``--quantize int8``: the greedy text of the model's int8 copy (by hand, full forwards); the reference has no
    int8 layers: a one-line error. (Compiled, the int8 step's tokens are tests/test_quantize.py's, and the README's
    ``--engine compiled --quantize int8`` line runs in tests/test_doc_commands.py.)"""
    from dataclasses import replace

    from attnkit.engine.quantize import quantize_int8
    greedy = greedy_by_hand(replace(lm, model=quantize_int8(lm.model)), PROMPT, 40)
    assert generated(capsys, lm_run, "--max-new-tokens", "40", "--temperature", "0", "--engine", "eager",
                     "--quantize", "int8") == PROMPT + greedy + "\n"
    code, _, err = cli(capsys, "generate", str(lm_run), "--prompt", PROMPT, "--quantize", "int8", "--engine",
                       "reference")
    assert_one_line_error(code, err, "--quantize int8", "--engine eager or compiled")


@pytest.mark.parametrize("options", [("--top-k", "1"), ("--top-p", "1e-6"), ("--top-k", "1", "--top-p", "0.5")])
def test_one_candidate_left_is_greedy_at_any_temperature(lm_run, lm, capsys, options):
    greedy = greedy_by_hand(lm, PROMPT, 40)
    for seed, temperature in (("1", "1"), ("7", "2.5")):
        out = generated(capsys, lm_run, "--max-new-tokens", "40", "--temperature", temperature, "--seed", seed,
                        *options)
        assert out == PROMPT + greedy + "\n"


# -- the key/value cache -----------------------------------------------------------------------


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.9)])
def test_cached_generation_equals_full_forwards(lm, temperature, top_k, top_p):
    ids = lm.tok.encode_src([PROMPT])[0]
    for seed in (1, 2):
        cached = [int(t[0]) for t in generate(lm.model, [ids], 40, temperature=temperature, top_k=top_k,
                                              top_p=top_p, generator=torch.Generator().manual_seed(seed))]
        generator = torch.Generator().manual_seed(seed)
        full: list[int] = []
        with torch.no_grad():
            while len(full) < 40 and EOS_ID not in full:
                logits = lm.model(torch.tensor([ids + full]))[:, -1]  # (1, V): the whole sequence again
                full.append(int(choose_next(logits, temperature, top_k, top_p, generator)[0]))
        assert cached == full


def test_greedy_rows_of_a_batch_are_independent(lm):
    prompts = ["ROMEO:\n", "NURSE:\n", "the kin"]
    rows = [lm.tok.encode_src([p])[0] for p in prompts]
    steps = torch.stack(list(generate(lm.model, rows, 30, temperature=0)), dim=1)  # (B, steps)
    for prompt, row in zip(prompts, steps.tolist(), strict=True):
        ended = row.index(EOS_ID) if EOS_ID in row else len(row)
        assert all(t == PAD_ID for t in row[ended + 1:])  # a row that chose </s> is padded after it
        assert lm.tok.decode_src([row[:ended]])[0] == greedy_by_hand(lm, prompt, 30)


class Scripted(nn.Module):
    """A step model that always makes the next token of ``script`` (a list of ids) the most likely."""

    def __init__(self, script: list[int], vocab: int) -> None:
        super().__init__()
        self.script, self.vocab = script, vocab
        self.unused = nn.Parameter(torch.zeros(1))  # generate reads the device from the parameters

    def init_state(self) -> int:
        return 0

    def step(self, tokens: torch.Tensor, state: int) -> tuple[torch.Tensor, int]:
        logits = torch.zeros(tokens.size(0), self.vocab)
        logits[:, self.script[min(state, len(self.script) - 1)]] = 10.0
        return logits, state + 1


def test_continue_text_stops_at_eos_and_at_stop_strings(tmp_path):
    tok = save_characters(tmp_path, ["ab cdef"])
    script = [*tok.encode_src(["ab cd ef"])[0], EOS_ID, *tok.encode_src(["ab"])[0]]
    model = Scripted(script, tok.src_vocab_size)

    def text(max_new: int = 50, stop: tuple[str, ...] = ()) -> str:
        return "".join(continue_text(model, tok, [4], max_new, temperature=0, stop=stop))

    assert text() == "ab cd ef"  # ends at </s>, not at the budget
    assert text(max_new=4) == "ab c"
    assert text(stop=("cd",)) == "ab "  # the stop string is not shown, nor anything after it
    assert text(stop=("zz", " e", "b c")) == "a"  # the earliest of several
    assert text(stop=("ab cd ef!",)) == "ab cd ef"  # a stop string never completed holds nothing back at the end
    assert [int(t[0]) for t in generate(model, [[4]], 50, temperature=0)] == script[:9]


# -- top-k, top-p, the special pieces --------------------------------------------------------


def kept(logits: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(torch.isfinite(row)).flatten().tolist()) for row in logits]


def test_filter_logits_keeps_the_top_k_and_the_nucleus():
    probs = torch.tensor([[0.05, 0.40, 0.10, 0.25, 0.20],
                          [0.30, 0.02, 0.08, 0.50, 0.10]], dtype=torch.float64)
    logits = probs.log()
    assert kept(filter_logits(logits)) == [set(range(5))] * 2
    assert kept(filter_logits(logits, top_k=2)) == [{1, 3}, {0, 3}]
    assert kept(filter_logits(logits, top_k=1)) == [{1}, {3}]
    assert kept(filter_logits(logits, top_k=5)) == kept(filter_logits(logits, top_k=9)) == [set(range(5))] * 2
    # the nucleus: the fewest most likely tokens whose probabilities reach p
    assert kept(filter_logits(logits, top_p=0.3)) == [{1}, {3}]
    # (sorted, the rows add up to .40 .65 .85 .95 1 and .50 .80 .90 .98 1: no p below is near a boundary)
    assert kept(filter_logits(logits, top_p=0.6)) == [{1, 3}, {0, 3}]
    assert kept(filter_logits(logits, top_p=0.7)) == [{1, 3, 4}, {0, 3}]
    assert kept(filter_logits(logits, top_p=0.88)) == [{1, 3, 4, 2}, {0, 3, 4}]
    assert kept(filter_logits(logits, top_p=1.0)) == [set(range(5))] * 2
    # with both, the nucleus of what top-k kept (renormalised): row 1 .47 .76 1, row 2 .56 .89 1
    assert kept(filter_logits(logits, top_k=3, top_p=0.6)) == [{1, 3}, {0, 3}]
    assert kept(filter_logits(logits, top_k=2, top_p=0.7)) == [{1, 3}, {0, 3}]
    out = filter_logits(logits, top_k=2, top_p=0.7)
    assert torch.equal(out[torch.isfinite(out)], logits[torch.isfinite(out)])  # kept logits are unchanged


def test_specials_other_than_eos_are_never_chosen():
    logits = torch.tensor([[9.0, 9.0, 9.0, 0.0, 1.0, 2.0]]).repeat(500, 1)
    assert choose_next(logits.clone(), temperature=0).unique().tolist() == [5]
    sampled = choose_next(logits.clone(), temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert set(sampled.tolist()) == {3, 4, 5}  # </s> may be chosen; pad, unk and bos never
    eos = torch.tensor([[9.0, 9.0, 9.0, 8.0, 1.0]])
    assert choose_next(eos, temperature=0).tolist() == [EOS_ID]


#: Temperatures at the ends of what a float can hold (a Python float beyond float32's range; subnormal ones).
TINY_TEMPERATURES = (5e-324, 1e-300, 1e-45, 1e-38)
HUGE_TEMPERATURES = (1e39, 1e308, sys.float_info.max)


def test_sampling_is_defined_for_every_finite_temperature_and_top_p():
    """softmax(z / T) for every finite T > 0 (z shifted by its maximum, T clamped to float32's range): a tiny T puts
    all the probability on the largest logit, a huge one spreads it evenly over the tokens kept, an ordinary one is
    softmax(z / T); the most likely token is kept however small top-p is."""
    from attnkit.sampling import tempered

    z = torch.randn(6, 40, generator=torch.Generator().manual_seed(0)) * 5
    z[:, 7] = float("-inf")  # a token filtered out stays out
    finite = torch.isfinite(z)
    for t in TINY_TEMPERATURES:
        probs = torch.softmax(tempered(z, t), dim=-1)
        assert torch.equal(probs, torch.nn.functional.one_hot(z.argmax(-1), 40).float()), t
    for t in HUGE_TEMPERATURES:
        probs = torch.softmax(tempered(z, t), dim=-1)
        assert torch.equal(probs, finite.float() / finite.sum(-1, keepdim=True)), t
    for t in (0.05, 0.8, 1.0, 3.0):
        torch.testing.assert_close(torch.softmax(tempered(z, t), -1), torch.softmax(z / t, -1))
    greedy = choose_next(z, temperature=0)
    top3 = [set(row.topk(3).indices.tolist()) for row in z.index_fill(-1, torch.tensor([PAD_ID, UNK_ID, BOS_ID]),
                                                                        float("-inf"))]  # never chosen: -inf
    for seed in range(5):
        generator = torch.Generator().manual_seed(seed)
        for t in TINY_TEMPERATURES:
            assert torch.equal(choose_next(z, t, generator=generator), greedy)
        for top_p in (1e-46, 5e-324, 1e-7):
            assert torch.equal(choose_next(z, 2.0, top_p=top_p, generator=generator), greedy)
        for t in HUGE_TEMPERATURES:
            chosen = choose_next(z, t, top_k=3, generator=generator)  # evenly among the top 3
            assert all(int(c) in top3[i] for i, c in enumerate(chosen))
    draws = choose_next(z[:1].repeat(3000, 1), 1e308, generator=torch.Generator().manual_seed(1))
    counts = torch.bincount(draws, minlength=40)
    assert counts[[0, 1, 2, 7]].sum() == 0 and counts[3:7].min() > 0 and counts[8:].min() > 0  # every other token


@pytest.mark.parametrize("options", [("--temperature", "1e-300"), ("--temperature", "1e-38"),
                                     ("--temperature", "1", "--top-p", "1e-46")])
def test_extreme_sampling_options_are_greedy(lm_run, lm, capsys, options):
    greedy = greedy_by_hand(lm, PROMPT, 40)
    assert generated(capsys, lm_run, "--max-new-tokens", "40", "--seed", "3", *options) == PROMPT + greedy + "\n"


@pytest.mark.parametrize("temperature", ["1e39", "1e308"])
def test_a_huge_temperature_samples_without_an_error(lm_run, capsys, temperature):
    code, out, err = cli(capsys, "generate", lm_run, "--prompt", PROMPT, "--max-new-tokens", "20", "--seed", "1",
                         "--temperature", temperature, "--no-echo")
    assert code == 0 and err == "" and out.endswith("\n")


# -- stop strings ---------------------------------------------------------------------------


def test_stop_cuts_the_greedy_text_before_the_stop_string(lm_run, lm, capsys):
    greedy = greedy_by_hand(lm, PROMPT, 40)
    stop = greedy[10:12]
    cut = greedy.find(stop)
    out = generated(capsys, lm_run, "--max-new-tokens", "40", "--temperature", "0", "--stop", stop)
    assert out == PROMPT + greedy[:cut] + "\n"
    assert stop not in out[len(PROMPT):]
    other = greedy[3:5]
    earliest = min(cut, greedy.find(other))
    out = generated(capsys, lm_run, "--max-new-tokens", "40", "--temperature", "0", "--stop", stop, "--stop", other)
    assert out == PROMPT + greedy[:earliest] + "\n"


@pytest.mark.parametrize("seed", ["1", "2", "3"])
def test_stop_cuts_a_sample_where_the_stop_string_first_appears(lm_run, capsys, seed):
    options = ("--max-new-tokens", "40", "--temperature", "1", "--seed", seed, "--no-echo")
    whole = generated(capsys, lm_run, *options)[:-1]
    assert len(whole) > 10
    middle = whole[len(whole) // 2]  # a character the sample has, so this stop string cuts something
    for stop in (middle, whole[5:7], "e", " t"):
        out = generated(capsys, lm_run, *options, "--stop", stop)
        assert stop not in out[:-1]  # (the CLI ends its output with a line break of its own)
        assert out == (whole[:whole.find(stop)] if stop in whole else whole) + "\n"


# -- several samples, several prompts -------------------------------------------------------


def test_num_samples_prints_each_sample_separated(lm_run, lm, capsys):
    options = ("--max-new-tokens", "30", "--temperature", "1", "--seed", "4")
    out = generated(capsys, lm_run, *options, "--num-samples", "3")
    assert out.endswith("\n")
    samples = out[:-1].split("\n---\n")
    assert len(samples) == 3 and all(s.startswith(PROMPT) for s in samples)
    assert len(set(samples)) == 3
    assert samples[0] + "\n" == generated(capsys, lm_run, *options)  # the first sample: the seed's one sample
    greedy = generated(capsys, lm_run, "--max-new-tokens", "30", "--temperature", "0", "--num-samples", "3",
                       "--no-echo")
    one = greedy_by_hand(lm, PROMPT, 30)
    assert greedy == "\n---\n".join([one] * 3) + "\n"


def test_prompts_from_a_file_and_from_standard_input(lm_run, lm, capsys, monkeypatch, tmp_path):
    prompts = ["JULIET:", "the king"]
    expected = "\n---\n".join(p + greedy_by_hand(lm, p, 20) for p in prompts) + "\n"
    options = ("--max-new-tokens", "20", "--temperature", "0")
    (tmp_path / "prompts.txt").write_text("".join(p + "\n" for p in prompts), encoding="utf-8")
    code, out, err = cli(capsys, "generate", lm_run, "-i", tmp_path / "prompts.txt", *options)
    assert code == 0 and out == expected, err
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("".join(p + "\n" for p in prompts).encode())))
    code, out, err = cli(capsys, "generate", lm_run, *options)
    assert code == 0 and out == expected, err


# -- hostile input: one line, exit 2, nothing printed ------------------------------------------


LONG = ("the king " * 20)[:41]  # 41 tokens: with 8 new ones, past the model's 48 positions

HOSTILE = {
    "prompt past the positions": (["--prompt", LONG, "--max-new-tokens", "8"], "48 positions"),
    "character not in the vocabulary": (["--prompt", "the Zebra", "--max-new-tokens", "5"], "'Z'"),
    "later prompt bad": (["--prompt", "the", "--prompt", "kingZ", "--max-new-tokens", "5"], "'Z'"),
    "empty prompt": (["--prompt", "", "--max-new-tokens", "5"], "empty"),
    "negative temperature": (["--prompt", "the", "--temperature", "-1"], "--temperature"),
    "nan temperature": (["--prompt", "the", "--temperature", "nan"], "--temperature"),
    "top-p 0": (["--prompt", "the", "--top-p", "0"], "--top-p"),
    "top-p 1.5": (["--prompt", "the", "--top-p", "1.5"], "--top-p"),
    "max-new-tokens 0": (["--prompt", "the", "--max-new-tokens", "0"], "--max-new-tokens"),
    "max-new-tokens -5": (["--prompt", "the", "--max-new-tokens", "-5"], "--max-new-tokens"),
    "max-new-tokens too many": (["--prompt", "the", "--max-new-tokens", str(MAX_NEW_TOKENS + 1)],
                                "--max-new-tokens"),
    "top-k -1": (["--prompt", "the", "--top-k", "-1"], "--top-k"),
    "empty stop": (["--prompt", "the", "--max-new-tokens", "5", "--stop", ""], "--stop"),
    "num-samples 0": (["--prompt", "the", "--num-samples", "0"], "--num-samples"),
    "prompt and input": (["--prompt", "the", "-i", "prompts.txt", "--max-new-tokens", "5"], "not both"),
    "missing input": (["-i", "no-such-prompts.txt", "--max-new-tokens", "5"], "no-such-prompts.txt"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_input_is_a_one_line_error(lm_run, capsys, case):
    argv, needle = HOSTILE[case]
    code, out, err = cli(capsys, "generate", lm_run, *argv)
    assert_one_line_error(code, err, needle)
    assert out == ""  # every prompt is checked before anything is printed


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is here: tests/test_cuda.py generates on it")
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_device_cuda_without_a_gpu_is_a_one_line_error(lm_run, capsys, command):
    argv = ["--prompt", "the"] if command == "generate" else ["--port", "0"]
    code, out, err = cli(capsys, command, lm_run, *argv, "--device", "cuda")
    assert_one_line_error(code, err, "--device cuda", "no CUDA GPU")
    assert out == ""


def test_the_prompt_may_fill_the_positions_exactly(lm_run, capsys):
    out = generated(capsys, lm_run, "--max-new-tokens", "7", "--temperature", "0", prompt=LONG)  # 41 + 7 = 48
    assert out.startswith(LONG) and len(out) <= len(LONG) + 7 + 1


def test_generate_needs_a_language_model_run(translation_run, tmp_path, capsys):
    code, out, err = cli(capsys, "generate", translation_run, "--prompt", "the", "--max-new-tokens", "5")
    assert_one_line_error(code, err, "translate")
    code, out, err = cli(capsys, "generate", tmp_path / "no-such-run", "--prompt", "the", "--max-new-tokens", "5")
    assert_one_line_error(code, err, "no-such-run")
    assert out == ""


def test_prompt_ids_explains_the_limit(lm):
    limit = context_limit(lm)
    assert limit == ContextLimit(48, fixed=True)
    with pytest.raises(UserError, match=r"the prompt \(41 tokens\) and --max-new-tokens 8 exceed the model's 48 "
                                        r"positions .*ask for at most 7 tokens"):
        prompt_ids(lm.tok, LONG, limit, 8)
    with pytest.raises(UserError, match="exceed the model's 48"):  # a table cannot be read past, asked or not
        prompt_ids(lm.tok, LONG, limit, 8, beyond_context=True)
    assert prompt_ids(lm.tok, LONG, limit, 7) == (lm.tok.encode_src([LONG])[0], 7)


def test_a_default_never_asks_for_more_than_fits(lm, lm_run, capsys):
    """Without --max-new-tokens a sample gets 256 tokens, or what the context leaves after the prompt."""
    limit = context_limit(lm)
    assert prompt_ids(lm.tok, PROMPT, limit)[1] == 48 - 7
    assert prompt_ids(lm.tok, PROMPT, limit, default=5)[1] == 5
    assert prompt_ids(lm.tok, PROMPT, None)[1] == DEFAULT_NEW_TOKENS
    out = generated(capsys, lm_run, "--temperature", "0", prompt=LONG)  # 41 tokens: 7 fit
    assert out == LONG + greedy_by_hand(lm, LONG, 7) + "\n"
    with pytest.raises(UserError, match=r"the prompt \(48 tokens\) leaves no room in the model's 48 positions"):
        prompt_ids(lm.tok, LONG + "ROMEO:\n", limit)


# -- no table of positions: no length limit ------------------------------------------------------


@pytest.mark.parametrize("positions", ["rope", "alibi"])
def test_a_model_without_a_position_table_reads_past_its_trained_context_on_request(tmp_path, capsys, positions):
    (tmp_path / "train.txt").write_text(corpus(150), encoding="utf-8")
    raw = lm_config(tmp_path / "train.txt", model={"positions": positions},
                    train_options={"max_updates": 2, "valid_every": 2})
    train_lm(raw, tmp_path / "run")
    assert context_limit(load_run(tmp_path / "run")) == ContextLimit(16, fixed=False)  # data.block_size
    prompt = ("the king shall speak " * 6)[:120]  # 120 + 20 tokens, far past the 16 it was trained on
    code, out, err = cli(capsys, "generate", tmp_path / "run", "--prompt", prompt, "--max-new-tokens", "20")
    assert_one_line_error(code, err, "the prompt (120 tokens) leaves no room in the 16 positions the model was "
                                     "trained on", "--beyond-context")
    out = generated(capsys, tmp_path / "run", "--max-new-tokens", "20", "--temperature", "0", "--beyond-context",
                    prompt=prompt)
    assert out.startswith(prompt) and len(out) <= len(prompt) + 20 + 1
    (tmp_path / "long.txt").write_text(corpus(40, seed=3), encoding="utf-8")
    assert score_text_file(load_run(tmp_path / "run"), str(tmp_path / "long.txt"), context=100).tokens > 100


