"""The engine's compiled decoding step (:mod:`attnkit.engine.compiled_decoding`) against the textbook's step."""

from __future__ import annotations

import copy
import errno
import re
from pathlib import Path

import pytest
import torch
from torch._inductor.exc import CppCompileError, InductorError, InvalidCxxCompiler

from attnkit.common.errors import UserError
from attnkit.engine import aot, compiled_decoding, to_eager
from attnkit.engine.aot import matvec_linear
from attnkit.engine.compiled_decoding import CompiledDecoder, StaticKVCache, compile_prefill, static_mask
from attnkit.engine.continuous_lm import CompiledContinuousSampler
from attnkit.lm import LanguageModel, LMConfig
from attnkit.multihead import KVCache
from attnkit.positions import RotaryPositions
from attnkit.sampling import generate
from test_continuous_lm import CONFIGS, MAX_LEN, VOCAB, alone, requests, run_staggered
from test_continuous_lm import make_lm as continuous_lm
from test_lm_model import (
    one_thread,  # noqa: F401  (autouse: one intra-op thread for this module's tiny tensors)
    spread_weights_,
)

#: The deep model's layers: SmolLM2-135M's depth, deeper than a whole-step program could be compiled in one piece
#: (its buffer planner overflowed Python's recursion limit from about a dozen layers).
DEPTH = 30


def make_lm(**options) -> LanguageModel:
    """:func:`test_continuous_lm.make_lm` without its raised ``</s>`` (a zero bias): rows run to the end."""
    return continuous_lm(eos_bias=0.0, **options)


def deep_lm() -> LanguageModel:
    """A deep, narrow model of SmolLM2's kind: :data:`DEPTH` layers of width 36, RoPE, grouped-query attention
    with SmolLM2's 9 query and 3 key/value heads, RMSNorm, SwiGLU, no biases, the output layer tied to the
    embedding; unit-variance activations."""
    torch.manual_seed(5)
    cfg = LMConfig(d_model=36, n_heads=9, n_kv_heads=3, d_ff=48, decoder_layers=DEPTH, dropout=0.0, max_len=MAX_LEN,
                   positions="rope", rope_theta=500.0, norm="rmsnorm", activation="swiglu", bias=False,
                   scale_embeddings=False)
    model = LanguageModel(cfg, VOCAB)
    spread_weights_(model, seed=6)
    return model.eval()


def prompts(B: int, T: int) -> torch.Tensor:
    return torch.randint(4, VOCAB, (B, T), generator=torch.Generator().manual_seed(7))


