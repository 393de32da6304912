"""Hugging Face Marian <-> attnkit, checked against transformers itself (issue 26).

A tiny random MarianMTModel and MarianTokenizer (tests/hf_models.py) are imported with ``attnkit import``;
logits, greedy output and tokenization must equal transformers'. attnkit runs exported with
``attnkit export --to huggingface`` must load in transformers and give attnkit's logits and translations,
and come back through ``attnkit import`` translating identically, also through CTranslate2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attnkit.cli import main
from attnkit.export.ctranslate2 import export_ctranslate2
from attnkit.inference.translate import translate_texts
from attnkit.interop.marian import hf_order
from attnkit.tasks import load_run
from attnkit.vocab import BOS_ID, EOS_ID, PAD_ID

transformers = pytest.importorskip("transformers")
import hf_models  # noqa: E402  (after the skip: it builds models with transformers)

TEXTS = hf_models.sentences(60, seed=11)[:40] + hf_models.ACCENTED + ["", "x", "Datum: 3. März 1999 ☃ 𝄞"]


@pytest.fixture(scope="module")
def marian(tmp_path_factory) -> tuple[Path, Path]:
    """``(Hugging Face directory, imported run)``."""
    return hf_models.imported(tmp_path_factory.mktemp("marian"), hf_models.marian_dir)


def hf_model(path: Path):
    return transformers.MarianMTModel.from_pretrained(str(path)).eval()


def hf_tokenizer(path: Path):
    return transformers.MarianTokenizer.from_pretrained(str(path))


def renumbered(hf_ids: torch.Tensor, order: list[int]) -> torch.Tensor:
    """Marian ids -> attnkit ids (``order[i]`` is the Marian id of attnkit id ``i``; ``<s>`` is never an input)."""
    back = {m: i for i, m in enumerate(order) if i != BOS_ID}
    return hf_ids.clone().apply_(lambda m: back[m])


def order_of(run: Path) -> list[int]:
    pieces = json.loads((run / "vocab.json").read_text(encoding="utf-8"))
    hf_vocab = json.loads((Path(load_run(run).cfg.data.imported_from) / "vocab.json").read_text(encoding="utf-8"))
    return [hf_vocab[p] if i != BOS_ID else hf_vocab["<pad>"] for i, p in enumerate(pieces)]


def test_tokenization_is_marian_tokenizers(marian):
    hf, run = marian
    tok, order = load_run(run).tok, order_of(run)
    reference = hf_tokenizer(hf)
    texts = TEXTS + [">>fr<< " + t for t in TEXTS[:20]]
    for text in texts:
        expected = reference(text)["input_ids"][:-1]  # without the </s> it appends
        assert [order[i] for i in tok.encode_src([text])[0]] == expected, text
        target = reference(text_target=text)["input_ids"][:-1]
        assert [order[i] for i in tok.encode_tgt([text])[0]] == target, text


def test_logits_equal_transformers(marian):
    hf, run = marian
    model, reference, order = load_run(run).model, hf_model(hf), order_of(run)
    batch = hf_tokenizer(hf)(TEXTS[:16], text_target=TEXTS[16:32], padding=True, return_tensors="pt")
    pad = reference.config.pad_token_id
    tgt_in = torch.cat([torch.full((16, 1), pad), batch["labels"][:, :-1]], dim=1)
    with torch.no_grad():
        expected = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             decoder_input_ids=tgt_in).logits  # (B, T, V)
        src = renumbered(batch["input_ids"], order)
        tgt = renumbered(tgt_in, order)
        tgt[:, 0] = BOS_ID
        got = model(src, tgt)  # (B, T, V + 1)
    real = tgt_in != pad
    real[:, 0] = True
    keep = [i for i in range(len(order)) if i not in (BOS_ID, PAD_ID)]
    torch.testing.assert_close(got[real][:, keep], expected[real][:, [order[i] for i in keep]], atol=1e-4, rtol=1e-4)
    assert torch.isinf(got[..., BOS_ID]).all() and torch.isinf(got[..., PAD_ID]).all()  # never emitted


def test_greedy_is_generates_token_for_token(marian, tmp_path, capsys):
    hf, run = marian
    reference, tokenizer = hf_model(hf), hf_tokenizer(hf)
    texts = [t for t in TEXTS if t][:24]
    expected = []
    for text in texts:  # one at a time: each with attnkit's budget of len(source) + 50 tokens
        ids = tokenizer([text], return_tensors="pt")
        out = reference.generate(**ids, num_beams=1, do_sample=False, max_new_tokens=ids["input_ids"].size(1) + 50)
        expected.append(tokenizer.decode(out[0], skip_special_tokens=True))
    (tmp_path / "in.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    assert main(["translate", str(run), "-i", str(tmp_path / "in.txt"), "-o", str(tmp_path / "out.txt"),
                 "--beam", "1"]) == 0
    assert (tmp_path / "out.txt").read_text(encoding="utf-8").splitlines() == expected


def test_every_command_works_on_the_import(marian, tmp_path, capsys):
    _, run = marian
    (tmp_path / "src.txt").write_text("\n".join(TEXTS[:5]) + "\n", encoding="utf-8")
    (tmp_path / "ref.txt").write_text("\n".join(TEXTS[5:10]) + "\n", encoding="utf-8")
    assert main(["evaluate", str(run), "--src", str(tmp_path / "src.txt"), "--ref", str(tmp_path / "ref.txt")]) == 0
    assert main(["attention", str(run), "--src", TEXTS[0], "-o", str(tmp_path / "attn"), "--html"]) == 0
    assert any((tmp_path / "attn").iterdir())
    # CTranslate2 takes the import unchanged: swish, positions in halves, the output bias
    ct2 = export_ctranslate2(run, tmp_path / "ct2")
    loaded = load_run(run)
    ours = translate_texts(loaded.model, loaded.tok, TEXTS[:20], beam=1)
    assert main(["translate", str(ct2), "-i", str(tmp_path / "src.txt"), "-o", str(tmp_path / "ct2.txt"),
                 "--beam", "1"]) == 0
    assert (tmp_path / "ct2.txt").read_text(encoding="utf-8").splitlines() == [t[0] for t in ours[:5]]


def exported_round_trip(run: Path, tmp: Path) -> tuple[Path, Path]:
    assert main(["export", str(run), "--to", "huggingface", "-o", str(tmp / "hf-out")]) == 0
    assert main(["import", str(tmp / "hf-out"), "-o", str(tmp / "back")]) == 0
    return tmp / "hf-out", tmp / "back"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A tiny attnkit date-normalising run (interleaved positions, relu, no output bias: attnkit's defaults)."""
    from test_export import tiny_config, train

    return train(tmp_path_factory.mktemp("trained"), tiny_config(norm_first=False, updates=120))


