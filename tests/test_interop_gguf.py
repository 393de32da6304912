"""GGUF files (llama.cpp's format) -> attnkit ``task: lm`` runs, checked against transformers' own GGUF loading
(issue 57, item 5).

Tiny Llama, GPT-2 and Qwen2 models (tests/hf_models.py) are written as GGUF files here (tests/gguf_files.py, what
llama.cpp's converter does) in F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and, from random blocks since the
`gguf` package cannot write them, Q2_K to Q6_K. ``attnkit import FILE.gguf`` must give the tokens, logits and
greedy text transformers gives with ``from_pretrained(DIR, gguf_file=FILE)`` (both dequantize the same bytes), and
a float GGUF the run its Hugging Face directory gives. What attnkit cannot represent is one line naming the key.

transformers' GGUF loader reads GPT-2's ``context_length`` as ``n_ctx`` and leaves ``n_positions`` at 1024, so the
GPT-2 here has 1024 positions.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import tokenizers
import torch
from gguf import GGMLQuantizationType as Q
from tokenizers import Regex, pre_tokenizers

from attnkit.cli import main
from attnkit.inference.language_model import document_stream, read_documents
from attnkit.interop.gguf_tokenizer import LLAMA3_SPLIT
from attnkit.sampling import generate
from attnkit.tasks import load_run
from attnkit.vocab import BOS_ID, EOS_ID, PAD_ID, UNK_ID

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers loads a GGUF only with accelerate installed")
import gguf_files  # noqa: E402  (after the skip: the sources are built with transformers)
import hf_models  # noqa: E402
from test_lm_task import assert_one_line_error  # noqa: E402

TEXTS = hf_models.causal_texts()
PROMPTS = ["The quick", "Größe und", "12 May", "emoji 🙂", "a"]
SOURCES = {"llama": hf_models.llama_dir, "gpt2": lambda out: hf_models.gpt2_dir(out, n_positions=1024),
           "qwen2": hf_models.qwen2_dir,
           # K-quant blocks hold 256 values: rows of 256 and 512, and a tied output (no output.weight)
           "llama-256": lambda out: hf_models.llama_dir(out, hidden_size=256, intermediate_size=512, tie=True, seed=4)}
FILES = [("llama", Q.F32), ("llama", Q.F16), ("llama", Q.BF16), ("llama", Q.Q8_0), ("llama", Q.Q4_0),
         ("llama", Q.Q4_1), ("llama", Q.Q5_0), ("llama", Q.Q5_1), ("gpt2", Q.F32), ("gpt2", Q.Q8_0),
         ("qwen2", Q.F32), ("qwen2", Q.Q4_1), ("llama-256", Q.Q4_K), ("llama-256", Q.Q5_K), ("llama-256", Q.Q6_K),
         ("llama-256", Q.Q2_K), ("llama-256", Q.Q3_K)]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """``source(name)``: the Hugging Face directory of ``SOURCES[name]``, built once."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = SOURCES[name](tmp_path_factory.mktemp(name) / "hf")
        return built[name]

    return get


def write(source, tmp: Path, name: str, qtype: Q = Q.F32, **options) -> Path:
    """A GGUF of source ``name`` alone in a new directory under ``tmp`` (transformers reads the directory)."""
    directory = tmp / f"{name}-{qtype.name}"
    directory.mkdir(parents=True)
    return gguf_files.write_gguf(source(name), directory / "model.gguf", qtype, **options)


@pytest.fixture(scope="module", params=FILES, ids=[f"{n}-{q.name}" for n, q in FILES])
def imported(request, source, tmp_path_factory) -> tuple[Path, Path]:
    """``(GGUF file, the run attnkit import made of it)``."""
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("gguf")
    path = write(source, tmp, *request.param)
    assert main(["import", str(path), "-o", str(tmp / "run")]) == 0
    return path, tmp / "run"


