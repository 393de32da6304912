"""Exporting a language model (task: lm) to CTranslate2 (attnkit.export.ctranslate2_lm) and generating with it.

Each variant is a tiny character model trained for 100 updates (about a second: enough for continuations that
depend on the prompt, where a random tied model repeats its last token) and exported through
``attnkit.export.export_to_ctranslate2`` (what ``--to ctranslate2`` runs). The reference is attnkit's own
engine: greedy continuations by :func:`attnkit.sampling.generate` and next-token log-probabilities by a forward
pass of the loaded run. Models with a chosen output bias (the special pieces, ``</s>``) are built directly,
with random weights.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from attnkit.common.errors import UserError
from attnkit.config.loader import dump_config, load_config
from attnkit.config.schema import RunConfig
from attnkit.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer, save_characters
from attnkit.export import export_to_ctranslate2
from attnkit.export.ctranslate2 import MANIFEST, ExportedTranslator, is_exported
from attnkit.export.ctranslate2_lm import ExportedGenerator, pieces_of
from attnkit.lm import LanguageModel
from attnkit.runs.checkpoint import save_weights
from attnkit.runs.layout import CONFIG_FILE, IMPORTED_FILE
from attnkit.runs.load import LoadedRun
from attnkit.sampling import generate
from attnkit.tasks import load_run
from test_lm_task import assert_one_line_error, cli, corpus, lm_config, train_lm

pytest.importorskip("ctranslate2")

#: what each variant exercises of the spec mapping (on TINY_LM: d_model 32, 2 layers, max_len set below)
VARIANTS = {
    "gpt2": {"positions": "learned", "norm": "layernorm", "activation": "gelu_tanh", "scale_embeddings": False,
             "n_heads": 4},
    "llama": {"positions": "rope", "rope_theta": 500.0, "n_heads": 4, "n_kv_heads": 2, "norm": "rmsnorm",
              "activation": "swiglu", "bias": False},
    "qwen2": {"positions": "rope", "n_heads": 4, "n_kv_heads": 2, "norm": "rmsnorm", "activation": "swiglu",
              "bias": False, "qkv_bias": True},  # in_proj's bias, none on out_proj or the FFN
    "alibi": {"positions": "alibi", "d_model": 48, "n_heads": 6, "activation": "gelu"},  # 6 heads: not a power of 2
    "window": {"positions": "rope", "n_heads": 4, "n_kv_heads": 1, "window": 6},
    "post-norm": {"positions": "sinusoidal", "norm_first": False, "attention_score": "dot", "tie_output": False,
                  "output_bias": True, "activation": "swish"},
    "none": {"positions": "none", "norm": "rmsnorm", "activation": "relu"},
}
NEW = 30  # new tokens per continuation
TRAIN = {"max_updates": 100, "valid_every": 100, "lr": 1e-2, "warmup": 10}


def trained_run(tmp: Path, model: dict) -> Path:
    """A tiny character model with ``model``'s options (64 positions) trained 100 updates in ``tmp/run``."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "train.txt").write_text(corpus(300), encoding="utf-8")
    train_lm(lm_config(tmp / "train.txt", model={"max_len": 64, **model}, train_options=TRAIN), tmp / "run")
    return tmp / "run"


def random_run(tmp: Path, model: dict, output_bias: dict[int, float]) -> Path:
    """A run directory holding a random model (as ``attnkit import`` writes one), whose output layer's bias is
    raised by ``output_bias`` at those ids, and whose norms are perturbed (no gamma 1, no beta 0)."""
    tmp.mkdir(parents=True, exist_ok=True)
    text = corpus(40)
    (tmp / "train.txt").write_text(text, encoding="utf-8")
    cfg = load_config(RunConfig, lm_config(tmp / "train.txt", model={**model, "output_bias": True,
                                                                      "tie_output": False}))
    run_dir = tmp / "run"
    tok = save_characters(run_dir, [text])
    dump_config(cfg, run_dir / CONFIG_FILE)
    torch.manual_seed(0)
    lm = LanguageModel(cfg.model.transformer, tok.src_vocab_size)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
        for i, b in output_bias.items():
            lm.out_proj.bias[i] += b
    save_weights(run_dir / IMPORTED_FILE, lm.state_dict())
    return run_dir


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory) -> tuple[str, LoadedRun, ExportedGenerator]:
    """``(name, the run loaded by attnkit, its float32 export loaded by CTranslate2)``."""
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp(request.param)
    run_dir = trained_run(tmp, VARIANTS[request.param])
    out = export_to_ctranslate2(run_dir, tmp / "ct2")
    return request.param, load_run(run_dir), ExportedGenerator(out, threads=1)


