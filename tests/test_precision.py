"""Tests for attnkit.engine.precision: the calibration, its cache, the trainer's choice, bf16 weights at inference.

Speeds are never asserted (they depend on the host and on what else runs); what is asserted is what the choice
follows from: the rule ``bf16 when t_float32 >= MARGIN * t_bf16``, the cache, and the records. Timings are
replaced (``measure`` monkeypatched) only where a test needs a given outcome.
"""

from __future__ import annotations

import json

import pytest
import torch

from attnkit.common.errors import UserError
from attnkit.config.loader import load_config
from attnkit.config.schema import RunConfig
from attnkit.engine import precision as P
from attnkit.engine import to_eager
from attnkit.engine.onednn import OneDNNLinear
from attnkit.engine.onednn import available as onednn_available
from attnkit.lm import LanguageModel
from attnkit.runs.layout import PRECISION_FILE
from attnkit.training.trainer import Trainer
from attnkit.transformer import Transformer, TransformerConfig
from test_train import quiet, raw_config


def tiny_lm(**options) -> LanguageModel:
    torch.manual_seed(0)
    cfg = TransformerConfig(d_model=32, n_heads=4, d_ff=64, decoder_layers=2, dropout=0.0, max_len=64, **options)
    return LanguageModel(cfg, 50).eval()


def tiny_translator() -> Transformer:
    torch.manual_seed(0)
    cfg = TransformerConfig(d_model=32, n_heads=4, d_ff=64, encoder_layers=2, decoder_layers=2, dropout=0.0,
                            max_len=64)
    return Transformer(cfg, 40, 40).eval()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache of the test's own."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("ATTNKIT_CACHE", str(folder))
    return folder / "precision"


def fixed_timings(monkeypatch, float32: float, bf16: float, onednn: float | None = None) -> list[int]:
    """Make every measurement say ``float32`` and ``bf16`` (and ``onednn``) seconds; returns a list that counts the
    measurements."""
    calls: list[int] = []

    def measure(timed):
        calls.append(len(timed))
        return {"float32": float32, "bf16": bf16, **({} if onednn is None else {"onednn": onednn})}, P.MIN_ROUNDS
    monkeypatch.setattr(P, "measure", measure)
    return calls


def count_measurements(monkeypatch) -> list[int]:
    """Count the real measurements."""
    calls: list[int] = []
    real = P.measure

    def measure(timed):
        calls.append(len(timed))
        return real(timed)
    monkeypatch.setattr(P, "measure", measure)
    return calls


# -- the calibration -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, rows", [("train", 512), ("forward", 16), ("decode", 1)])
def test_calibration_returns_a_choice_that_follows_its_timings(cache, kind, rows):
    model = tiny_lm()
    rng = torch.get_rng_state()
    choice = P.calibrate(model, kind, rows)
    assert torch.equal(torch.get_rng_state(), rng)  # the run's random stream (dropout) is the same with or without
    assert choice.source == "measured" and choice.precision in P.PRECISIONS
    onednn = kind == "train" and onednn_available()  # training times float32 through oneDNN too
    assert set(choice.seconds) == {"float32", "bf16", *(["onednn"] if onednn else [])}
    assert all(s > 0 for s in choice.seconds.values())
    dnn = onednn and choice.seconds["float32"] >= P.MARGIN * choice.seconds["onednn"]
    assert choice.bf16 == (choice.seconds["onednn" if dnn else "float32"] >= P.MARGIN * choice.seconds["bf16"])
    assert choice.onednn == (dnn and not choice.bf16)
    assert P.MIN_ROUNDS <= choice.rounds <= P.ROUNDS
    # the workload is the model's matrices: in_proj, out_proj, two FFN layers per layer; the tied output layer once
    assert choice.workload == P.Workload(kind, rows, ((32, 32, 2), (32, 64, 2), (50, 32, 1), (64, 32, 2),
                                                      (96, 32, 2)))
    assert choice.host["threads"] == torch.get_num_threads()
    assert f"{choice.rounds} rounds" in choice.describe()


