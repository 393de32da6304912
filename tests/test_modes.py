"""Every mode of the engine's one switch equals the reference, for every kind of model (attnkit.engine.Engine).

The matrix: translation (the Transformer and the RNN seq2seq), classification (the encoder classifier and the
decoder classifier), the masked LM, a language model of every position kind, and language models imported from
Hugging Face (GPT-2, Llama, Mistral, Qwen2). Each model is built once with spread-out weights; ``reference`` is the
textbook's own classes (nothing of the engine), and each mode runs a copy of the same weights.

Tolerances (documented in docs/engine.md):

* ``eager`` and ``compiled`` in float32: logits within 1e-4 of the reference, the same greedy tokens and beams;
* ``bf16`` weights: logits within 5% of their spread (the largest |logit|), the same greedy token wherever the
  reference's top two logits are further apart than that;
* ``int8`` weights: logits within 5% of their spread (rounding to 255 levels per row of every matrix).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from attnkit.classifier import DecoderClassifier, TransformerClassifier
from attnkit.engine import Engine, generation_decoder, prepare
from attnkit.engine.compiled_decoding import CompiledDecoder
from attnkit.engine.eager import EagerLanguageModel, EagerMultiHeadAttention, EagerTransformer
from attnkit.lm import LanguageModel
from attnkit.mlm import MaskedLanguageModel
from attnkit.multihead import MultiHeadAttention
from attnkit.rnn import RNNConfig, RNNSeq2Seq
from attnkit.sampling import generate
from attnkit.search import beam_search, greedy_search
from attnkit.tasks import load_run
from attnkit.transformer import Transformer, TransformerConfig
from attnkit.vocab import BOS_ID, EOS_ID
from hf_models import gpt2_dir, imported, llama_dir, qwen2_dir

V = 40
FLOAT_ATOL = 1e-4
LOW_PRECISION = 0.05  # of the logits' spread: bf16 and int8 weights

CFG = dict(d_model=32, n_heads=4, d_ff=64, encoder_layers=2, decoder_layers=2, dropout=0.0, max_len=64)


def spread(model: nn.Module, seed: int = 0) -> nn.Module:
    """Every parameter moved off its initial value, so a wrong path cannot hide behind an identity."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def source(B: int = 3, S: int = 7, seed: int = 1) -> torch.Tensor:
    src = torch.randint(EOS_ID + 1, V, (B, S), generator=torch.Generator().manual_seed(seed))
    src[:, -1] = EOS_ID
    src[0, -3:] = torch.tensor([EOS_ID, 0, 0])  # a padded row
    return src


def modes(model: nn.Module) -> dict[str, nn.Module]:
    """The reference (textbook classes) and each float32 mode, on copies of ``model``'s weights."""
    return {mode: prepare(copy.deepcopy(model), Engine(mode)).eval() for mode in ("reference", "eager", "compiled")}


def assert_logits_close(got: torch.Tensor, want: torch.Tensor, precision: str = "float32") -> None:
    got, want = got.float(), want.float()
    if precision == "float32":
        torch.testing.assert_close(got, want, atol=FLOAT_ATOL, rtol=0)
    else:
        assert (got - want).abs().max() <= LOW_PRECISION * want.abs().max(), (got - want).abs().max()


# -- the switch itself ----------------------------------------------------------------------------------------


def test_the_modes_are_the_textbook_classes_or_the_engine_s_and_back() -> None:
    model = spread(Transformer(TransformerConfig(**CFG), V, V))
    eager = prepare(copy.deepcopy(model), Engine("eager"))
    assert type(eager) is EagerTransformer
    assert all(type(m) is EagerMultiHeadAttention for m in eager.modules() if isinstance(m, MultiHeadAttention))
    back = prepare(eager, Engine("reference"))
    assert type(back) is Transformer
    assert all(type(m) is MultiHeadAttention for m in back.modules() if isinstance(m, MultiHeadAttention))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), back.state_dict().values(),
                                                    strict=True))


def test_the_textbook_does_not_know_the_engine() -> None:
    """No textbook module imports, names or leaves a hook for the engine (it builds on their public pieces)."""
    from pathlib import Path

    textbook = ["attention", "multihead", "layers", "transformer", "rnn", "classifier", "mlm", "lm", "positions",
                "sampling", "search", "ngrams", "vocab"]
    src = Path(__file__).resolve().parents[1] / "src" / "attnkit"
    for name in textbook:
        text = (src / f"{name}.py").read_text(encoding="utf-8")
        assert "engine" not in text, f"attnkit/{name}.py mentions the engine"


@pytest.mark.parametrize("bad, needle", [({"mode": "fast"}, "--engine fast"), ({"precision": "fp16"}, "--precision"),
                                         ({"mode": "reference", "quantize": "int8"}, "--engine eager or compiled")])
def test_a_bad_choice_is_a_one_line_error(bad, needle) -> None:
    from attnkit.common.errors import UserError

    with pytest.raises(UserError, match=needle):
        Engine(**bad)


# -- translation: the Transformer and the RNN ------------------------------------------------------------------


def test_translation_every_mode_equals_the_reference() -> None:
    model = spread(Transformer(TransformerConfig(**CFG), V, V))
    src = source()
    tgt_in = torch.cat([torch.full((3, 1), BOS_ID), source(3, 5, seed=2)[:, :-1]], dim=1)
    runs = modes(model)
    with torch.inference_mode():
        want = runs["reference"](src, tgt_in)
        greedy = [h.tokens for h in greedy_search(runs["reference"], src)]
        beams = [[h.tokens for h in hyps] for hyps in beam_search(runs["reference"], src, beam_size=3, n_best=2)]
        for mode, run in runs.items():
            assert_logits_close(run(src, tgt_in), want)
            assert [h.tokens for h in greedy_search(run, src)] == greedy, mode
            assert [[h.tokens for h in hyps] for hyps in beam_search(run, src, beam_size=3, n_best=2)] == beams, mode


