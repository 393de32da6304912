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


# -- causal language models: GPT-2, Llama, Mistral, Qwen2 -----------------------------------------------------

#: Text that trips tokenizers: accents, emoji and other scripts, digits, runs of whitespace, newlines, tabs, and
#: special pieces written in the text.
TRICKY = ["", " ", "  leading and trailing  ", "tabs\tand\nnewlines\n\n", "emoji 🙂🚀 and ☃ 𝄞", "北京 東京 서울",
          "x" * 40, "1234567890 3.14159 1e-5 0x1F", "mixed CASE Words AND  double  spaces", "don't stop—ever…",
          "<s> and </s> and <|endoftext|> in text", "ﬁne ligature and Ω ohm", "a\u00a0non-breaking space"]


def causal_texts(n: int = 300, seed: int = 7) -> list[str]:
    """A few hundred varied texts: :func:`sentences` and :data:`TRICKY`."""
    return sentences(n // 2, seed=seed)[:n - len(TRICKY)] + TRICKY


def gpt2_tokenizer(out: Path, texts: list[str]):
    """GPT-2's kind of tokenizer, trained here: byte-level BPE, ``<|endoftext|>`` the last id, no BOS added."""
    import tokenizers
    from tokenizers import decoders, pre_tokenizers, processors, trainers
    from tokenizers.models import BPE

    tk = tokenizers.Tokenizer(BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    tk.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=420, show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tk.add_special_tokens([tokenizers.AddedToken("<|endoftext|>", special=True, normalized=False)])
    tk.save(str(out / "tokenizer.json"))
    settings = {"tokenizer_class": "GPT2Tokenizer", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
                "unk_token": "<|endoftext|>", "add_prefix_space": False, "model_max_length": 64}
    (out / "tokenizer_config.json").write_text(json.dumps(settings), encoding="utf-8")
    return tk


def llama_tokenizer(out: Path, texts: list[str], *, unk: bool = True, trained: int = 360):
    """Llama's kind of tokenizer, trained here: BPE over ``▁``-prefixed words with byte fallback (a small alphabet,
    so accents and emoji fall back to ``<0xNN>`` pieces), ``<unk> <s> </s>`` at 0..2, ``<s>`` added in front.
    ``unk=False``: as llama2.c's converted tokenizers, the BPE model names no ``unk_token`` (``<unk>`` stays a
    special piece at 0, which no text encodes to). ``trained``: the BPE trainer's vocabulary (specials, alphabet and
    merges); the tokenizer has 256 pieces more (the bytes), when the texts have that many merges to learn."""
    import tokenizers
    from tokenizers import decoders, pre_tokenizers, processors, trainers
    from tokenizers.models import BPE

    specials = ["<unk>", "<s>", "</s>"]
    trainee = tokenizers.Tokenizer(BPE(unk_token="<unk>"))
    trainee.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    trainee.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=trained, special_tokens=specials,
                                                           limit_alphabet=60, show_progress=False))
    model = json.loads(trainee.to_str())["model"]
    learned = sorted((i, p) for p, i in model["vocab"].items() if p not in specials)
    vocab = {p: i for i, p in enumerate(specials + [f"<0x{b:02X}>" for b in range(256)] + [p for _, p in learned])}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tk = tokenizers.Tokenizer(BPE(vocab, merges, unk_token="<unk>" if unk else None, byte_fallback=True,
                                  fuse_unk=unk))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                      special_tokens=[("<s>", 1)])
    tk.add_special_tokens([tokenizers.AddedToken(p, special=True, normalized=False) for p in specials])
    tk.save(str(out / "tokenizer.json"))
    settings = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                "add_bos_token": True, "add_eos_token": False, "legacy": False, "model_max_length": 128}
    (out / "tokenizer_config.json").write_text(json.dumps(settings), encoding="utf-8")
    return tk


#: Qwen2's pre-tokenizer pattern (its tokenizer.json, and transformers' ``Qwen2Tokenizer``): every digit alone.
QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                 r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