def timed_sizes(timed: P.Timed, kind: str) -> tuple[int, int, int]:
    """``(matrices k, rows m, output rows o)`` a timed product computes, read from what its float32 call returns."""
    if kind == "train":
        x_grad, w_grad = timed.run["float32"]()  # (m, in), (o, in)
        return 1, x_grad.size(0), w_grad.size(0)
    outputs = timed.run["float32"]()  # k of (m, o)
    return len(outputs), outputs[0].size(0), outputs[0].size(1)


@pytest.mark.parametrize("kind, rows", [("train", 8192), ("train", 8), ("forward", 100), ("decode", 3)])
def test_the_plan_scales_what_it_times_to_the_workload(kind, rows):
    """Each shape's timed products, times their scale, are the shape's products in a pass: count x rows x out."""
    groups = P.linear_weights(tiny_lm())
    workload = P.workload_of(groups, kind, rows)
    counts = {(out, inp): count for out, inp, count in workload.shapes}
    for timed in P.plan(groups, workload):
        out, inp = timed.shape
        k, m, o = timed_sizes(timed, kind)
        fitting = int(P.FLOPS_PER_PRODUCT / (6 * inp * out))  # rows of a product of about FLOPS_PER_PRODUCT
        assert m == (min(rows, max(P.MIN_ROWS, fitting)) if kind == "train" else rows)
        assert timed.scale * k * m * o == pytest.approx(counts[out, inp] * rows * out)
    results = P.plan(groups, workload)[0].run["bf16"]()
    if kind == "train":  # under autocast the float32 weight gets a float32 gradient
        assert [r.dtype for r in results] == [torch.float32, torch.float32]
    else:  # bf16 weights: bf16 products
        assert {r.dtype for r in results} == {torch.bfloat16}


def test_decode_streams_at_most_its_byte_budget_and_scales_up(monkeypatch):
    """A model larger than DECODE_BYTES is timed on part of its matrices (at least one per shape), scaled up."""
    monkeypatch.setattr(P, "DECODE_BYTES", 4 * 96 * 32 * 3)  # three (96, 32) matrices in float32
    groups = P.linear_weights(tiny_lm())
    timed = P.plan(groups, P.workload_of(groups, "decode", 1))
    sizes = [timed_sizes(t, "decode") for t in timed]
    assert all(k == 1 for k, m, o in sizes)  # one of each of the five shapes
    streamed = sum(k * o * t.shape[1] for t, (k, m, o) in zip(timed, sizes, strict=True))
    total = sum(len(ws) * out * inp for (out, inp), ws in groups.items())
    assert streamed < total
    assert sum(t.scale * k * o * t.shape[1] for t, (k, m, o) in zip(timed, sizes, strict=True)) == total


def test_the_second_calibration_reads_the_cache(cache, monkeypatch):
    model = tiny_lm()
    calls = count_measurements(monkeypatch)
    first = P.calibrate(model, "decode", 1)
    [path] = cache.glob("*.json")
    second = P.calibrate(model, "decode", 1)
    assert len(calls) == 1 and second.source == "cached"
    assert second.to_json() == {**first.to_json(), "source": "cached"}
    assert json.loads(path.read_text())["precision"] == first.precision
    P.calibrate(model, "decode", 2)  # another workload: measured, and kept beside it
    assert len(calls) == 2 and len(list(cache.glob("*.json"))) == 2


def test_attnkit_cache_off_measures_every_time_and_keeps_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNKIT_CACHE", "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    calls = count_measurements(monkeypatch)
    model = tiny_lm()
    assert [P.calibrate(model, "decode", 1).source for _ in range(2)] == ["measured", "measured"]
    assert len(calls) == 2 and not list(tmp_path.rglob("*"))


@pytest.mark.parametrize("damage", ["", "{not json", "[1, 2]", '{"precision": "fp16"}', "null",
                                    '{"precision": "bf16", "source": "measured", "seconds": {"float32": -1, '
                                    '"bf16": 1}}', "other workload"])