def prompts(tok: Tokenizer) -> list[list[int]]:
    """Prompts of 1 to 14 tokens (longer than the sliding window of the ``window`` variant)."""
    texts = ["R", "ROMEO:\n", "the king shall", "  my lord, good night"]
    return [ids[:14] for ids in tok.encode_src(texts)]


def refused(result: tuple[int, str, str], *needles: str) -> None:
    """``cli``'s result is exit status 2 with one ``attnkit: error:`` line naming each of ``needles``."""
    code, _, err = result
    assert_one_line_error(code, err, *needles)


def greedy(model: LanguageModel, ids: list[int], n: int = NEW) -> list[int]:
    """attnkit's greedy continuation of ``ids``, up to (not including) ``</s>``."""
    out = []
    for token in generate(model, [ids], n, temperature=0):
        if int(token[0]) == EOS_ID:
            break
        out.append(int(token[0]))
    return out


# -- the same model ---------------------------------------------------------------------------------------


def test_greedy_is_token_for_token_attnkits(variant):
    name, run, ct2 = variant
    batch = prompts(run.tok)
    ours = [greedy(run.model, ids) for ids in batch]
    assert ct2.generate_batch(batch, NEW, temperature=0) == ours  # prompts of different lengths, one batch
    assert [ct2.generate_batch([ids], NEW, temperature=0)[0] for ids in batch] == ours
    assert sum(map(len, ours)) > NEW  # continuations, not one </s> after another
    assert len({tuple(o) for o in ours}) > 1  # they depend on the prompt
    if name == "window":  # the window changes these continuations: it is exported, not ignored
        full = LanguageModel(replace(run.model.cfg, window=0), run.tok.src_vocab_size).eval()
        full.load_state_dict(run.model.state_dict())
        assert [greedy(full, ids) for ids in batch] != ours


def without_qkv_bias(model: LanguageModel) -> LanguageModel:
    """A copy of ``model`` whose query, key and value biases are zero."""
    twin = LanguageModel(model.cfg, model.out_proj.weight.size(0)).eval()
    twin.load_state_dict(model.state_dict())
    with torch.no_grad():
        for layer in twin.layers:
            layer.self_attn.in_proj.bias.zero_()
    return twin


def test_log_probs_agree(variant):
    name, run, ct2 = variant
    sequences = [ids + greedy(run.model, ids, 10) for ids in prompts(run.tok)]
    if ct2.window:
        sequences = [s[: ct2.window] for s in sequences]
    theirs = ct2.log_probs(sequences)
    with torch.no_grad():
        for seq, log_p in zip(sequences, theirs, strict=True):
            ours = torch.log_softmax(run.model(torch.tensor([seq])).double(), dim=-1)[0]  # (T, V)
            assert log_p.shape == tuple(ours.shape)
            assert torch.allclose(torch.from_numpy(log_p).double(), ours, atol=1e-4, rtol=0), name
            if name == "qwen2":  # the trained q, k, v biases change these numbers: they are exported, not dropped
                unbiased = torch.log_softmax(without_qkv_bias(run.model)(torch.tensor([seq])).double(), dim=-1)[0]
                assert (unbiased - ours).abs().max() > 1e-2


def test_stream_and_text_are_generate_batchs(variant):
    _, run, ct2 = variant
    for ids in prompts(run.tok)[:2]:
        tokens = ct2.generate_batch([ids], NEW, temperature=0)[0]
        assert list(ct2.stream(ids, NEW, temperature=0)) == tokens
        assert "".join(ct2.continue_text(ids, NEW, temperature=0)) == run.tok.decode_src([tokens])[0]