def qwen2_tokenizer(out: Path, texts: list[str]):
    """Qwen2's kind of tokenizer, trained here: NFC, its split pattern, then byte-level BPE; ``<|endoftext|>`` (end of
    text and padding), ``<|im_start|>``, ``<|im_end|>`` after the learned pieces, no start token."""
    import tokenizers
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE

    tk = tokenizers.Tokenizer(BPE())
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tk.add_special_tokens([tokenizers.AddedToken(p, special=True, normalized=False)
                           for p in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    tk.save(str(out / "tokenizer.json"))
    settings = {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>", "unk_token": None, "add_prefix_space": False, "model_max_length": 128,
                "split_special_tokens": False, "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(settings), encoding="utf-8")
    return tk


def gpt2_dir(out: Path, *, seed: int = 0, n_positions: int = 64, **config) -> Path:
    """A tiny GPT2LMHeadModel directory (tied output, gelu_new) with a byte-level BPE tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel

    out.mkdir(parents=True, exist_ok=True)
    tk = gpt2_tokenizer(out, causal_texts())
    eot = tk.token_to_id("<|endoftext|>")
    cfg = GPT2Config(vocab_size=tk.get_vocab_size(), n_embd=32, n_layer=2, n_head=4, n_positions=n_positions,
                     bos_token_id=eot, eos_token_id=eot, **config)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(cfg).eval()
    perturb(model, seed)
    model.save_pretrained(out)
    return out


def llama_dir(out: Path, *, seed: int = 0, model_type: str = "llama", tie: bool = False, kv_heads: int = 2,
              unk: bool = True, hidden_size: int = 32, intermediate_size: int = 64, **config) -> Path:
    """A tiny LlamaForCausalLM (or MistralForCausalLM) directory: grouped-query attention, RoPE with another
    base, three model rows past the tokenizer's vocabulary, a Llama-like tokenizer (``unk``: as
    :func:`llama_tokenizer`'s)."""
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    tk = llama_tokenizer(out, causal_texts(), unk=unk)
    Config, Model = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                     "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[model_type]
    cfg = Config(vocab_size=tk.get_vocab_size() + 3, hidden_size=hidden_size, intermediate_size=intermediate_size,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=128,
                 rms_norm_eps=1e-5, rope_theta=500.0, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2,
                 **config)
    torch.manual_seed(seed)
    model = Model(cfg).eval()
    perturb(model, seed)
    model.save_pretrained(out)
    return out


def qwen2_dir(out: Path, *, seed: int = 0, tie: bool = True, kv_heads: int = 2, window: int = 0, **config) -> Path:
    """A tiny Qwen2ForCausalLM directory: Llama's layers with biases on q_proj, k_proj and v_proj (raised well away
    from zero, so a bias copied to the wrong projection shows), a tokenizer like Qwen2's (byte-level BPE, no start
    token), tied output as in Qwen2's small models, its end-of-text token also the padding (``pad_token_id``).
    ``window``: a sliding window in every layer; else the config reads as most Qwen2 checkpoints ship:
    ``use_sliding_window: false`` beside a ``sliding_window`` and ``max_window_layers`` that must not be used."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tk = qwen2_tokenizer(out, causal_texts())
    eot = tk.token_to_id("<|endoftext|>")
    cfg = Qwen2Config(vocab_size=tk.get_vocab_size() + 3, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=128,
                      rms_norm_eps=1e-5, rope_theta=500.0, tie_word_embeddings=tie, bos_token_id=eot, eos_token_id=eot,
                      pad_token_id=eot, use_sliding_window=window > 0, sliding_window=window or None,
                      max_window_layers=0, **config)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).eval()
    perturb(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias"):
                p.add_(torch.randn(p.shape, generator=g) * 0.5)
    model.save_pretrained(out)
    if not window:  # transformers writes sliding_window null and the layer types; checkpoints have neither
        settings = json.loads((out / "config.json").read_text())
        settings.pop("layer_types", None)
        settings.update(sliding_window=3, max_window_layers=1)
        (out / "config.json").write_text(json.dumps(settings, indent=2))
    return out


def set_chat_template(directory: Path, template: str, where: str = "tokenizer_config") -> None:
    """Give a checkpoint directory a chat template as checkpoints ship one: ``tokenizer_config`` (the key
    ``chat_template``), ``named`` (a list of named templates, this one ``default``) or ``jinja``
    (``chat_template.jinja``, which transformers reads first)."""
    path = directory / "tokenizer_config.json"
    settings = json.loads(path.read_text(encoding="utf-8"))
    if where == "jinja":
        (directory / "chat_template.jinja").write_text(template, encoding="utf-8")
        return
    settings["chat_template"] = template if where == "tokenizer_config" else \
        [{"name": "tool_use", "template": "{{ raise_exception('not this one') }}"},
         {"name": "default", "template": template}]
    path.write_text(json.dumps(settings, indent=2, ensure_ascii=False), encoding="utf-8")


def set_end_ids(directory: Path, ids: list[int]) -> None:
    """``generation_config.json``'s ``eos_token_id`` as an instruct model lists it: the end of text and of a turn."""
    path = directory / "generation_config.json"
    settings = json.loads(path.read_text(encoding="utf-8"))
    settings["eos_token_id"] = ids
    path.write_text(json.dumps(settings, indent=2), encoding="utf-8")


#: ChatML, as Qwen2's and SmolLM2's instruct checkpoints lay out a conversation.
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
          " + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def instruct_dir(out: Path) -> Path:
    """A tiny instruct checkpoint (standing in for a download such as SmolLM2-135M-Instruct): :func:`qwen2_dir` with a
    ChatML template, and ``<|im_end|>`` listed beside ``<|endoftext|>`` in ``generation_config.json``."""
    import tokenizers

    qwen2_dir(out)
    tk = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    set_chat_template(out, CHATML)
    set_end_ids(out, [tk.token_to_id("<|endoftext|>"), tk.token_to_id("<|im_end|>")])
    return out
