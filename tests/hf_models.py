"""Tiny, randomly initialised Hugging Face Marian and BERT directories, built with transformers (no download).

Shared by tests/test_interop_*.py. Every weight is perturbed away from its initial value (LayerNorms
of 1 and 0, a zero ``final_logits_bias``) so that a mapping error cannot hide behind an identity.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import sentencepiece as spm
import torch

from attnkit.cli import main
from attnkit.data import dates

ACCENTED = ["Größe und Übermaß: 12,5 % mehr!", "café crème, déjà vu — naïve façade", "Ελληνικά και русский 2024",
            "¿Qué tal? ¡Muy bien!", "numbers 0123456789 and symbols #@&*()[]{}", "Ein Hund läuft über die Straße."]


def sentences(n: int = 300, seed: int = 3) -> list[str]:
    """Varied text: date phrasings (many digits and month names) and accented, punctuated sentences."""
    pairs = dates.generate_pairs(n, seed=seed, split="train")
    return [s for s, _ in pairs] + [t for _, t in pairs] + ACCENTED * 3


def train_spm(path: Path, texts: list[str], vocab_size: int) -> Path:
    """A unigram SentencePiece model as Marian ships them (its own ids are not the model's)."""
    spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_prefix=str(path), vocab_size=vocab_size,
                                   model_type="unigram", character_coverage=0.98, minloglevel=2, num_threads=1)
    return path.with_suffix(".model")


def perturb(model: torch.nn.Module, seed: int) -> None:
    """Move every parameter and float buffer off its initial value (deterministically)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def marian_dir(out: Path, *, activation: str = "swish", seed: int = 0, **config) -> Path:
    """A tiny MarianMTModel + MarianTokenizer directory like OPUS-MT's (swish, scaled embeddings, pad banned)."""
    from transformers import MarianConfig, MarianMTModel, MarianTokenizer

    out.mkdir(parents=True, exist_ok=True)
    work = out / "_spm"
    work.mkdir(exist_ok=True)
    texts = sentences()
    src = train_spm(work / "source", texts, 160)
    tgt = train_spm(work / "target", texts, 130)  # another model: source and target pieces differ
    pieces: list[str] = []
    for model_file in (src, tgt):
        sp = spm.SentencePieceProcessor(model_file=str(model_file))
        pieces += [sp.id_to_piece(i) for i in range(sp.get_piece_size())
                   if not sp.is_control(i) and not sp.is_unknown(i)]
    pieces = list(dict.fromkeys(pieces))
    vocab = {"</s>": 0, "<unk>": 1, **{p: i + 2 for i, p in enumerate(pieces)}}
    vocab[">>fr<<"] = len(vocab)
    vocab["<pad>"] = len(vocab)
    (work / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    tok = MarianTokenizer(source_spm=str(src), target_spm=str(tgt), vocab=str(work / "vocab.json"),
                          source_lang="de", target_lang="en")
    pad = vocab["<pad>"]
    cfg = MarianConfig(vocab_size=len(vocab), decoder_vocab_size=len(vocab), d_model=32, encoder_layers=2,
                       decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                       decoder_ffn_dim=64, activation_function=activation, max_position_embeddings=128,
                       scale_embedding=True, pad_token_id=pad, eos_token_id=0, decoder_start_token_id=pad,
                       forced_eos_token_id=None, share_encoder_decoder_embeddings=True, **config)
    torch.manual_seed(seed)
    model = MarianMTModel(cfg).eval()
    perturb(model, seed)
    with torch.no_grad():
        model.final_logits_bias.copy_(torch.randn(model.final_logits_bias.shape, generator=torch.Generator()
                                                  .manual_seed(seed + 1)))
        model.final_logits_bias[0, 0] += 1.5  # </s> often enough that outputs have different lengths
    model.generation_config.bad_words_ids = [[pad]]
    model.generation_config.forced_eos_token_id = None
    model.generation_config.num_beams = 4
    model.generation_config.max_length = 128
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def bert_dir(out: Path, architecture: str = "BertForSequenceClassification", seed: int = 0,
             tokenizer_json: bool = True, **config) -> Path:
    """A tiny BERT directory with a WordPiece vocabulary whose specials sit where BERT's do (not 0..3)."""
    import transformers
    from transformers import BertConfig, BertTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    words = sorted({w.lower().strip(".,!?:;") for s in sentences(200) for w in s.split()} - {""})
    letters = sorted({c for w in words for c in w})
    vocab = ["[PAD]"] + [f"[unused{i}]" for i in range(3)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab += letters + [f"##{c}" for c in letters] + [".", ",", "!", "?", "%", "-"] + words[:150]
    pieces = list(dict.fromkeys(vocab))
    tok = BertTokenizerFast(vocab={p: i for i, p in enumerate(pieces)}, do_lower_case=True)
    size = len(pieces)
    cfg = BertConfig(vocab_size=size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64, type_vocab_size=2,
                     id2label={0: "negative", 1: "positive"}, label2id={"negative": 0, "positive": 1}, **config)
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(cfg).eval()
    perturb(model, seed)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "vocab.txt").write_text("\n".join(pieces) + "\n", encoding="utf-8")  # as older checkpoints ship it
    if not tokenizer_json:
        (out / "tokenizer.json").unlink()
    return out


def imported(tmp: Path, make_dir: Callable[[Path], Path]) -> tuple[Path, Path]:
    """``(Hugging Face directory, imported run)``: ``make_dir`` writes the directory under ``tmp``, then
    ``attnkit import`` reads it into ``tmp / "run"`` (one thread, as the tests compare numbers)."""
    torch.set_num_threads(1)
    hf = make_dir(tmp / "hf")
    assert main(["import", str(hf), "-o", str(tmp / "run")]) == 0
    return hf, tmp / "run"