def test_sampling_is_seeded_and_never_chooses_specials(variant):
    _, run, ct2 = variant
    batch = prompts(run.tok)
    options = {"temperature": 4.0, "top_k": 30, "top_p": 0.99}  # these models are peaked: flatten them
    seeded = [ExportedGenerator(ct2.path, threads=1, seed=seed) for seed in (3, 3, 4)]
    first = seeded[0].generate_batch(batch, NEW, **options)
    assert seeded[1].generate_batch(batch, NEW, **options) == first  # the same seed, the same calls
    assert seeded[2].generate_batch(batch, NEW, **options) != first
    assert seeded[0].generate_batch(batch, NEW, **options) != first  # its random numbers go on
    assert not {PAD_ID, UNK_ID, BOS_ID, EOS_ID} & {t for c in first for t in c}
    assert ct2.generate_batch(batch, NEW, top_k=1) == ct2.generate_batch(batch, NEW, temperature=0)


# -- specials, </s> and limits ------------------------------------------------------------------------------


def test_specials_are_never_chosen_and_eos_ends(tmp_path):
    specials = {PAD_ID: 60.0, UNK_ID: 60.0, BOS_ID: 60.0}  # the most likely tokens, never chosen
    run_dir = random_run(tmp_path / "specials", {"positions": "rope"}, specials)
    run, ct2 = load_run(run_dir), ExportedGenerator(export_to_ctranslate2(run_dir, tmp_path / "specials-ct2"))
    ids = run.tok.encode_src(["ROMEO:"])[0]
    assert int(run.model(torch.tensor([ids]))[0, -1].argmax()) in specials
    assert ct2.generate_batch([ids], NEW, temperature=0)[0] == greedy(run.model, ids)
    assert len(greedy(run.model, ids)) == NEW
    run_dir = random_run(tmp_path / "eos", {"positions": "rope"}, {EOS_ID: 60.0})
    ct2 = ExportedGenerator(export_to_ctranslate2(run_dir, tmp_path / "eos-ct2"))
    assert ct2.generate_batch([ids], NEW, temperature=0) == [[]]
    assert ct2.generate_batch([ids], NEW, temperature=0, include_eos=True) == [[EOS_ID]]
    assert list(ct2.stream(ids, NEW)) == [] and list(ct2.stream(ids, NEW, include_eos=True)) == [EOS_ID]


def test_requests_outside_the_model_are_user_errors(variant):
    name, run, ct2 = variant
    ids = prompts(run.tok)[1]
    if name in ("gpt2", "post-norm", "none"):  # a table of positions: 64 of them
        assert ct2.context == 64
        with pytest.raises(UserError, match="exceed the export's 64 positions"):
            ct2.generate_batch([ids], 64 - len(ids) + 1, temperature=0)
        assert len(ct2.generate_batch([ids], 64 - len(ids), temperature=0)[0]) <= 64 - len(ids)
    else:
        assert ct2.context is None
    for bad, message in (([[]], "empty"), ([[10_000]], "out of range")):
        with pytest.raises(UserError, match=message):
            ct2.generate_batch(bad, 5)
    with pytest.raises(UserError, match="top-p"):
        ct2.generate_batch([ids], 5, top_p=0.0)
    assert ct2.generate_batch([], 5) == []


# -- the directory, the command line -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory) -> Path:
    return trained_run(tmp_path_factory.mktemp("cli"), VARIANTS["llama"])


