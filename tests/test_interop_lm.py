"""Hugging Face causal language models <-> attnkit ``task: lm`` runs, checked against transformers itself (issue 37).

Tiny random GPT-2, Llama (grouped-query attention, untied and tied; a tokenizer like llama2.c's converted ones, which
names no ``unk_token``), Mistral (a sliding window) and Qwen2 (biases on q, k and v; its unused window keys, and a
window in every layer) directories with tokenizers trained here (tests/hf_models.py) are imported with ``attnkit
import``: tokenization, logits, losses and greedy output must equal transformers', and so must the greedy output of
the import's CTranslate2 export. ``attnkit export --to huggingface`` must give back the same directory, and a
character-level run trained here must load in transformers with attnkit's logits and ids.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from attnkit.cli import main
from attnkit.data.tokenizers_json import TOKEN_ID_KEYS, absent_piece
from attnkit.inference.language_model import document_stream, read_documents
from attnkit.interop.hf import HFDirectory
from attnkit.interop.llama import sliding_window
from attnkit.sampling import generate
from attnkit.tasks import load_run
from attnkit.vocab import BOS_ID, EOS_ID, PAD_ID, UNK_ID

transformers = pytest.importorskip("transformers")
import hf_models  # noqa: E402  (after the skip: it builds models with transformers)
from test_lm_task import assert_one_line_error, corpus, lm_config, train_lm  # noqa: E402

TEXTS = hf_models.causal_texts()
PROMPTS = ["The quick", "Größe und", "12 May", "emoji 🙂", "a"]
FAMILIES = {"gpt2": hf_models.gpt2_dir, "llama": hf_models.llama_dir,
            "llama-tied-mha": lambda out: hf_models.llama_dir(out, tie=True, kv_heads=4, seed=1),
            "llama2c": lambda out: hf_models.llama_dir(out, unk=False, seed=4),
            "mistral": lambda out: hf_models.llama_dir(out, model_type="mistral", sliding_window=5, seed=2),
            "qwen2": hf_models.qwen2_dir,
            "qwen2-window": lambda out: hf_models.qwen2_dir(out, window=5, tie=False, kv_heads=4, seed=3)}


@pytest.fixture(scope="module", params=list(FAMILIES))
def imported(request, tmp_path_factory) -> tuple[Path, Path]:
    """``(Hugging Face directory, imported run)`` of each family."""
    return hf_models.imported(tmp_path_factory.mktemp(request.param), FAMILIES[request.param])


def hf_ids(run) -> Sequence[int | None]:
    """The Hugging Face id of each attnkit id (None: an absent id)."""
    return run.tok.original_ids


def columns_of(run) -> list[int]:
    """The attnkit id of each Hugging Face id: the columns of attnkit's logits in Hugging Face's order."""
    to_hf = hf_ids(run)
    columns = [0] * sum(h is not None for h in to_hf)
    for i, h in enumerate(to_hf):
        if h is not None:
            columns[h] = i
    return columns


def hf_model(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def test_tokenization_is_autotokenizers(imported):
    hf, run_dir = imported
    run, reference = load_run(run_dir), transformers.AutoTokenizer.from_pretrained(str(hf))
    to_hf = hf_ids(run)
    for text, ids in zip(TEXTS, run.tok.encode_src(TEXTS), strict=True):
        assert [to_hf[i] for i in ids] == reference(text)["input_ids"], text


def test_logits_and_loss_equal_transformers(imported, tmp_path, capsys):
    hf, run_dir = imported
    run, reference = load_run(run_dir), hf_model(hf)
    to_hf = hf_ids(run)
    columns = columns_of(run)
    for text in TEXTS[:12] + TEXTS[-6:-1]:
        ids = run.tok.encode_src([text])[0][:60]
        if not ids:
            continue
        with torch.no_grad():
            expected = reference(torch.tensor([[to_hf[i] for i in ids]])).logits  # (1, T, V_hf)
            got = run.model(torch.tensor([ids]))[..., columns]
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    # attnkit evaluate: the absent ids take no probability, so the loss is transformers'
    text = "The quick brown fox, 12 May 1999: Größe!"
    (tmp_path / "held-out.txt").write_text(text, encoding="utf-8")
    ids = [to_hf[i] for i in document_stream(run.tok, read_documents(str(tmp_path / "held-out.txt"), "text"))]
    with torch.no_grad():
        loss = reference(torch.tensor([ids]), labels=torch.tensor([ids])).loss.item()
    assert main(["evaluate", str(run_dir), "--data", str(tmp_path / "held-out.txt")]) == 0
    assert f"loss {loss:.4f} nats/token" in capsys.readouterr().out


def greedy_of_transformers(reference, run, ids: list[int], n: int = 20) -> list[int]:
    """transformers' greedy continuation of attnkit's ``ids``, in Hugging Face's ids, never choosing what attnkit
    never samples (its ``<pad>``, ``<unk>`` and ``<s>``)."""
    to_hf = hf_ids(run)
    never = [to_hf[i] for i in (PAD_ID, UNK_ID, BOS_ID) if to_hf[i] is not None]
    x = torch.tensor([[to_hf[i] for i in ids]])
    out = reference.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                             suppress_tokens=never or None, pad_token_id=to_hf[EOS_ID])
    return out[0, x.size(1):].tolist()


def test_greedy_output_equals_generate(imported):
    hf, run_dir = imported
    run, reference = load_run(run_dir), hf_model(hf)
    to_hf = hf_ids(run)
    for prompt in PROMPTS:
        ids = run.tok.encode_src([prompt])[0]
        got = [to_hf[int(t[0])] for t in generate(run.model, [ids], 20, temperature=0)]
        assert got == greedy_of_transformers(reference, run, ids), prompt


def test_the_ctranslate2_export_of_an_import_generates_as_transformers(imported, tmp_path):
    """No two ids spell the same piece (an absent id's name is none of the vocabulary's: llama2.c's ``<unk>``), and
    the export's greedy output is transformers'."""
    pytest.importorskip("ctranslate2")
    from attnkit.export import export_to_ctranslate2
    from attnkit.export.ctranslate2_lm import ExportedGenerator

    hf, run_dir = imported
    run, reference = load_run(run_dir), hf_model(hf)
    pieces = run.tok.src_pieces_from_ids(range(run.tok.src_vocab_size))
    assert len(set(pieces)) == len(pieces)
    ct2 = ExportedGenerator(export_to_ctranslate2(run_dir, tmp_path / "ct2"), threads=1)
    to_hf = hf_ids(run)
    for prompt in PROMPTS:
        ids = run.tok.encode_src([prompt])[0]
        got = [to_hf[i] for i in ct2.generate_batch([ids], 20, temperature=0, include_eos=True)[0]]
        assert got == greedy_of_transformers(reference, run, ids), prompt


def test_qwen2_is_llama_with_biases_on_q_k_and_v(imported):
    hf, run_dir = imported
    settings = json.loads((hf / "config.json").read_text())
    cfg = load_run(run_dir).cfg.model.transformer
    qwen2 = settings["model_type"] == "qwen2"
    assert (cfg.qkv_bias, cfg.bias) == (qwen2, settings["model_type"] == "gpt2")
    if qwen2:  # its sliding_window is read only with use_sliding_window
        assert cfg.window == (settings["sliding_window"] if settings["use_sliding_window"] else 0)


@pytest.mark.parametrize("settings, window", [
    ({"use_sliding_window": False, "sliding_window": 4, "max_window_layers": 0}, 0),
    ({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0}, 4),
    ({"use_sliding_window": True, "sliding_window": 4}, 0),  # Qwen2Config's max_window_layers: 28 > 2 layers
    ({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2}, 0),
    ({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1,
      "layer_types": ["sliding_attention"] * 2}, 4),  # layer_types, where given, is what transformers reads
    ({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0, "layer_types": ["full_attention"] * 2},
     0),
    ({"sliding_window": 4, "max_window_layers": 0}, 0),
], ids=["off", "every-layer", "default-layers", "no-layer", "layer-types", "layer-types-none", "key-absent"])
def test_qwen2s_window_is_every_layers_or_none(tmp_path, settings, window):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "num_hidden_layers": 2, **settings}))
    assert sliding_window(HFDirectory(tmp_path)) == window


def test_commands_work_on_an_import(imported, tmp_path, capsys):
    _, run_dir = imported
    assert main(["generate", str(run_dir), "--prompt", "The", "--max-new-tokens", "8", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("The")
    assert main(["attention", str(run_dir), "--src", "The quick brown fox", "-o", str(tmp_path / "attn"),
                 "--max-new-tokens", "4", "--no-png", "--html"]) == 0
    assert (tmp_path / "attn" / "attention.html").is_file()


def test_export_gives_back_the_checkpoint_and_import_the_run(imported, tmp_path):
    hf, run_dir = imported
    assert main(["export", str(run_dir), "--to", "huggingface", "-o", str(tmp_path / "out")]) == 0
    original = load_file(str(hf / "model.safetensors"))
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(original) == sorted(exported)
    for key, value in original.items():
        torch.testing.assert_close(exported[key], value, atol=0, rtol=0, msg=key)
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()
    settings = json.loads((hf / "config.json").read_text())  # the special ids as the checkpoint has them (Qwen2's
    for name in ("config.json", "generation_config.json"):    # pad is its end-of-text token)
        written = json.loads((tmp_path / "out" / name).read_text())
        assert {k: written[k] for k in TOKEN_ID_KEYS} == {k: settings.get(k) for k in TOKEN_ID_KEYS}, name
    reference = transformers.AutoTokenizer.from_pretrained(str(hf))
    again = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert [again(t)["input_ids"] for t in TEXTS] == [reference(t)["input_ids"] for t in TEXTS]
    x = torch.tensor([reference(TEXTS[0])["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(hf_model(tmp_path / "out")(x).logits, hf_model(hf)(x).logits, atol=1e-5, rtol=0)
    # ... and back: the same run
    assert main(["import", str(tmp_path / "out"), "-o", str(tmp_path / "run")]) == 0
    a, b = load_run(run_dir), load_run(tmp_path / "run")
    assert a.cfg.model == b.cfg.model and a.tok.encode_src(TEXTS) == b.tok.encode_src(TEXTS)
    for (key, value), (key_b, value_b) in zip(a.model.state_dict().items(), b.model.state_dict().items(), strict=True):
        assert key == key_b and torch.equal(value, value_b), key


def test_fine_tuning_an_import_and_exporting_it(imported, tmp_path):
    hf, run_dir = imported
    pre = load_run(run_dir)
    (tmp_path / "train.txt").write_text(" ".join(TEXTS), encoding="utf-8")
    config = {"task": "lm", "data": {"train": str(tmp_path / "train.txt"), "documents": "text",
                                     "valid_fraction": 0.1, "block_size": 16},
              "model": {"init_from": str(run_dir), "transformer": pre.cfg.model.transformer.__dict__},
              "train": {"max_updates": 3, "valid_every": 3, "progress": False, "threads": 1, "precision": "fp32",
                        "max_tokens": 64, "average_last": 0, "warmup": 1}}
    (tmp_path / "ft.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    assert main(["train", str(tmp_path / "ft.yaml"), "--run-dir", str(tmp_path / "ft")]) == 0
    fine = load_run(tmp_path / "ft")
    assert fine.tok.encode_src(TEXTS) == pre.tok.encode_src(TEXTS)
    changed = [k for k, v in fine.model.state_dict().items() if not torch.equal(v, pre.model.state_dict()[k])]
    assert changed and all(torch.isfinite(v).all() for v in fine.model.state_dict().values())
    assert main(["export", str(tmp_path / "ft"), "--to", "huggingface", "-o", str(tmp_path / "out")]) == 0
    ids = pre.tok.encode_src([TEXTS[3]])[0]
    with torch.no_grad():
        expected = fine.model(torch.tensor([ids]))[..., columns_of(fine)]
        got = hf_model(tmp_path / "out")(torch.tensor([[hf_ids(fine)[i] for i in ids]])).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


# -- attnkit's own language models out --------------------------------------------------------------------------

GPT2_LIKE = {"positions": "learned", "activation": "gelu_tanh", "scale_embeddings": False}
LLAMA_LIKE = {"positions": "rope", "norm": "rmsnorm", "activation": "swiglu", "bias": False, "n_kv_heads": 1,
              "scale_embeddings": False, "tie_output": False, "rope_theta": 1000.0}
QWEN2_LIKE = {**LLAMA_LIKE, "qkv_bias": True}


@pytest.mark.parametrize("options, architecture", [
    (GPT2_LIKE, "GPT2LMHeadModel"), ({**GPT2_LIKE, "bias": False, "activation": "gelu"}, "GPT2LMHeadModel"),
    (LLAMA_LIKE, "LlamaForCausalLM"), ({**LLAMA_LIKE, "window": 4}, "MistralForCausalLM"),
    (QWEN2_LIKE, "Qwen2ForCausalLM"), ({**QWEN2_LIKE, "window": 4}, "Qwen2ForCausalLM"),
], ids=["gpt2", "nanogpt", "llama", "mistral", "qwen2", "qwen2-window"])
def test_a_trained_character_model_exports(options, architecture, tmp_path):
    (tmp_path / "train.txt").write_text(corpus(200), encoding="utf-8")
    train_lm(lm_config(tmp_path / "train.txt", model=options, train_options={"max_updates": 4, "valid_every": 4}),
             tmp_path / "run")
    assert main(["export", str(tmp_path / "run"), "--to", "huggingface", "-o", str(tmp_path / "hf")]) == 0
    run = load_run(tmp_path / "run")
    # transformers 5's AutoTokenizer builds Qwen2's own byte-level BPE for any qwen2 directory, whatever its
    # tokenizer_class; PreTrainedTokenizerFast reads tokenizer.json as written (docs/language-models.md)
    reading = transformers.PreTrainedTokenizerFast if architecture == "Qwen2ForCausalLM" else transformers.AutoTokenizer
    reference, tokenizer = hf_model(tmp_path / "hf"), reading.from_pretrained(str(tmp_path / "hf"))
    assert type(reference).__name__ == architecture
    if options.get("qkv_bias"):  # trained biases on q, k and v, and none on o_proj or the MLP
        assert run.model.layers[0].self_attn.in_proj.bias.abs().max() > 0
        layer = reference.model.layers[0]
        assert layer.self_attn.q_proj.bias is not None and layer.self_attn.o_proj.bias is None
        assert reference.config.use_sliding_window == bool(options.get("window"))
    texts = corpus(12, seed=4).splitlines() + ["ROMEO: sweet night", "Zebra - unknown\tcharacters", "</s> <pad> x"]
    for text in texts:
        assert tokenizer(text)["input_ids"] == run.tok.encode_src([text])[0], text
    ids = torch.tensor([run.tok.encode_src([texts[1] + " " + texts[2]])[0][:40]])
    with torch.no_grad():
        torch.testing.assert_close(reference(ids).logits, run.model(ids), atol=1e-4, rtol=1e-4)
        out = reference.generate(ids[:, :5], attention_mask=torch.ones_like(ids[:, :5]), do_sample=False,
                                 max_new_tokens=10)
    assert out[0, 5:].tolist() == [int(t[0]) for t in generate(run.model, ids[:, :5], 10, temperature=0)]
    assert main(["import", str(tmp_path / "hf"), "-o", str(tmp_path / "back")]) == 0
    back = load_run(tmp_path / "back")
    # the same model: the options a language model does not read (encoder_layers) or leaves at their default
    # (norm_first: None is pre-norm) are written out
    # bias: false goes out as GPT-2's biases, all zero, and comes back as them
    zero_biases = options["positions"] == "learned" and options.get("bias") is False
    assert back.cfg.model.transformer == replace(run.cfg.model.transformer, encoder_layers=0, norm_first=True,
                                                 bias=run.cfg.model.transformer.bias or zero_biases)
    assert back.tok.encode_src(texts) == run.tok.encode_src(texts)
    ours, theirs = run.model.state_dict(), back.model.state_dict()
    for key, value in theirs.items():
        assert torch.equal(value, ours[key]) if key in ours else (zero_biases and not value.any()), key


@pytest.mark.parametrize("model, message", [
    ({"positions": "alibi"}, "model.transformer.positions: alibi has no equivalent"),
    ({**LLAMA_LIKE, "bias": True, "window": 4}, "model.transformer.bias: True has no equivalent"),  # Mistral: none
])
def test_export_refuses_what_huggingface_cannot_hold(tmp_path, capsys, model, message):
    (tmp_path / "train.txt").write_text(corpus(120), encoding="utf-8")
    train_lm(lm_config(tmp_path / "train.txt", model=model, train_options={"max_updates": 1}), tmp_path / "run")
    capsys.readouterr()
    code = main(["export", str(tmp_path / "run"), "--to", "huggingface", "-o", str(tmp_path / "hf")])
    assert_one_line_error(code, capsys.readouterr().err, message)
    assert not (tmp_path / "hf").exists()


# -- what attnkit cannot represent --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("sources")
    return {"gpt2": hf_models.gpt2_dir(tmp / "gpt2"), "llama": hf_models.llama_dir(tmp / "llama"),
            "qwen2": hf_models.qwen2_dir(tmp / "qwen2")}


@pytest.mark.parametrize("family, file, changes, message", [
    ("gpt2", "config.json", {"add_cross_attention": True}, "key 'add_cross_attention' is True"),
    ("gpt2", "config.json", {"activation_function": "gelu_fast"}, "key 'activation_function' is 'gelu_fast'"),
    ("gpt2", "config.json", {"scale_attn_by_inverse_layer_idx": True}, "key 'scale_attn_by_inverse_layer_idx'"),
    ("llama", "config.json", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "key 'rope_scaling' has rope"),
    ("llama", "config.json", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
     "key 'rope_parameters' has rope type 'yarn'"),
    ("llama", "config.json", {"hidden_act": "gelu"}, "key 'hidden_act' is 'gelu', which attnkit cannot represent"),
    ("llama", "config.json", {"attention_bias": True}, "keys 'attention_bias' (True) and 'mlp_bias' (False) differ"),
    ("llama", "config.json", {"head_dim": 16}, "key 'head_dim' is 16"),
    ("llama", "config.json", {"eos_token_id": [2, "</s>"]}, "key 'eos_token_id' is [2, '</s>']"),
    ("llama", "tokenizer_config.json", {"add_eos_token": True}, "key 'add_eos_token' is true"),
    ("llama", "config.json", {"vocab_size": 100}, "more than config.json key 'vocab_size' (100)"),
    ("qwen2", "config.json", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
     "key 'use_sliding_window' is true with a window in 1 of 2 layers (max_window_layers 1)"),
    ("qwen2", "config.json", {"use_sliding_window": True, "sliding_window": 4,
                              "layer_types": ["full_attention", "sliding_attention"]},
     "key 'use_sliding_window' is true with a window in 1 of 2 layers (layer_types)"),
    ("qwen2", "config.json", {"use_sliding_window": True, "sliding_window": 4, "layer_types": ["chunked"] * 2},
     "key 'layer_types' is ['chunked', 'chunked']"),
    ("qwen2", "config.json", {"use_sliding_window": True, "sliding_window": 0, "max_window_layers": 0},
     "key 'sliding_window' is 0"),
])
def test_unsupported_configs_are_one_line_errors(sources, tmp_path, capsys, family, file, changes, message):
    bad = tmp_path / "bad"
    shutil.copytree(sources[family], bad)
    settings = json.loads((bad / file).read_text())
    (bad / file).write_text(json.dumps({**settings, **changes}))
    (bad / "generation_config.json").unlink(missing_ok=True)
    code = main(["import", str(bad), "-o", str(tmp_path / "run")])
    assert_one_line_error(code, capsys.readouterr().err, message, str(bad / file) if "vocab_size" not in changes
                          else "tokenizer.json")
    assert not (tmp_path / "run").exists()


def test_an_absent_id_is_named_by_no_piece_of_the_vocabulary():
    assert absent_piece("<unk>", {"<s>", "</s>"}) == "<unk>"  # GPT-2's and Llama's: attnkit's own name
    assert absent_piece("<unk>", {"<unk>", "<s>"}) == "<attnkit-unk>"  # llama2.c's: <unk>, but no unk_token
    assert absent_piece("<unk>", {"<unk>", "<attnkit-unk>"}) == "<attnkit-unk-2>"
    assert absent_piece("<s>", {"<s>"}) == "<attnkit-s>"


def test_the_checkpoints_special_ids_are_kept_and_checked(sources, tmp_path, capsys):
    """The import keeps config.json's bos/eos/pad ids for the export (Qwen2's pad is its end-of-text token); ids that
    are not ids are a one-line error; an import without them (an older attnkit's) exports the ids its renumbering
    implies."""
    assert main(["import", str(sources["qwen2"]), "-o", str(tmp_path / "run")]) == 0
    meta_path = tmp_path / "run" / "tokenizer.json"
    meta = json.loads(meta_path.read_text())
    eot = json.loads((sources["qwen2"] / "config.json").read_text())["eos_token_id"]
    assert meta["hf_token_ids"] == {"bos_token_id": eot, "eos_token_id": eot, "pad_token_id": eot}
    assert meta["specials"] == [None, None, None, eot]  # one piece: attnkit's pad, unk and bos are added rows
    meta_path.write_text(json.dumps({**meta, "hf_token_ids": {"pad_token_id": "x"}}))
    capsys.readouterr()
    code = main(["generate", str(tmp_path / "run"), "--prompt", "a", "--max-new-tokens", "2"])
    assert_one_line_error(code, capsys.readouterr().err, str(meta_path), "hf_token_ids")
    meta_path.write_text(json.dumps({k: v for k, v in meta.items() if k != "hf_token_ids"}))
    assert main(["export", str(tmp_path / "run"), "--to", "huggingface", "-o", str(tmp_path / "out")]) == 0
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert {k: written[k] for k in TOKEN_ID_KEYS} == {"bos_token_id": eot, "eos_token_id": eot, "pad_token_id": None}


# -- streamed text --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stop", [(), ("xyz",)])
def test_streamed_text_is_the_prompts_continuation_through_split_characters(imported, stop):
    """TextStream on a byte-level tokenizer (GPT-2's BPE, Llama's byte fallback) and Llama's space-stripping decoder:
    the pieces add up to the text after the prompt, as the tokenizer decodes prompt + continuation; an emoji spelt
    over several tokens is never shown half (U+FFFD), and the anchor's moves (TextStream.SPAN) change nothing."""
    from attnkit.inference.language_model import TextStream

    run = load_run(imported[1])
    prompt = run.tok.encode_src(["The quick"])[0]
    for text in ["brown fox 🙂 jumps — über 12 Größe " * 3, "🙂🙂 x", " a b  c"]:
        continuation = run.tok.encode_src([text])[0]
        if continuation and continuation[0] == BOS_ID:  # Llama's <s> belongs in front of the prompt only
            continuation = continuation[1:]
        stream = TextStream(run.tok, stop, context=prompt)
        pieces = [stream.add(t) for t in continuation] + [stream.flush()]
        whole = run.tok.decode_src([prompt + continuation])[0]
        expected = whole[len(run.tok.decode_src([prompt])[0]):]
        assert "".join(pieces) == expected == stream.text, (text, pieces)
        assert not any("\ufffd" in p for p in pieces)