def reference(path: Path):
    """transformers' model and tokenizer of a GGUF file."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_tokens_equal_transformers(imported):
    path, run_dir = imported
    run, (_, tokenizer) = load_run(run_dir), reference(path)
    to_hf = run.tok._src.to_hf
    for text, ids in zip(TEXTS, run.tok.encode_src(TEXTS), strict=True):
        assert [to_hf[i] for i in ids] == tokenizer(text)["input_ids"], text
    assert run.cfg.data.imported_from == str(path.resolve())


def test_logits_loss_and_greedy_text_equal_transformers(imported, capsys):
    path, run_dir = imported
    run, (model, _) = load_run(run_dir), reference(path)
    to_hf, columns = run.tok._src.to_hf, run.tok._src.to_attnkit  # attnkit id -> HF id; HF id -> attnkit column
    for text in TEXTS[:8] + hf_models.TRICKY[-6:-1]:
        ids = run.tok.encode_src([text])[0][:60]
        with torch.no_grad():
            expected = model(torch.tensor([[to_hf[i] for i in ids]])).logits  # (1, T, V_hf)
            got = run.model(torch.tensor([ids]))[..., columns]
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    text_file = run_dir.parent / "held-out.txt"
    text_file.write_text("The quick brown fox, 12 May 1999: Größe!", encoding="utf-8")
    ids = [to_hf[i] for i in document_stream(run.tok, read_documents(str(text_file), "text"))]
    with torch.no_grad():
        loss = model(torch.tensor([ids]), labels=torch.tensor([ids])).loss.item()
    assert main(["evaluate", str(run_dir), "--data", str(text_file)]) == 0
    assert f"loss {loss:.4f} nats/token" in capsys.readouterr().out
    never = [to_hf[i] for i in (PAD_ID, UNK_ID, BOS_ID) if to_hf[i] is not None]  # attnkit never samples these
    for prompt in PROMPTS:
        ids = run.tok.encode_src([prompt])[0]
        got = [to_hf[int(t[0])] for t in generate(run.model, [ids], 16, temperature=0)]
        x = torch.tensor([[to_hf[i] for i in ids]])
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=16,
                             suppress_tokens=never or None, pad_token_id=to_hf[EOS_ID])
        assert got == out[0, x.size(1):].tolist(), prompt


@pytest.mark.parametrize("name, qtype", [("llama", Q.Q4_0), ("gpt2", Q.Q8_0), ("llama-256", Q.Q6_K)])
def test_weights_are_the_files_blocks_dequantized(source, tmp_path, name, qtype):
    """Independently of transformers: a projection of the run is gguf's dequantization of the file's tensor."""
    path = write(source, tmp_path, name, qtype)
    assert main(["import", str(path), "-o", str(tmp_path / "run")]) == 0
    tensor = {t.name: t for t in gguf.GGUFReader(path).tensors}["blk.1.ffn_down.weight"]
    assert tensor.tensor_type == qtype
    values = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy())  # (out, in)
    weight = load_run(tmp_path / "run").model.layers[1].ff.w2.weight
    assert torch.equal(weight.detach(), values)


@pytest.mark.parametrize("name", ["llama", "gpt2", "qwen2"])
def test_a_float_gguf_imports_as_its_huggingface_directory(source, tmp_path, name):
    """The F32 GGUF of a Hugging Face directory gives that directory's run: the same weights (Llama's q and k rows
    permuted there and back), the same tokens (a Llama's merges rebuilt from SentencePiece scores) and logits."""
    path = write(source, tmp_path, name)
    assert main(["import", str(path), "-o", str(tmp_path / "from-gguf")]) == 0
    assert main(["import", str(source(name)), "-o", str(tmp_path / "from-hf")]) == 0
    a, b = load_run(tmp_path / "from-gguf"), load_run(tmp_path / "from-hf")
    assert a.tok.encode_src(TEXTS) == b.tok.encode_src(TEXTS)
    assert a.tok.decode_src(a.tok.encode_src(TEXTS)) == b.tok.decode_src(b.tok.encode_src(TEXTS))
    ours, theirs = a.model.state_dict(), b.model.state_dict()
    for key, value in theirs.items():  # GPT-2's GGUF has an output matrix: wte again, where the directory ties it
        assert torch.equal(ours[key], value), key
    ids = torch.tensor([a.tok.encode_src([TEXTS[3]])[0]])
    with torch.no_grad():
        torch.testing.assert_close(a.model(ids), b.model(ids), atol=1e-5, rtol=1e-5)


#: A pre-tokenizer llama.cpp names -> the one the models' own tokenizer.json writes: SmolLM's digits one by one, then
#: GPT-2's pattern; Llama 3's pattern (three digits at most), a word that is a piece skipping the merges.
NAMED_PRE_TOKENIZERS = {
    "smollm": (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False)]), False),
    "llama-bpe": (pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                                           pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]), True),
}