def test_cli_export_generate_int8_and_force(llama_run, tmp_path, capsys):
    out, int8 = tmp_path / "f32", tmp_path / "int8"
    code, printed, err = cli(capsys, "export", llama_run, "--to", "ctranslate2", "-o", out)
    assert code == 0 and printed.strip() == str(out), err
    manifest = json.loads((out / MANIFEST).read_text(encoding="utf-8"))
    assert (manifest["task"], manifest["quantization"], manifest["context"]) == ("lm", "float32", None)
    assert is_exported(out) and json.loads((out / "vocabulary.json").read_text(encoding="utf-8")) == \
        pieces_of(Tokenizer.load(llama_run))
    assert manifest["trained_context"] == 16  # the run's data.block_size: a rope model reads past it on request
    greedy_options = ("--prompt", "ROMEO:\n", "--prompt", "the king", "--temperature", "0", "--max-new-tokens", "30",
                      "--beyond-context")
    ours = cli(capsys, "generate", llama_run, *greedy_options)
    assert cli(capsys, "generate", out, *greedy_options) == ours and ours[0] == 0
    stop = ("--stop", ours[1].split("\n---\n")[0][len("ROMEO:\n") + 3:][:2])
    assert cli(capsys, "generate", out, *greedy_options, *stop) == cli(capsys, "generate", llama_run,
                                                                       *greedy_options, *stop)
    sampled = cli(capsys, "generate", out, "--prompt", "ROMEO:", "--num-samples", "2", "--seed", "7")
    assert sampled[0] == 0 and sampled == cli(capsys, "generate", out, "--prompt", "ROMEO:", "--num-samples", "2",
                                              "--seed", "7")
    # int8: smaller, loads, and generates as many tokens (or ends at </s>)
    assert cli(capsys, "export", llama_run, "--to", "ctranslate2", "-o", int8, "--quantization", "int8")[0] == 0
    assert (int8 / "model.bin").stat().st_size < 0.6 * (out / "model.bin").stat().st_size
    quantized = ExportedGenerator(int8, threads=1)
    assert quantized.quantization == "int8"
    ids = quantized.tok.encode_src(["ROMEO:\n", "the king"])
    for continuation in quantized.generate_batch(ids, NEW, temperature=0, include_eos=True):
        assert len(continuation) == NEW or continuation[-1] == EOS_ID
    # --force: as the translation export has it
    refused(cli(capsys, "export", llama_run, "--to", "ctranslate2", "-o", out), "already exists")
    code, _, err = cli(capsys, "export", llama_run, "--to", "ctranslate2", "-o", out, "--force",
                       "--quantization", "int8")
    assert code == 0, err
    assert json.loads((out / MANIFEST).read_text(encoding="utf-8"))["quantization"] == "int8"
    refused(cli(capsys, "export", llama_run, "--to", "ctranslate2", "-o", llama_run, "--force"),
                          "not a CTranslate2 export")
    assert (llama_run / CONFIG_FILE).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f32", "int8"]  # no temporary directory left


def test_unrepresentable_vocabulary_is_one_line_and_writes_nothing(llama_run, tmp_path, capsys, monkeypatch):
    real = Tokenizer.src_pieces_from_ids

    def twice(self, ids):  # "e" spelled by two ids
        pieces = real(self, ids)
        return [("e" if p == "a" else p) for p in pieces]

    monkeypatch.setattr(Tokenizer, "src_pieces_from_ids", twice)
    out = tmp_path / "out"
    refused(cli(capsys, "export", llama_run, "--to", "ctranslate2", "-o", out), "'e' twice",
                          "CTranslate2")
    assert list(tmp_path.iterdir()) == []


def test_exports_of_other_tasks_and_broken_exports(llama_run, tmp_path, capsys):
    out = export_to_ctranslate2(llama_run, tmp_path / "lm")
    with pytest.raises(UserError, match="is an export of a lm run; use `attnkit generate`"):
        ExportedTranslator(out)
    refused(cli(capsys, "translate", out, "-i", "/dev/null"), "use `attnkit generate`")

    def copy(name: str) -> Path:
        target = tmp_path / name
        shutil.copytree(out, target)
        return target

    other = copy("translate")
    manifest = json.loads((other / MANIFEST).read_text(encoding="utf-8"))
    (other / MANIFEST).write_text(json.dumps({**manifest, "task": "translate"}), encoding="utf-8")
    refused(cli(capsys, "generate", other, "--prompt", "R"), "use `attnkit translate`")
    vocabulary = copy("vocabulary")
    pieces = json.loads((vocabulary / "vocabulary.json").read_text(encoding="utf-8"))
    (vocabulary / "vocabulary.json").write_text(json.dumps(pieces[::-1]), encoding="utf-8")
    refused(cli(capsys, "generate", vocabulary, "--prompt", "R"), "does not match")
    truncated = copy("truncated")
    (truncated / "model.bin").write_bytes((out / "model.bin").read_bytes()[:200])
    refused(cli(capsys, "generate", truncated, "--prompt", "R"), "model.bin")