@pytest.mark.parametrize("attention", ["additive", "none"])
def test_the_rnn_every_mode_equals_the_reference(attention: str) -> None:
    model = spread(RNNSeq2Seq(RNNConfig(embed_dim=16, hidden_size=24, attention=attention, dropout=0.0), V, V))
    src = source()
    runs = modes(model)
    with torch.inference_mode():
        greedy = [h.tokens for h in greedy_search(runs["reference"], src)]
        for mode, run in runs.items():
            assert [h.tokens for h in greedy_search(run, src)] == greedy, mode


# -- classification and the masked LM ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["encoder", "decoder", "mlm"])
def test_encoders_every_mode_equals_the_reference(kind: str) -> None:
    cfg = TransformerConfig(**CFG)
    model = spread({"encoder": lambda: TransformerClassifier(cfg, V, 3, pooling="mean"),
                    "decoder": lambda: DecoderClassifier(cfg, V, 3),
                    "mlm": lambda: MaskedLanguageModel(cfg, V)}[kind]())
    tokens = source(4, 9)
    inputs = (tokens, tokens > EOS_ID) if kind == "mlm" else (tokens,)  # the MLM predicts the selected positions
    runs = modes(model)
    with torch.inference_mode():
        want = runs["reference"](*inputs)
        for run in runs.values():
            assert_logits_close(run(*inputs), want)


# -- language models ---------------------------------------------------------------------------------------------

LM_OPTIONS = {"learned": dict(positions="learned"), "sinusoidal": dict(positions="sinusoidal"),
              "rope-gqa": dict(positions="rope", n_kv_heads=2, norm="rmsnorm", activation="swiglu", bias=False),
              "alibi-window": dict(positions="alibi", window=5), "none": dict(positions="none")}


def lm(**options) -> LanguageModel:
    torch.manual_seed(0)
    cfg = TransformerConfig(**{**CFG, "encoder_layers": 0}, **options)
    return spread(LanguageModel(cfg, V))


def greedy_tokens(model: LanguageModel, engine: Engine, prompt: torch.Tensor, n: int = 12) -> list[list[int]]:
    """``n`` greedy tokens per row. In compiled mode the static-cache step runs eagerly (compiling ahead of time costs
    seconds a program: tests/test_compiled_decoding.py compiles each kind of model, tests/test_generate_cli.py and
    tests/test_lora.py a run through ``--engine compiled``)."""
    if engine.mode == "compiled":
        decoder = CompiledDecoder(model, compile=False)
        decoder_choose = decoder.choose_next
    else:
        decoder, decoder_choose = generation_decoder(model, engine)
    steps = generate(decoder, prompt, n, temperature=0.0, choose=decoder_choose, ignore_eos=True)
    return torch.stack(list(steps), dim=1).tolist()


@pytest.mark.parametrize("positions", sorted(LM_OPTIONS))
def test_language_models_every_mode_equals_the_reference(positions: str) -> None:
    model = lm(**LM_OPTIONS[positions])
    prompt = source(2, 6)[:, :5]
    runs = modes(model)
    with torch.inference_mode():
        want = runs["reference"](prompt)
        tokens = greedy_tokens(runs["reference"], Engine("reference"), prompt)
        for mode, run in runs.items():
            assert_logits_close(run(prompt), want)
            assert greedy_tokens(run, Engine(mode), prompt) == tokens, mode
    assert type(runs["eager"]) is EagerLanguageModel


@pytest.mark.parametrize("precision, quantize", [("bf16", "none"), ("float32", "int8"), ("bf16", "int8")])
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_low_precision_weights_stay_close_to_the_reference(mode: str, precision: str, quantize: str) -> None:
    model = lm(**LM_OPTIONS["rope-gqa"])
    prompt = source(2, 6)[:, :5]
    engine = Engine(mode, precision, quantize)
    run = prepare(copy.deepcopy(model), engine)
    with torch.inference_mode():
        want = prepare(copy.deepcopy(model), Engine("reference"))(prompt)
        assert_logits_close(run(prompt), want, precision="low")
        first = greedy_tokens(run, engine, prompt, n=1)
    top2 = want[:, -1].float().topk(2).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * LOW_PRECISION * want.abs().max()
    for row in clear.nonzero().flatten().tolist():
        assert first[row][0] == int(want[row, -1].argmax())


# -- imported checkpoints ---------------------------------------------------------------------------------------

FAMILIES = {"gpt2": gpt2_dir, "llama": llama_dir, "mistral": lambda out: llama_dir(out, model_type="mistral"),
            "qwen2": qwen2_dir}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_imported_models_every_mode_equals_the_reference(family: str, tmp_path) -> None:
    _, run_dir = imported(tmp_path, FAMILIES[family])
    runs = {mode: load_run(run_dir, engine=Engine(mode)) for mode in ("reference", "eager", "compiled")}
    tok = runs["reference"].tok
    prompt = torch.tensor(tok.encode_src(["The quick brown fox jumps"]))
    with torch.inference_mode():
        want = runs["reference"].model(prompt)
        tokens = greedy_tokens(runs["reference"].model, Engine("reference"), prompt, n=8)
        for mode, run in runs.items():
            assert_logits_close(run.model(prompt), want)
            assert greedy_tokens(run.model, Engine(mode), prompt, n=8) == tokens, (family, mode)