@pytest.mark.parametrize("which", ["trained", "marian"])
def test_export_to_huggingface_and_back(which, trained, marian, tmp_path):
    run = trained if which == "trained" else marian[1]
    out, back = exported_round_trip(run, tmp_path)
    ours = load_run(run)
    reference, tokenizer = hf_model(out), hf_tokenizer(out)
    texts = [t for t in TEXTS if t][:16]
    # logits: attnkit id i is Marian id hf_order.index(i)
    order = hf_order(ours.tok.tgt_vocab_size)
    src_ids = [ids + [EOS_ID] for ids in ours.tok.encode_src(texts)]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    assert [[order[i] for i in row if i != reference.config.pad_token_id] for row in batch["input_ids"].tolist()] \
        == src_ids
    hyps = translate_texts(ours.model, ours.tok, texts, beam=1, max_len_a=0, max_len_b=60)  # generate's budget
    with torch.no_grad():
        generated = reference.generate(**batch, num_beams=1, do_sample=False, max_new_tokens=60)
    assert tokenizer.batch_decode(generated, skip_special_tokens=True) == [h[0] for h in hyps]
    tgt = [[BOS_ID] + ids for ids in ours.tok.encode_tgt(texts)]
    width = max(map(len, tgt))
    tgt_t = torch.tensor([row + [PAD_ID] * (width - len(row)) for row in tgt])
    src_t = torch.tensor([row + [PAD_ID] * (batch["input_ids"].size(1) - len(row)) for row in src_ids])
    index = {a: m for m, a in enumerate(order)}
    pad = reference.config.pad_token_id
    with torch.no_grad():
        got = ours.model(src_t, tgt_t)
        expected = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             decoder_input_ids=tgt_t.clone().apply_(lambda a: index.get(a, pad))).logits
    real = tgt_t != PAD_ID
    keep = [a for a in range(4, ours.tok.tgt_vocab_size)] + [EOS_ID, 1]
    torch.testing.assert_close(got[real][:, keep], expected[real][:, [index[a] for a in keep]], atol=1e-4, rtol=1e-4)
    # and back into attnkit: the same translations, greedy and beam
    again = load_run(back)
    for beam in (1, 4):
        assert translate_texts(again.model, again.tok, texts, beam=beam) == \
            translate_texts(ours.model, ours.tok, texts, beam=beam)