def greedy(model: LanguageModel | CompiledDecoder, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` greedy tokens after each row of ``prompt`` ``(B, T)`` -> ``(B, n)``."""
    return torch.stack(list(generate(model, prompt.tolist(), n, temperature=0.0, ignore_eos=True)), 1)


@pytest.mark.parametrize("fast", [False, True], ids=["reference", "engine"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_static_cache_step_gives_the_logits_of_a_full_forward(name: str, fast: bool) -> None:
    """Every kind of positions, GQA and windows: feeding tokens one by one through static buffers (eager) gives,
    at every position, the logits of one forward pass over the whole sequence."""
    model = make_lm(**CONFIGS[name])
    model = to_eager(copy.deepcopy(model)).eval() if fast else model
    decoder = CompiledDecoder(model, compile=False)
    tokens = prompts(3, 20)  # (B, T)
    with torch.inference_mode():
        full = model(tokens)  # (B, T, V)
        logits, state = decoder.step(tokens[:, :5], decoder.init_state())  # the prefill, then static buffers
        assert isinstance(state.caches[0], StaticKVCache)
        stepped = [logits]
        for t in range(5, 20):
            logits, state = decoder.step(tokens[:, t: t + 1], state)
            stepped.append(logits)
    torch.testing.assert_close(torch.stack(stepped, 1), full[:, 4:], atol=1e-4, rtol=1e-4)
    assert state.length == 20 and state.caches[0].pos.tolist() == [20, 20, 20]


def test_greedy_tokens_are_generate_s_and_the_model_s_context_is_enforced() -> None:
    model = to_eager(make_lm(positions="learned"))
    decoder = CompiledDecoder(model, compile=False)
    prompt = prompts(2, 6).tolist()
    fits = MAX_LEN - 6 + 1  # the last token chosen is never fed: 6 + (fits - 1) = MAX_LEN positions
    ours = torch.stack(list(generate(decoder, prompt, fits, temperature=0.0, ignore_eos=True)), 1)
    theirs = torch.stack(list(generate(model, prompt, fits, temperature=0.0, ignore_eos=True)), 1)
    assert torch.equal(ours, theirs)
    for m in (model, decoder):  # one more needs position 65: the textbook's error, and the same one here
        with pytest.raises(ValueError, match="position 65 exceeds max_len=64"):
            list(generate(m, prompt, fits + 1, temperature=0.0, ignore_eos=True))


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_buffers_grow_for_positions_without_a_table(monkeypatch: pytest.MonkeyPatch, compile: bool) -> None:
    """RoPE has no context: a sequence longer than the first capacity gets buffers twice as long, same logits;
    compiled, one step serves every capacity and span (both are dimensions of the compiled step). The model and
    batch are :func:`test_the_compiled_step_equals_the_textbook_step`'s at batch 3, so its programs serve both
    (compiled once per test run, kept in the run's cache)."""
    monkeypatch.setattr(compiled_decoding, "FIRST_CAPACITY", 8)
    model = make_lm(**CONFIGS["rope-gqa-window3"])
    decoder = CompiledDecoder(to_eager(copy.deepcopy(model)).eval() if compile else model, compile=compile)
    tokens = prompts(3, 30)
    with torch.inference_mode():
        full = model(tokens)
        logits, state = decoder.step(tokens[:, :3], decoder.init_state())
        capacities = {state.caches[0].k.size(2)}
        for t in range(3, 30):
            logits, state = decoder.step(tokens[:, t: t + 1], state)
            capacities.add(state.caches[0].k.size(2))
    torch.testing.assert_close(logits, full[:, -1], atol=1e-4, rtol=1e-4)
    assert capacities == {8, 16, 32}
    if compile:
        [steps] = decoder.steps.values()
        assert len(steps) == 1 and steps[0].ranges["span"][0] <= 8 and steps[0].ranges["span"][1] >= 30


def test_a_prompt_pass_is_traced_with_rope_s_table_grown_at_most_to_the_traced_positions(monkeypatch) -> None:
    """Before tracing a prompt pass, RoPE's table is grown to the model's positions (64 here), but to at most
    ``TRACED_POSITIONS`` of them; a longer prompt grows it to its own length (in powers of two). Only the growth
    is under test here: the programs themselves are not compiled."""
    monkeypatch.setattr(compiled_decoding, "TRACED_POSITIONS", 16)
    monkeypatch.setattr(compiled_decoding, "compile_modules", lambda *args, **kwargs: [])
    model = make_lm(**CONFIGS["rope"])
    [rotary] = [m for m in model.modules() if isinstance(m, RotaryPositions)]
    decoder = CompiledDecoder(model)
    sizes = []
    for T in (5, 20):
        compile_prefill(decoder, prompts(1, T))
        sizes.append(rotary.cos.size(0))
    assert sizes == [16, 32]
    monkeypatch.setattr(compiled_decoding, "TRACED_POSITIONS", 8192)
    compile_prefill(decoder, prompts(1, 5))
    assert rotary.cos.size(0) == MAX_LEN  # the model's own positions, fewer than the cap


def test_reordered_rows_carry_their_own_caches_and_positions() -> None:
    """``LMState.select`` on a static state (a beam's reordering) keeps each row's buffers and position."""
    model = make_lm(positions="alibi")
    decoder = CompiledDecoder(model, compile=False)
    tokens = prompts(3, 9)
    with torch.inference_mode():
        _, state = decoder.step(tokens[:, :8], decoder.init_state())
        index = torch.tensor([2, 0, 0])
        logits, _ = decoder.step(tokens[index, 8:], state.select(index))
        expected = model(tokens[index])[:, -1]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_the_static_mask_hides_unwritten_and_out_of_window_keys() -> None:
    mask = static_mask(torch.tensor([0, 3, 5]), torch.arange(6), window=3)[:, 0, 0]  # (B, L)
    assert mask.tolist() == [[True, False, False, False, False, False],
                             [False, True, True, True, False, False],
                             [False, False, False, True, True, True]]


def test_a_static_cache_writes_each_row_at_its_own_position_in_place() -> None:
    k = torch.zeros(2, 1, 4, 1)
    cache = StaticKVCache(k, k.clone(), torch.tensor([1, 3]))
    new = cache.append(torch.tensor([[[[5.0]]], [[[7.0]]]]), torch.ones(2, 1, 1, 1))
    assert new.k is k and k[:, 0, :, 0].tolist() == [[0, 5, 0, 0], [0, 0, 0, 7]]
    assert new.pos.tolist() == [2, 4]
    with pytest.raises(ValueError, match="one new position"):
        cache.append(torch.zeros(2, 1, 2, 1), torch.zeros(2, 1, 2, 1))
    assert StaticKVCache.of(KVCache(torch.ones(1, 1, 2, 1), torch.ones(1, 1, 2, 1)), 5).pos.tolist() == [2]


def test_matvec_linear_is_f_linear_for_one_row_and_declines_more() -> None:
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(7, 5, generator=g), torch.randn(7, generator=g)
    x = torch.randn(1, 1, 5, generator=g)
    torch.testing.assert_close(matvec_linear(x, w, b), torch.nn.functional.linear(x, w, b))
    torch.testing.assert_close(matvec_linear(x[0], w), torch.nn.functional.linear(x[0], w))
    assert matvec_linear(torch.randn(2, 5), w) is NotImplemented  # two rows: a matrix product stays one


@pytest.mark.parametrize("name, batches", [("learned", (1,)), ("rope-gqa-window3", (1, 3))])
def test_the_compiled_step_equals_the_textbook_step(name: str, batches: tuple[int, ...]) -> None:
    """The static step compiled ahead of time (batch 1 with matrix-vector products, batch 3 with the library's
    matrix products; each program compiles in seconds, so learned positions, whose table is read at each row's
    position as RoPE's angles are, run at batch 1 only): greedy tokens are the textbook ``generate``'s, the logits
    agree (also when a prompt's tokens are a strided view), and the step reads the model's own weights: an update
    in place shows. Rows that join and leave a continuous batch through the same programs
    (:class:`CompiledContinuousSampler`) get ``generate``'s tokens, greedy and seeded, compiling nothing more."""
    reference = make_lm(**CONFIGS[name])
    model = to_eager(copy.deepcopy(reference)).eval()
    decoder = CompiledDecoder(model)
    for B in batches:
        prompt = prompts(B, 5).tolist()
        ours = torch.stack(list(generate(decoder, prompt, 20, temperature=0.0, ignore_eos=True)), 1)
        theirs = torch.stack(list(generate(reference, prompt, 20, temperature=0.0, ignore_eos=True)), 1)
        assert torch.equal(ours, theirs)
        sequence = torch.cat([torch.tensor(prompt), theirs], 1)
        with torch.inference_mode():
            logits, state = decoder.step(sequence[:, :5], decoder.init_state())
            for t in range(5, sequence.size(1)):
                logits, state = decoder.step(sequence[:, t: t + 1], state)
            torch.testing.assert_close(logits, reference(sequence)[:, -1], atol=1e-4, rtol=1e-4)
    [(key, steps)] = decoder.steps.items()  # a step for one row, and one for any batch from two rows
    assert sorted(s.ranges["batch"][0] for s in steps) == [min(B, 2) for B in batches]
    [prefills] = decoder.prefills.values()  # the prompt's pass: a batch of one is its own, 3 rows another
    assert sorted(p.ranges["batch"][0] for p in prefills) == [min(B, 2) for B in batches]
    assert all(p.holds(length=n) for p in prefills for n in (2, 5, 17, MAX_LEN))  # any prompt length
    one = prompts(1, 1)  # a one-token prompt: eager (no program holds it, none is compiled), the textbook's logits
    longer = prompts(1, 11)  # another length: the same program
    with torch.inference_mode():
        torch.testing.assert_close(decoder.prefill(one)[0], reference(one)[:, -1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(decoder.prefill(longer)[0], reference(longer)[:, -1], atol=1e-4, rtol=1e-4)
    assert len(prefills) == len(batches)
    with torch.no_grad():  # the tied embedding and output layer, and one layer's projection, updated in place
        for m in (model, reference):
            m.out_proj.weight.mul_(1.5)
            m.layers[0].self_attn.in_proj.weight.add_(0.1)
    prompt = prompts(1, 5).tolist()
    ours = torch.stack(list(generate(decoder, prompt, 20, temperature=0.0, ignore_eos=True)), 1)
    assert torch.equal(ours, torch.stack(list(generate(reference, prompt, 20, temperature=0.0, ignore_eos=True)), 1))
    assert len(decoder.steps[key]) == len(batches)  # nothing compiled again: the programs read the weights in place
    if len(batches) > 1:  # rows joining and leaving a continuous batch (1 to 6 rows, past the first capacity)
        reqs = [{**r, "max_new_tokens": r["max_new_tokens"] * 4} for r in requests(10)]
        got = run_staggered(CompiledContinuousSampler(decoder), reqs, join_every=5)
        for i, r in enumerate(reqs):
            assert got[i] == alone(model, r), f"request {i} ({r['sampling']})"
        assert len(decoder.steps[key]) == len(batches)  # the same two steps: one row, and any more
        assert len(prefills) == len(batches)  # and the same prompt passes, whatever the prompts' lengths


@pytest.mark.parametrize("name", list(CONFIGS))
def test_continuous_rows_in_static_buffers_are_continued_as_generate_alone(name: str) -> None:
    """The compiled sampler's bookkeeping (rows left-aligned in static buffers, joined and taken out), through the
    same step run eagerly (``compile=False``): rows that join and leave get ``generate``'s tokens, greedy and
    seeded, for every kind of positions and a window."""
    model = continuous_lm(True, **CONFIGS[name])
    reqs = requests(12)
    got = run_staggered(CompiledContinuousSampler(CompiledDecoder(model, compile=False)), reqs)
    assert sorted(got) == list(range(len(reqs)))
    for i, r in enumerate(reqs):
        assert got[i] == alone(model, r), f"request {i} ({r['sampling']})"
    assert len({len(tokens) for tokens in got.values()}) > 2  # rows ended at different steps


def test_a_compiled_step_runs_a_bf16_model_and_refuses_autocast() -> None:
    """A model converted to bf16 compiles in bf16 (its logits near the eager bf16 step's); autocast is refused with
    a message that says what to do instead."""
    model = to_eager(make_lm(positions="rope")).eval()
    prompt = prompts(1, 5).tolist()
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="instead of autocast"):
        list(generate(CompiledDecoder(model), prompt, 3, temperature=0.0))
    half = copy.deepcopy(model).to(torch.bfloat16)
    decoder, eager = CompiledDecoder(half), CompiledDecoder(half, compile=False)
    sequence = prompts(1, 12)
    with torch.inference_mode():
        (_, ours), (_, theirs) = (d.step(sequence[:, :5], d.init_state()) for d in (decoder, eager))
        for t in range(5, 12):
            a, ours = decoder.step(sequence[:, t: t + 1], ours)
            b, theirs = eager.step(sequence[:, t: t + 1], theirs)
            assert ours.caches[0].k.dtype == torch.bfloat16  # (the test model's hook adds a float32 bias to logits)
            torch.testing.assert_close(a.float(), b.float(), atol=0.1, rtol=0.05)


#: The failures of :data:`FAILURES` that are a missing C++ compiler (the only ones whose message says to install one).
NO_COMPILER = ("no compiler", "compiler not found", "inductor's message")
#: What AOTInductor raises when compiling fails, and what the one-line error must say of it.
FAILURES = {
    "recursion": (lambda: InductorError(RecursionError("maximum recursion depth exceeded"), None),
                  r"recursion limit \(RecursionError\): the graph is too deep"),
    "no compiler": (lambda: InvalidCxxCompiler(), r"no working C\+\+ compiler .*install g\+\+"),
    "compiler not found": (lambda: FileNotFoundError(errno.ENOENT, "No such file or directory", "g++"),
                           r"no working C\+\+ compiler"),
    "inductor's message": (lambda: RuntimeError("Failed to find C++ compiler.\nPlease specify via CXX."),
                           r"no working C\+\+ compiler"),
    "compiler killed": (lambda: CppCompileError(["g++", "step.cpp"], "g++: fatal error: Killed signal terminated "
                                                                    "program cc1plus\ncompilation terminated."),
                        r"out of memory while compiling"),
    "memory": (lambda: InductorError(MemoryError(), None), r"out of memory while compiling"),
    "disk full": (lambda: OSError(errno.ENOSPC, "No space left on device"), r"no space left on the disk"),
    "compile error": (lambda: CppCompileError(["g++", "step.cpp"], "step.cpp: In function 'void f()':\n"
                                                                   "step.cpp:3:1: error: expected ';'"),
                      r"the C\+\+ compiler failed \(step\.cpp:3:1: error: expected ';'\)"),
    "other": (lambda: InductorError(ValueError("no lowering\nfor this"), None), r"\(?ValueError: no lowering;"),
}


def test_the_compiler_is_given_only_the_settings_this_torch_has(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.11's Inductor has no ``realize_cpu_*`` settings and refuses an unknown key (a GPU run hit it)."""
    assert aot.step_config() == aot.STEP_CONFIG  # the pinned torch knows every one
    monkeypatch.setitem(aot.STEP_CONFIG, "no_such_setting", 1)
    monkeypatch.setitem(aot.STEP_CONFIG, "aot_inductor.no_such_setting", 1)
    assert "no_such_setting" not in aot.step_config() and "aot_inductor.no_such_setting" not in aot.step_config()
    assert aot.step_config()["aot_inductor.package_constants_in_so"] is False


@pytest.mark.parametrize("kind", list(FAILURES))
def test_a_failed_compile_is_a_one_line_error_naming_its_cause(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """AOTInductor's compile raising (as it does for a graph too deep for the recursion limit, no C++ compiler, a
    compiler killed for memory, a full disk, a compile error, anything else): a user error of one line that names
    that cause (only a missing compiler's says to install one) and what to do instead."""
    monkeypatch.setenv("ATTNKIT_CACHE", "off")
    error, says = FAILURES[kind]

    def failing(*args, **kwargs):
        raise error()

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", failing)
    model = to_eager(make_lm(positions="learned")).eval()
    with pytest.raises(UserError) as caught:
        list(generate(CompiledDecoder(model), prompts(1, 5).tolist(), 3, temperature=0.0))
    message = str(caught.value)
    assert "\n" not in message and message.startswith("compiling ahead of time failed: ")
    assert message.endswith("; decode without compiling (--engine eager)")
    assert re.search(says, message) and ("install g++" in message) == (kind in NO_COMPILER)


# -- at depth: one layer compiled, loaded once per layer -------------------------------------------------------------


@pytest.fixture(scope="module")
def deep(tmp_path_factory) -> tuple[LanguageModel, CompiledDecoder, Path]:
    """:func:`deep_lm` with the engine's fast paths, a decoder whose batch-1 step and prompt pass are compiled (by
    greedy decoding) into a cache of its own, and that cache's folder of compiled programs."""
    cache = tmp_path_factory.mktemp("deep-cache")
    with pytest.MonkeyPatch.context() as m:
        m.setenv("ATTNKIT_CACHE", str(cache))
        model = to_eager(deep_lm())
        greedy(model, prompts(1, 5), 10)  # eager first, as the next decoder's model below (RoPE's table of angles)
        decoder = CompiledDecoder(model)
        greedy(decoder, prompts(1, 5), 3)
    return model, decoder, cache / "compiled-steps"


def test_a_deep_model_compiles_one_layer_and_loads_it_for_every_layer(deep) -> None:
    """However deep the model, the step is three compiled programs (before the layers, one layer, after them) and
    the prompt's pass one (a layer): each layer runs the one layer program, loaded with its own weights."""
    model, decoder, compiled = deep
    assert len(list(compiled.glob("*.pt2"))) == 4
    [[step]] = decoder.steps.values()
    [[prefill]] = decoder.prefills.values()
    for programs in (step.layers, prefill.layers):
        assert len(programs) == DEPTH and len({p.key for p in programs}) == 1
        for program, layer in zip(programs, model.layers, strict=True):
            assert program.constants["layer.ff.w2.weight"] is layer.ff.w2.weight
    assert len({step.before.key, step.layers[0].key, step.after.key, prefill.layers[0].key}) == 4


def test_a_deep_compiled_step_and_prompt_pass_give_the_textbook_s_tokens_and_logits(deep) -> None:
    """At depth, the compiled prompt pass gives the textbook's logits and keys and values for the prompt, the
    compiled step the logits of a full forward pass at every later position, and greedy decoding the textbook's
    tokens (batch 1, the programs the fixture compiled)."""
    _, decoder, _ = deep
    reference = deep_lm()  # the textbook's plain path, the same weights
    prompt = prompts(1, 5)
    tokens = greedy(decoder, prompt, 20)
    assert torch.equal(tokens, greedy(reference, prompt, 20))
    sequence = torch.cat([prompt, tokens], 1)  # (1, 25)
    with torch.inference_mode():
        full = reference(sequence)  # (1, 25, V)
        _, state = reference.step(sequence[:, :5], reference.init_state())
        logits, prefilled = decoder.prefill(sequence[:, :5])
        for ours, theirs in zip(prefilled.caches, state.caches, strict=True):
            torch.testing.assert_close(ours.k, theirs.k, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(ours.v, theirs.v, atol=1e-4, rtol=1e-4)
        logits, state = decoder.step(sequence[:, :5], decoder.init_state())
        stepped = [logits]
        for t in range(5, sequence.size(1)):
            logits, state = decoder.step(sequence[:, t: t + 1], state)
            stepped.append(logits)
    torch.testing.assert_close(torch.stack(stepped, 1), full[:, 4:], atol=1e-4, rtol=1e-4)
    with torch.inference_mode():  # a prompt of another length: the same program (RoPE's table does not fix one)
        torch.testing.assert_close(decoder.prefill(sequence[:, :13])[0], full[:, 12], atol=1e-4, rtol=1e-4)
    assert len(decoder.steps) == 1 and len(decoder.prefills) == 1  # nothing compiled beyond the fixture's
    [[prefill]] = decoder.prefills.values()
    assert prefill.holds(length=2) and prefill.holds(length=MAX_LEN)


def test_a_deep_model_s_programs_are_kept_on_disk_and_loaded_by_the_next_decoder(deep, monkeypatch) -> None:
    """A second model of the same architecture, with other weights, loads every program the fixture compiled from
    the disk (no compiling), each layer's copy reading that model's own layer; a damaged package is compiled again
    and replaced."""
    _, decoder, compiled = deep
    monkeypatch.setenv("ATTNKIT_CACHE", str(compiled.parent))
    second = to_eager(deep_lm())
    with torch.no_grad():  # other weights, same shapes: the tied embedding and output layer, and one layer's FFN
        second.out_proj.weight.mul_(-1.0)
        second.layers[DEPTH // 2].ff.w2.weight.mul_(-1.0)
    prompt = prompts(1, 5)
    # eager first: the eager pass extends RoPE's table of angles, which the exported step reads as a constant
    expected = greedy(second, prompt, 10)

    def no_compiling(*args, **kwargs):
        raise AssertionError("compiled again")

    with monkeypatch.context() as m:
        m.setattr(torch._inductor, "aoti_compile_and_package", no_compiling)
        assert torch.equal(greedy(CompiledDecoder(second), prompt, 10), expected)
    [[step]] = decoder.steps.values()
    layer = compiled / f"{step.layers[0].key}.pt2"
    layer.write_bytes(b"not a package")
    assert torch.equal(greedy(CompiledDecoder(second), prompt, 10), expected)
    assert layer.stat().st_size > 1000  # compiled again, in its place