def test_a_damaged_cache_file_is_measured_again_and_replaced(cache, monkeypatch, damage):
    model = tiny_lm()
    groups = P.linear_weights(model)
    workload = P.workload_of(groups, "decode", 1)
    path = P.cache_path(workload)
    path.parent.mkdir(parents=True)
    if damage == "other workload":  # a valid choice, but not of this workload (a hash collision, a copied file)
        damage = json.dumps(P.Choice("bf16", "measured", P.workload_of(groups, "decode", 7),
                                     {"float32": 2.0, "bf16": 1.0}, 3).to_json())
    path.write_text(damage)
    calls = fixed_timings(monkeypatch, float32=1.0, bf16=2.0)
    choice = P.calibrate(model, "decode", 1)
    assert (choice.source, choice.precision, len(calls)) == ("measured", "float32", 1)
    assert P.read_cached(path, workload).to_json() == {**choice.to_json(), "source": "cached"}


def test_an_unwritable_cache_is_no_error(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("ATTNKIT_CACHE", str(blocker))  # the cache's folder cannot be made under a file
    fixed_timings(monkeypatch, float32=2.0, bf16=1.0)
    assert P.calibrate(tiny_lm(), "decode", 1).precision == "bf16"


@pytest.mark.parametrize("float32, bf16, chosen", [(1.0, 0.5, "bf16"), (1.1, 1.0, "bf16"), (1.09, 1.0, "float32"),
                                                   (1.0, 1.0, "float32"), (1.0, 3.0, "float32")])
def test_bf16_is_chosen_only_when_it_wins_by_the_margin(cache, monkeypatch, float32, bf16, chosen):
    fixed_timings(monkeypatch, float32=float32, bf16=bf16)
    choice = P.calibrate(tiny_lm(), "forward", 16)
    assert choice.precision == chosen and choice.seconds == {"float32": float32, "bf16": bf16}
    assert choice.speedup == pytest.approx(float32 / bf16)


@pytest.mark.parametrize("float32, bf16, onednn, chosen", [
    (2.0, 3.0, 1.0, "float32 through oneDNN"), (1.09, 3.0, 1.0, "float32"), (2.0, 1.2, 1.0, "float32 through oneDNN"),
    (2.0, 1.0, 1.5, "bf16"), (2.0, 1.0, 3.0, "bf16"), (1.0, 3.0, 2.0, "float32")])
def test_onednn_is_chosen_only_when_it_wins_by_the_margin(cache, monkeypatch, float32, bf16, onednn, chosen):
    """oneDNN against float32 through the BLAS, then the faster float32 against bf16, each by the margin."""
    fixed_timings(monkeypatch, float32=float32, bf16=bf16, onednn=onednn)
    choice = P.calibrate(tiny_lm(), "train", 512)
    assert f"{choice.precision}{' through oneDNN' if choice.onednn else ''}" == chosen
    again = P.Choice.from_json(json.loads(json.dumps(choice.to_json())))  # what a run records, read back
    assert (again.precision, again.onednn, again.seconds) == (choice.precision, choice.onednn, choice.seconds)
    cached = P.calibrate(tiny_lm(), "train", 512)
    assert (cached.source, cached.onednn) == ("cached", choice.onednn)


def test_a_record_from_before_onednn_reads_as_the_blas():
    old = {"precision": "float32", "source": "measured", "seconds": {"float32": 1.0, "bf16": 2.0}, "rounds": 3,
           "workload": {"kind": "train", "rows": 8, "shapes": [[4, 4, 1]]}, "host": None}
    assert not P.Choice.from_json(old).onednn
    with pytest.raises(TypeError, match="onednn"):
        P.Choice.from_json({**old, "onednn": "yes"})


def test_choose_precision_for_inference(cache, monkeypatch):
    fixed_timings(monkeypatch, float32=3.0, bf16=1.0)
    model = tiny_lm()
    decode = P.choose_precision(model, "cpu")
    forward = P.choose_precision(model, torch.device("cpu"), "forward", rows=64)
    assert (decode.workload.kind, decode.workload.rows, forward.workload.kind, forward.workload.rows) == (
        "decode", 1, "forward", 64)
    assert decode.describe().startswith("bf16 weights (measured:")
    with pytest.raises(ValueError, match="forward or decode"):
        P.choose_precision(model, "cpu", "train")


def test_a_model_without_matrices_computes_in_float32(cache):
    choice = P.calibrate(torch.nn.Sequential(torch.nn.LayerNorm(4)), "decode", 1)
    assert (choice.precision, choice.source, choice.seconds) == ("float32", "no matrices", None)


# -- training ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("setting, precision", [("fp32", "float32"), ("float32", "float32"), ("bf16", "bf16")])
def test_an_explicit_training_precision_is_honoured_unmeasured(monkeypatch, setting, precision):
    calls = fixed_timings(monkeypatch, float32=1.0, bf16=9.0)
    choice = P.training_precision(setting, tiny_lm(), torch.device("cpu"), 512)
    assert (choice.precision, choice.source, calls) == (precision, "asked", [])


def test_train_precision_accepts_float32_and_names_the_key_of_a_wrong_one():
    for setting in ("float32", "fp32", "bf16", "auto"):
        assert load_config(RunConfig, raw_config(precision=setting)).train.precision == setting
    with pytest.raises(UserError, match="precision"):
        load_config(RunConfig, raw_config(precision="fp16"))
    with pytest.raises(UserError, match="fp16"):
        P.training_precision("fp16", tiny_lm(), torch.device("cpu"), 512)


@pytest.mark.parametrize("float32, bf16", [(2.0, 1.0), (1.0, 2.0)])
def test_the_trainer_uses_records_and_logs_the_measured_choice(tmp_path, cache, monkeypatch, float32, bf16):
    fixed_timings(monkeypatch, float32=float32, bf16=bf16)
    lines: list[str] = []
    raw = raw_config(max_updates=2, precision="auto")
    trainer = Trainer(load_config(RunConfig, raw), tmp_path / "run", log=lines.append)
    expected = "bf16" if float32 > bf16 else "float32"
    assert trainer.bf16 == (expected == "bf16")
    record = json.loads((tmp_path / "run" / PRECISION_FILE).read_text())
    assert (record["precision"], record["source"], record["seconds"]) == (
        expected, "measured", {"float32": float32, "bf16": bf16})
    assert record["workload"]["kind"] == "train" and record["workload"]["rows"] == raw["train"]["max_tokens"]
    [line] = [line for line in lines if line.startswith("precision: ")]
    assert line.startswith(f"precision: {'bf16 autocast' if expected == 'bf16' else 'float32'} (measured: ")
    trainer.run()  # trains in that precision
    assert trainer.step == 2


def test_the_trainer_records_an_explicit_precision(tmp_path, monkeypatch):
    calls = fixed_timings(monkeypatch, float32=9.0, bf16=1.0)
    trainer = Trainer(load_config(RunConfig, raw_config(max_updates=1, precision="float32")), tmp_path / "run",
                      log=quiet)
    assert not trainer.bf16 and calls == []
    record = json.loads((tmp_path / "run" / PRECISION_FILE).read_text())
    assert (record["precision"], record["source"], record["seconds"]) == ("float32", "asked", None)


@pytest.mark.parametrize("engine", ["eager", "reference"])
def test_a_run_that_measured_onednn_faster_trains_through_it_and_resumes_so(tmp_path, cache, monkeypatch, engine):
    fixed_timings(monkeypatch, float32=2.0, bf16=3.0, onednn=1.0)
    lines: list[str] = []
    raw = raw_config(max_updates=2, valid_every=2, precision="auto")
    raw["train"]["engine"] = engine
    trainer = Trainer(load_config(RunConfig, raw), tmp_path / "run", log=lines.append)
    linears = [type(m) for m in trainer.model.modules() if isinstance(m, torch.nn.Linear)]
    used = engine == "eager"  # the reference runs the textbook's plain ops
    assert linears and set(linears) == {OneDNNLinear if used else torch.nn.Linear}
    assert json.loads((tmp_path / "run" / PRECISION_FILE).read_text())["onednn"] is used
    [line] = [line for line in lines if line.startswith("precision: ")]
    assert line.startswith(f"precision: float32{' through oneDNN' if used else ''} (measured: ")
    trainer.run()
    fixed_timings(monkeypatch, float32=1.0, bf16=3.0, onednn=2.0)  # this host now measures otherwise
    raw["train"]["max_updates"] = 3
    resumed = Trainer(load_config(RunConfig, raw), tmp_path / "run", resume=True, log=quiet)
    assert resumed.precision.onednn is used and resumed.precision.source == "resumed"
    assert any(type(m) is OneDNNLinear for m in resumed.model.modules()) is used
    resumed.run()
    assert resumed.step == 3


def test_a_resumed_auto_run_keeps_the_precision_it_started_with(tmp_path, cache, monkeypatch):
    fixed_timings(monkeypatch, float32=2.0, bf16=1.0)
    raw = raw_config(max_updates=2, valid_every=2, precision="auto")
    Trainer(load_config(RunConfig, raw), tmp_path / "run", log=quiet).run()
    fixed_timings(monkeypatch, float32=1.0, bf16=2.0)  # this host now measures otherwise (or another host)
    raw["train"]["max_updates"] = 3
    resumed = Trainer(load_config(RunConfig, raw), tmp_path / "run", resume=True, log=quiet)
    assert resumed.bf16 and resumed.precision.source == "resumed"
    assert json.loads((tmp_path / "run" / PRECISION_FILE).read_text())["source"] == "measured"  # as recorded


# -- bf16 weights at inference -----------------------------------------------------------------------------------------


def assert_near_float32(got: torch.Tensor, reference: torch.Tensor) -> None:
    """Within :data:`BF16_LOGIT_TOLERANCE` of float32's logits, relative to the largest."""
    bound = P.BF16_LOGIT_TOLERANCE * reference.abs().max().item()
    assert (got.float() - reference).abs().max().item() <= bound


@pytest.mark.parametrize("engine", ["reference", "fast"])
@pytest.mark.parametrize("options", [{}, {"norm": "rmsnorm", "positions": "rope", "activation": "swiglu",
                                          "n_kv_heads": 2, "bias": False}])
def test_bf16_weights_give_a_language_models_logits_near_float32(engine, options):
    model = tiny_lm(**options)
    if engine == "fast":
        to_eager(model)
    half = P.bf16_weights(model)
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())  # a copy: the model is left as it was
    tokens = torch.randint(1, 50, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference, logits = model(tokens), half(tokens)  # (B, T, V)
        assert logits.dtype == torch.bfloat16
        assert_near_float32(logits, reference)
        state = half.init_state()  # decoding step by step over bf16 caches: the same logits as the whole pass
        last, state = half.step(tokens[:, :12], state)
        for t in range(12, 20):
            assert_near_float32(last, reference[:, t - 1])
            last, state = half.step(tokens[:, t:t + 1], state)
        assert state.caches[0].k.dtype == torch.bfloat16


@pytest.mark.parametrize("engine", ["reference", "fast"])
def test_bf16_weights_give_a_translation_models_logits_near_float32(engine):
    model = tiny_translator()
    if engine == "fast":
        to_eager(model)
    half = P.bf16_weights(model)
    generator = torch.Generator().manual_seed(2)
    src, tgt = torch.randint(4, 40, (3, 15), generator=generator), torch.randint(4, 40, (3, 11), generator=generator)
    src[0, 10:] = 0  # padding
    with torch.no_grad():
        assert_near_float32(half(src, tgt), model(src, tgt))  # (B, T, V)


def test_bf16_weights_in_place_converts_the_model_itself():
    model = tiny_lm()
    assert P.bf16_weights(model, inplace=True) is model and model.embed.weight.dtype == torch.bfloat16
    assert not model.training