@pytest.mark.parametrize("pre", list(NAMED_PRE_TOKENIZERS))
def test_named_pre_tokenizers_split_as_the_models_own_tokenizer_json(source, tmp_path, pre):
    """transformers' GGUF loader knows no ``smollm`` and ignores Llama 3's ``ignore_merges``: the reference here is
    the GPT-2 source's byte-level BPE with the model's own pre-tokenizer, imported from its directory."""
    hf = tmp_path / "hf"
    shutil.copytree(source("gpt2"), hf)
    tk = tokenizers.Tokenizer.from_file(str(hf / "tokenizer.json"))
    tk.pre_tokenizer, ignore_merges = NAMED_PRE_TOKENIZERS[pre]  # the models' pipelines: nothing else differs
    settings = json.loads(tk.to_str())
    settings["model"]["ignore_merges"] = ignore_merges
    if ignore_merges:  # a piece no merge makes (the last merge's, renamed), which a word that spells it is, whole
        last, vocab = settings["model"]["merges"].pop(), settings["model"]["vocab"]
        vocab["Ġzebra"] = vocab.pop("".join(last) if isinstance(last, list) else last.replace(" ", ""))
    (hf / "tokenizer.json").write_text(json.dumps(settings))
    (tmp_path / "gguf").mkdir()
    path = gguf_files.write_gguf(hf, tmp_path / "gguf" / "model.gguf", metadata={"tokenizer.ggml.pre": pre})
    assert main(["import", str(path), "-o", str(tmp_path / "from-gguf")]) == 0
    assert main(["import", str(hf), "-o", str(tmp_path / "from-hf")]) == 0
    a, b = load_run(tmp_path / "from-gguf"), load_run(tmp_path / "from-hf")
    texts = TEXTS + ["12345 1234567 x1y22z333", "don't I'LL we've", "a  b\n\n c\t\td", "a zebra, zebras"]
    assert a.tok.encode_src(texts) == b.tok.encode_src(texts)


def test_an_instruct_gguf_keeps_its_template_and_end_of_turn(source, tmp_path):
    """A GGUF names its end of turn beside its end of text (``tokenizer.ggml.eot_token_id``), and ships its chat
    template: the run keeps both, as an imported directory does (``attnkit chat`` stops there)."""
    template = "{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}"
    tk = tokenizers.Tokenizer.from_file(str(source("qwen2") / "tokenizer.json"))
    eot = tk.token_to_id("<|im_end|>")
    path = write(source, tmp_path, "qwen2", metadata={"tokenizer.ggml.eot_token_id": eot,
                                                       "tokenizer.chat_template": template})
    assert main(["import", str(path), "-o", str(tmp_path / "run")]) == 0
    data = load_run(tmp_path / "run").cfg.data
    assert data.end_of_turn == ["<|im_end|>"] and data.chat_template == template