def one_line_error(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("attnkit: error: ") and "\n" not in err and "Traceback" not in err
    return err


def edited(hf: Path, tmp: Path, **changes) -> Path:
    """A copy of ``hf`` with config.json keys changed (None deletes one)."""
    import shutil

    out = tmp / "edited"
    shutil.copytree(hf, out)
    config = json.loads((out / "config.json").read_text())
    for key, value in changes.items():
        config.pop(key) if value is None else config.__setitem__(key, value)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("changes, message", [
    ({"model_type": "t5"}, "key 'model_type' is 't5'; attnkit imports marian, bert"),
    ({"vocab_size": 999}, "but config.json key 'vocab_size' is 999"),
    ({"activation_function": "gelu_new"}, "key 'activation_function' is 'gelu_new', which attnkit cannot represent"),
    ({"decoder_ffn_dim": 32}, "'encoder_ffn_dim' 64, 'decoder_ffn_dim' 32 differ"),
    ({"share_encoder_decoder_embeddings": False}, "key 'share_encoder_decoder_embeddings' is False"),
    ({"d_model": None}, "config.json: missing key 'd_model'"),
])
def test_unsupported_configs_are_one_line_errors(marian, tmp_path, capsys, changes, message):
    bad = edited(marian[0], tmp_path, **changes)
    err = one_line_error(capsys, "import", str(bad), "-o", str(tmp_path / "run"))
    assert message in err and str(bad) in err
    assert not (tmp_path / "run").exists() and not list(tmp_path.glob(".run*"))  # nothing half-written


def test_missing_files_and_unsafe_pickles(marian, tmp_path, capsys):
    hf = edited(marian[0], tmp_path)
    (hf / "target.spm").unlink()
    assert "target.spm: missing (MarianTokenizer's files" in one_line_error(
        capsys, "import", str(hf), "-o", str(tmp_path / "run"))
    (hf / "target.spm").write_bytes((marian[0] / "target.spm").read_bytes())
    # a pytorch_model.bin of plain tensors is read with weights_only=True ...
    from safetensors.torch import load_file
    torch.save(load_file(str(hf / "model.safetensors")), hf / "pytorch_model.bin")
    (hf / "model.safetensors").unlink()
    assert main(["import", str(hf), "-o", str(tmp_path / "from-bin")]) == 0
    # ... and one that needs more than tensors is refused, naming the file and how to convert it
    weights = load_file(str(marian[0] / "model.safetensors"))
    torch.save({"weights": weights, "extra": Path("x")}, hf / "pytorch_model.bin")
    err = one_line_error(capsys, "import", str(hf), "-o", str(tmp_path / "run"))
    assert "pytorch_model.bin: cannot be read safely as tensors" in err and "save_pretrained" in err
    assert one_line_error(capsys, "import", str(tmp_path / "nowhere"), "-o", str(tmp_path / "run")).endswith(
        "not a directory; give a local Hugging Face model directory (config.json, model.safetensors, tokenizer "
        "files), or a GGUF file")
    assert "already exists" in one_line_error(capsys, "import", str(marian[0]), "-o", str(marian[1]))


def test_export_refuses_what_marian_cannot_hold(tmp_path, capsys):
    from test_export import tiny_config, train

    run = train(tmp_path, tiny_config(norm_first=True, updates=2))
    capsys.readouterr()
    assert "cannot be exported to Hugging Face Marian: it is pre-norm" in one_line_error(
        capsys, "export", str(run), "--to", "huggingface", "-o", str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()