def test_commands_work_on_a_gguf_import_and_it_exports(source, tmp_path, capsys):
    path = write(source, tmp_path, "llama", Q.Q8_0)
    bare = path.with_name("model.bin")  # no suffix: the file's magic says GGUF
    shutil.copy(path, bare)
    assert main(["import", str(bare), "-o", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "run"), "--prompt", "The", "--max-new-tokens", "8",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("The")
    assert main(["export", str(tmp_path / "run"), "--to", "huggingface", "-o", str(tmp_path / "hf")]) == 0
    run = load_run(tmp_path / "run")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    to_hf = run.tok._src.to_hf
    assert [tokenizer(t)["input_ids"] for t in TEXTS] == [[to_hf[i] for i in ids] for ids in run.tok.encode_src(TEXTS)]
    ids = run.tok.encode_src([TEXTS[5]])[0]
    with torch.no_grad():
        torch.testing.assert_close(model(torch.tensor([[to_hf[i] for i in ids]])).logits,
                                   run.model(torch.tensor([ids]))[..., run.tok._src.to_attnkit], atol=1e-5, rtol=1e-5)


# -- what attnkit cannot represent ------------------------------------------------------------------------------


@pytest.mark.parametrize("name, options, message", [
    ("llama", {"arch": "mamba"}, "key 'general.architecture' is 'mamba'; attnkit imports GGUF files of llama"),
    ("llama", {"metadata": {"tokenizer.ggml.model": "bert"}}, "key 'tokenizer.ggml.model' is 'bert'"),
    ("gpt2", {"metadata": {"tokenizer.ggml.pre": "made-up"}}, "key 'tokenizer.ggml.pre' is 'made-up'"),
    ("gpt2", {"metadata": {"tokenizer.ggml.pre": None}}, "missing key 'tokenizer.ggml.pre'"),
    ("gpt2", {"metadata": {"tokenizer.ggml.merges": None}}, "missing key 'tokenizer.ggml.merges'"),
    ("llama", {"types": {"blk.0.attn_q.weight": Q.F64}}, "tensor 'blk.0.attn_q.weight' has type F64"),
    ("llama", {"metadata": {".rope.scaling.type": "linear", ".rope.scaling.factor": 2.0}},
     "key 'llama.rope.scaling.type' is 'linear'"),
    ("llama", {"extra": {"rope_freqs.weight": np.ones(4, np.float32)}}, "tensor 'rope_freqs.weight': RoPE frequency"),
    ("llama", {"metadata": {".rope.dimension_count": 4}}, "key 'llama.rope.dimension_count' is 4"),
    ("llama", {"metadata": {".attention.head_count_kv": 3}}, "'llama.attention.head_count' (4) and 'head_count_kv'"),
    ("llama", {"metadata": {".expert_count": 8}}, "key 'llama.expert_count' is 8"),
    ("llama", {"metadata": {".block_count": None}}, "missing key 'llama.block_count'"),
    ("llama", {"metadata": {".feed_forward_length": 96}},
     "tensor 'blk.0.ffn_gate.weight' has shape (64, 32), but the metadata implies (96, 32)"),
    ("qwen2", {"extra": {"blk.0.attn_output.bias": np.zeros(32, np.float32)}}, "tensor 'blk.0.attn_output.bias'"),
    ("llama", {"metadata": {"tokenizer.ggml.add_eos_token": True}}, "key 'tokenizer.ggml.add_eos_token' is true"),
    ("llama", {"metadata": {"tokenizer.ggml.eos_token_id": None}}, "missing key 'tokenizer.ggml.eos_token_id'"),
    ("llama", {"metadata": {"tokenizer.ggml.bos_token_id": 5000}}, "key 'tokenizer.ggml.bos_token_id' is 5000"),
    ("llama", {"metadata": {"split.count": 2}}, "key 'split.count' is 2"),
], ids=["architecture", "tokenizer-model", "pre-tokenizer", "no-pre-tokenizer", "no-merges", "tensor-type",
        "rope-scaling", "rope-freqs", "partial-rope", "head-count-kv", "experts", "no-block-count", "shape",
        "extra-tensor", "add-eos", "no-eos", "bos-out-of-range", "split"])
def test_what_attnkit_cannot_represent_is_one_line(source, tmp_path, capsys, name, options, message):
    path = write(source, tmp_path, name, **options)
    code = main(["import", str(path), "-o", str(tmp_path / "run")])
    assert_one_line_error(code, capsys.readouterr().err, str(path), message)
    assert not (tmp_path / "run").exists()


def test_a_file_that_is_not_a_whole_gguf_is_one_line(source, tmp_path, capsys):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all")
    assert_one_line_error(main(["import", str(junk), "-o", str(tmp_path / "run")]), capsys.readouterr().err,
                          str(junk), "not a readable GGUF file")
    path = write(source, tmp_path, "llama")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert_one_line_error(main(["import", str(cut), "-o", str(tmp_path / "run")]), capsys.readouterr().err,
                          str(cut))
    assert not (tmp_path / "run").exists()
