"""Tests for the imported tokenizer kinds (attnkit.data.pieces, attnkit.data.hf_tokenizer).

``sentencepiece+vocab`` must give the ids of transformers' MarianTokenizer and ``wordpiece`` those of
its BertTokenizer (the ``tokenizers`` library) and BertTokenizerLegacy (pure Python), after mapping
them through the importer's renumbering, on a few hundred varied sentences.
"""

from __future__ import annotations

import importlib
import io
import json
import random
import shutil
import warnings
from pathlib import Path

import pytest
import sentencepiece as spm
import tokenizers

from attnkit.common.errors import UserError
from attnkit.data.hf_tokenizer import read_vocab_txt, spm_model_type
from attnkit.data.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    TOKENIZER_FILE,
    UNK_ID,
    Tokenizer,
    save_sentencepiece_vocab,
    save_wordpiece,
    tokenizer_files,
    train_tokenizer,
    wordpiece_from_vocab_txt,
)

# -- text -------------------------------------------------------------------------------------------

SRC_WORDS = ("the a cat dog runs over green meadow house tree little big children play in park "
             "Paris London 12 345 2024 7").split()
TGT_WORDS = ("le la chat chien court sur prairie verte maison arbre élève garçon où ça enfants jouent "
             "parc Noël œuvre déjà").split()
ACCENTED = "café naïve résumé Zürich über Ångström façade São".split()
UNKNOWN = ["€", "Ω", "😀", "中文", "字", "ß", "ø", "☃", "\u200b", "ǅ"]
PUNCT = [",", ".", "!", "?", ";", ":", "-", "(", ")", "'", '"', "...", "%"]


def training_corpus(words: list[str], n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) + rng.choice([".", "!", "?", ","])
            for _ in range(n)]


def varied(n: int, seed: int, prefixes: tuple[str, ...] = ("",)) -> list[str]:
    """``n`` sentences mixing both languages, accents, case, digits, punctuation, unknown characters, spacing."""
    rng = random.Random(seed)
    pool = SRC_WORDS + TGT_WORDS + ACCENTED
    out = []
    for _ in range(n):
        words = []
        for _ in range(rng.randint(1, 10)):
            w = rng.choice(pool) if rng.random() > 0.15 else rng.choice(UNKNOWN)
            w = {0: w.upper(), 1: w.title()}.get(rng.randrange(6), w)
            if rng.random() < 0.25:
                w += rng.choice(PUNCT)
            words.append(w)
        sep = rng.choice([" ", " ", " ", "  ", "\t"])
        out.append(rng.choice(prefixes) + sep.join(words) + rng.choice(["", "", ".", " !", " "]))
    return out


EDGE = ["", " ", ".", "a", ">>fr<<", ">><<", ">>fr<<le chat", ">> a << b", "a >>fr<< b", ">>fr", "<<fr>>",
        ">>xx<< the cat", "x" * 150, "chat" * 30, "THE CAT RUNS", "ÉLÈVE", "naïve café", "12,345.67%"]
SPECIAL_TEXT = ["the </s> cat", "<unk> le chat", "a <pad> b", "<s>x</s>", "[MASK] a [SEP] b [CLS]", "x [PAD] y",
                "[UNK]", "le [mask] chat"]


def quiet(make):
    """Build a transformers tokenizer without its warnings (sacremoses missing, deprecations)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make()


# -- sentencepiece+vocab (Marian) ---------------------------------------------------------------------


def train_spm(texts: list[str], vocab_size: int, model_type: str) -> bytes:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_writer=model, vocab_size=vocab_size,
                                   model_type=model_type, character_coverage=1.0, hard_vocab_limit=False,
                                   num_threads=1, minloglevel=2)
    return model.getvalue()


class Marian:
    """Two SentencePiece models, a Marian vocabulary, MarianTokenizer and attnkit's tokenizer of them."""

    def __init__(self, root: Path) -> None:
        transformers = pytest.importorskip("transformers", minversion="5")
        self.src_proto = train_spm(training_corpus(SRC_WORDS + ACCENTED[:3], 400, 1), 150, "unigram")
        self.tgt_proto = train_spm(training_corpus(TGT_WORDS, 400, 2), 150, "bpe")
        (root / "source.spm").write_bytes(self.src_proto)
        (root / "target.spm").write_bytes(self.tgt_proto)
        known = set()
        for proto in (self.src_proto, self.tgt_proto):
            sp = spm.SentencePieceProcessor(model_proto=proto)
            known |= {sp.id_to_piece(i) for i in range(sp.get_piece_size())
                      if not (sp.is_control(i) or sp.is_unknown(i))}
        # Marian's layout: </s> 0, <unk> 1, the pieces (language codes too), <pad> last
        marian = ["</s>", "<unk>", ">>fr<<", ">>de<<", *sorted(known), "<pad>"]
        (root / "vocab.json").write_text(json.dumps({p: i for i, p in enumerate(marian)}), encoding="utf-8")
        rest = marian[2:-1]
        random.Random(3).shuffle(rest)
        self.pieces = ["<pad>", "<unk>", "<s>", "</s>", *rest]  # the importer's renumbering
        index = {p: i for i, p in enumerate(self.pieces)}
        self.to_attnkit = {i: index[p] for i, p in enumerate(marian)}
        self.hf = quiet(lambda: transformers.MarianTokenizer(
            source_spm=str(root / "source.spm"), target_spm=str(root / "target.spm"), vocab=str(root / "vocab.json")))
        self.out = root / "run"
        self.tok = save_sentencepiece_vocab(self.out, self.src_proto, self.tgt_proto, self.pieces)

    def hf_ids(self, texts: list[str], target: bool, **kw) -> list[list[int]]:
        """MarianTokenizer's ids (no EOS) in attnkit's numbering."""
        enc = self.hf(text_target=texts, **kw) if target else self.hf(texts, **kw)
        return [[self.to_attnkit[i] for i in ids] for ids in enc["input_ids"]]


@pytest.fixture(scope="module")
def marian(tmp_path_factory: pytest.TempPathFactory) -> Marian:
    return Marian(tmp_path_factory.mktemp("marian"))


MARIAN_TEXTS = EDGE[1:] + varied(300, seed=4, prefixes=("", "", "", ">>fr<< ", ">>de<<", ">>xx<< ", ">>fr<<"))


@pytest.mark.parametrize("target", [False, True], ids=["source", "target"])
def test_marian_ids_equal_marian_tokenizer(marian: Marian, target: bool) -> None:
    encode = marian.tok.encode_tgt if target else marian.tok.encode_src
    ids = encode(MARIAN_TEXTS)
    assert ids == marian.hf_ids(MARIAN_TEXTS, target, add_special_tokens=False)
    assert encode(MARIAN_TEXTS, threads=1) == ids
    assert encode([""]) == [[]] and encode([]) == []
    assert any(UNK_ID in seq for seq in ids) and not any(i in (PAD_ID, BOS_ID, EOS_ID) for s in ids for i in s)
    # Marian splits special pieces written in the text out of it; attnkit segments them as text
    # (as MarianTokenizer's _tokenize, and transformers with split_special_tokens=True)
    special = encode(SPECIAL_TEXT)
    assert special == marian.hf_ids(SPECIAL_TEXT, target, add_special_tokens=False, split_special_tokens=True)
    assert special != marian.hf_ids(SPECIAL_TEXT, target, add_special_tokens=False)


def test_marian_language_codes(marian: Marian) -> None:
    fr, de, code_only = marian.tok.encode_src([">>fr<< le chat", ">>de<<le chat", ">>fr<<"])
    assert marian.pieces[fr[0]] == ">>fr<<" and marian.pieces[de[0]] == ">>de<<" and code_only == [fr[0]]
    assert fr[1:] == de[1:] == marian.tok.encode_src(["le chat"])[0]
    assert marian.tok.encode_src([">>xx<< le chat"])[0][0] == UNK_ID  # a code outside the vocabulary
    assert marian.tok.src_pieces(">>fr<< le chat")[0] == ">>fr<<"
    assert marian.tok.src_pieces("a >>fr<< b")[0] != ">>fr<<"  # only at the start


@pytest.mark.parametrize("target", [False, True], ids=["source", "target"])
def test_marian_decode_equals_marian_tokenizer(marian: Marian, target: bool) -> None:
    tok = marian.tok
    hf = (marian.hf(text_target=MARIAN_TEXTS) if target else marian.hf(MARIAN_TEXTS))["input_ids"]  # with </s>
    ours = [[marian.to_attnkit[i] for i in seq] for seq in hf]
    decode = tok.decode_tgt if target else tok.decode_src
    expected = [marian.hf.decode(seq, skip_special_tokens=True, use_source_tokenizer=not target) for seq in hf]
    assert decode(ours) == expected
    assert decode([[BOS_ID, *seq, PAD_ID, PAD_ID] for seq in ours]) == expected  # </s> ends it, BOS/PAD dropped
    assert decode([[UNK_ID, *seq] for seq in ours]) == expected  # UNK is dropped, as Marian's skip_special_tokens


def test_marian_round_trip(marian: Marian) -> None:
    src = training_corpus(SRC_WORDS, 50, seed=5)
    tgt = [">>fr<< " + t for t in training_corpus(TGT_WORDS, 50, seed=6)]
    assert marian.tok.decode_src(marian.tok.encode_src(src)) == src
    assert marian.tok.decode_tgt(marian.tok.encode_tgt(tgt)) == tgt


def test_marian_pieces_and_properties(marian: Marian, tmp_path: Path) -> None:
    tok = marian.tok
    assert (tok.kind, tok.model_type, tok.joint, tok.has_target, tok.mask_id) == (
        "sentencepiece+vocab", "marian-unigram", True, True, None)
    assert tok.src_vocab_size == tok.tgt_vocab_size == len(marian.pieces)
    assert tok.src_pieces_from_ids(range(len(marian.pieces))) == marian.pieces
    assert tok.tgt_pieces_from_ids([BOS_ID, EOS_ID]) == ["<s>", "</s>"]
    for text in MARIAN_TEXTS[:100]:
        (ids,) = tok.encode_src([text])
        pieces = tok.src_pieces(text)
        assert len(pieces) == len(ids)
        assert all(p == marian.pieces[i] or i == UNK_ID for p, i in zip(pieces, ids, strict=True))
    with pytest.raises(ValueError, match="out of range"):
        tok.decode_src([[len(marian.pieces)]])
    assert tokenizer_files(marian.out) == [TOKENIZER_FILE, "src.model", "tgt.model", "vocab.json"]
    assert (marian.out / "src.model").read_bytes() == marian.src_proto  # kept byte for byte
    meta = json.loads((marian.out / TOKENIZER_FILE).read_text(encoding="utf-8"))
    assert (meta["kind"], meta["vocab"]) == ("sentencepiece+vocab", "vocab.json")
    assert json.loads((marian.out / "vocab.json").read_text(encoding="utf-8")) == marian.pieces
    loaded = Tokenizer.load(marian.out)
    assert loaded.encode_tgt(MARIAN_TEXTS) == tok.encode_tgt(MARIAN_TEXTS) and repr(loaded) == repr(tok)
    assert (spm_model_type(marian.src_proto), spm_model_type(marian.tgt_proto)) == ("unigram", "bpe")
    assert spm_model_type(b"\xff") == "unknown"


def test_trained_tokenizers_keep_their_metadata(tmp_path: Path) -> None:
    """A trained (sentencepiece) tokenizer.json has no "kind" key: existing runs and new ones read the same."""
    tok = train_tokenizer(training_corpus(SRC_WORDS, 200, 7), None, tmp_path, vocab_size=60)
    assert "kind" not in json.loads((tmp_path / TOKENIZER_FILE).read_text(encoding="utf-8"))
    assert tok.kind == "sentencepiece" and tokenizer_files(tmp_path) == [TOKENIZER_FILE, "spm.model"]


def broken_copy(marian: Marian, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(marian.out, run)
    return run



def assert_load_fails(file: Path, content: str | None, message: str) -> None:
    """With ``file`` of a tokenizer directory removed (``content`` None) or rewritten, loading the directory
    is one :class:`UserError` line matching ``message``."""
    if content is None:
        file.unlink()
    else:
        file.write_text(content, encoding="utf-8")
    with pytest.raises(UserError, match=message) as err:
        Tokenizer.load(file.parent)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("content", "message"), [
    (None, r"vocab\.json: vocabulary file not found"),
    ("[\"<pad>\", ", r"vocab\.json:1:\d+: invalid JSON"),
    ('{"<pad>": 0}', r"vocab\.json: expected a list of pieces"),
    ('["<pad>", "<unk>", 2, "</s>"]', r"vocab\.json: expected a list of pieces"),
    ('["<pad>", "<unk>", "<s>"]', r"vocab\.json: 3 pieces, fewer than the 4 special ones"),
    ('["<pad>", "<unk>", "<s>", "</s>", "a", "<unk>"]', r"vocab\.json: piece '<unk>' has two ids, 1 and 5"),
])
def test_marian_bad_vocab(marian: Marian, tmp_path: Path, content: str | None, message: str) -> None:
    assert_load_fails(broken_copy(marian, tmp_path) / "vocab.json", content, message)


@pytest.mark.parametrize(("change", "message"), [
    ({"kind": "bogus"}, r"tokenizer\.json: kind 'bogus' is not one of sentencepiece, sentencepiece\+vocab"),
    ({"vocab": "../vocab.json"}, r"tokenizer\.json: vocab '\.\./vocab\.json' must be a file name"),
    ({"vocab": None}, r"tokenizer\.json: vocab None must be a file name"),
])
def test_marian_bad_metadata(marian: Marian, tmp_path: Path, change: dict, message: str) -> None:
    run = broken_copy(marian, tmp_path)
    meta = json.loads((run / TOKENIZER_FILE).read_text(encoding="utf-8"))
    (run / TOKENIZER_FILE).write_text(json.dumps({**meta, **change}), encoding="utf-8")
    with pytest.raises(UserError, match=message):
        Tokenizer.load(run)
    del meta["vocab"]
    (run / TOKENIZER_FILE).write_text(json.dumps(meta), encoding="utf-8")
    with pytest.raises(UserError, match="missing key 'vocab'"):
        Tokenizer.load(run)


def test_marian_bad_model_files(marian: Marian, tmp_path: Path) -> None:
    run = broken_copy(marian, tmp_path)
    (run / "tgt.model").write_bytes(b"not a model")
    with pytest.raises(UserError, match=r"tgt\.model: not a valid SentencePiece model .*re-import") as err:
        Tokenizer.load(run)
    assert "\n" not in str(err.value)
    (run / "tgt.model").write_bytes(b"")
    with pytest.raises(UserError, match=r"tgt\.model: not a valid SentencePiece model"):
        Tokenizer.load(run)
    with pytest.raises(UserError, match="the target SentencePiece model is not valid"):
        save_sentencepiece_vocab(tmp_path / "x", marian.src_proto, b"junk", marian.pieces)
    with pytest.raises(ValueError, match="has two ids"):
        save_sentencepiece_vocab(tmp_path / "y", marian.src_proto, marian.tgt_proto, marian.pieces + ["<s>"])
    with pytest.raises(ValueError, match="fewer than the 4 special"):
        save_sentencepiece_vocab(tmp_path / "z", marian.src_proto, marian.tgt_proto, ["<pad>"])
    assert not (tmp_path / "y").exists()  # nothing written before the checks pass


# -- wordpiece (BERT) -------------------------------------------------------------------------------

BERT_WORDS = ("the a cat dog run runs running play played over green house tree little big child children "
              "park in on and or not is was be have paris london cafe naive resume zurich uber un ##able "
              "##ing ##ed ##s ##er ##est ##ly ##tion ##ment re ##do de ##ja vu eleve garcon chat chien le la "
              "the. don ##'t 12 345 2024").split()


def bert_vocab() -> list[str]:
    """A small BERT vocabulary with the special pieces at BERT's usual ids (PAD 0, UNK 100 ... MASK 103)."""
    chars = list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~0123456789abcdefghijklmnopqrstuvwxyz")
    chars += list("ABCDEFGHIJKLMNOPQRSTUVWXYZ") + ["é", "è", "ü", "ç", "É", "中", "文", "ß"]
    words = ["The", "Paris", "London", "Cat", "café", "naïve", "élève", "Zürich", "über"]
    vocab = ["[PAD]", *[f"[unused{i}]" for i in range(99)], "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab += chars + ["##" + c for c in chars if c.isalnum()] + words
    return vocab + [w for w in dict.fromkeys(BERT_WORDS) if w not in vocab]


BERT_TEXTS = EDGE + varied(300, seed=8) + ["a\tb\nc\u200bd\x00e", "中文字 and 文中", "Ünïcödé ÀÉÎÕÜ", "don't", "x€y"]
#: BERT's settings: (do_lower_case, strip_accents)
BERT_SETTINGS = [(True, None), (False, None), (True, False), (False, True)]


class Bert:
    """A vocab.txt, transformers' BertTokenizer (tokenizers) and BertTokenizerLegacy, and attnkit's tokenizers."""

    def __init__(self, root: Path, lowercase: bool, strip_accents: bool | None) -> None:
        transformers = pytest.importorskip("transformers", minversion="5")
        vocab = bert_vocab()
        (root / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
        kwargs = {"do_lower_case": lowercase, "strip_accents": strip_accents}
        self.hf = quiet(lambda: transformers.BertTokenizer.from_pretrained(str(root), **kwargs))
        try:  # transformers 5's pure-Python BERT tokenizer (4's BertTokenizer)
            legacy = importlib.import_module("transformers.models.bert.tokenization_bert_legacy")
        except ImportError:
            legacy = None
        self.legacy = legacy and quiet(lambda: legacy.BertTokenizerLegacy(str(root / "vocab.txt"), **kwargs))
        self.hf.save_pretrained(str(root / "hf"))
        self.tokenizer_json = (root / "hf" / "tokenizer.json").read_text(encoding="utf-8")
        rest = [p for p in vocab if p not in ("[PAD]", "[UNK]", "[CLS]", "[SEP]")]
        random.Random(9).shuffle(rest)
        self.pieces = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", *rest]
        index = {p: i for i, p in enumerate(self.pieces)}
        self.to_attnkit = {i: index[p] for i, p in enumerate(vocab)}
        self.out = root / "run"
        self.tok = save_wordpiece(self.out, self.tokenizer_json, self.pieces, "[MASK]")
        vocab_json = wordpiece_from_vocab_txt(root / "vocab.txt", lowercase, strip_accents)
        self.from_txt = save_wordpiece(root / "txt", vocab_json, self.pieces, "[MASK]")

    def hf_ids(self, texts: list[str], tokenizer=None, **kw) -> list[list[int]]:
        enc = (tokenizer or self.hf)(texts, add_special_tokens=False, **kw)["input_ids"]
        return [[self.to_attnkit[i] for i in ids] for ids in enc]


@pytest.fixture(scope="module", params=BERT_SETTINGS, ids=lambda s: f"lower={s[0]}-strip={s[1]}")
def bert(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Bert:
    return Bert(tmp_path_factory.mktemp("bert"), *request.param)


def test_wordpiece_ids_equal_bert_tokenizer(bert: Bert) -> None:
    ids = bert.tok.encode_src(BERT_TEXTS)
    assert ids == bert.hf_ids(BERT_TEXTS)
    assert bert.from_txt.encode_src(BERT_TEXTS) == ids  # the vocab.txt route builds the same tokenizer
    if bert.legacy:
        assert ids == bert.hf_ids(BERT_TEXTS, bert.legacy)  # and the pure-Python WordPiece agrees
    assert any(UNK_ID in seq for seq in ids) and not any(i in (PAD_ID, BOS_ID, EOS_ID) for s in ids for i in s)
    assert bert.tok.encode_src([]) == [] and bert.tok.encode_src([""]) == [[]]
    # special pieces written in the text are text (split_special_tokens=True), never PAD, EOS or MASK
    special = bert.tok.encode_src(SPECIAL_TEXT)
    assert special == bert.hf_ids(SPECIAL_TEXT, split_special_tokens=True)
    assert special != bert.hf_ids(SPECIAL_TEXT)
    assert not any(i in (PAD_ID, BOS_ID, EOS_ID, bert.tok.mask_id) for s in special for i in s)


def test_wordpiece_decode_equals_bert_tokenizer(bert: Bert) -> None:
    hf = bert.hf(BERT_TEXTS, add_special_tokens=False)["input_ids"]
    expected = [bert.hf.decode(seq, skip_special_tokens=True) for seq in hf]
    ours = [[bert.to_attnkit[i] for i in seq] for seq in hf]
    assert bert.tok.decode_src(ours) == expected
    assert bert.tok.decode_src([[BOS_ID, *seq, EOS_ID, *seq] for seq in ours]) == expected
    mask = bert.tok.mask_id
    assert bert.tok.decode_src([[mask, UNK_ID, *seq] for seq in ours]) == expected  # special pieces dropped
    plain = training_corpus(["the", "cat", "runs", "over", "big", "green", "house"], 20, 10)
    assert bert.tok.decode_src(bert.tok.encode_src(plain)) == plain


def test_wordpiece_pieces_and_properties(bert: Bert) -> None:
    tok = bert.tok
    assert (tok.kind, tok.model_type, tok.joint, tok.has_target) == ("wordpiece", "wordpiece", True, False)
    assert tok.mask_id == bert.pieces.index("[MASK]") and tok.src_vocab_size == len(bert.pieces)
    assert tok.src_pieces_from_ids(range(len(bert.pieces))) == bert.pieces
    for text in BERT_TEXTS[:100]:
        (ids,) = tok.encode_src([text])
        assert tok.src_pieces(text) == tok.src_pieces_from_ids(ids)
    with pytest.raises(ValueError, match="no target model"):
        tok.encode_tgt(["x"])
    assert tokenizer_files(bert.out) == [TOKENIZER_FILE, "wordpiece.json"]
    saved = json.loads((bert.out / "wordpiece.json").read_text(encoding="utf-8"))
    assert saved["post_processor"] is None and saved["padding"] is None and saved["truncation"] is None
    assert saved["model"]["vocab"] == {p: i for i, p in enumerate(bert.pieces)}
    assert {t["content"]: t["id"] for t in saved["added_tokens"]} == {
        p: bert.pieces.index(p) for p in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")}
    assert json.loads((bert.out / TOKENIZER_FILE).read_text(encoding="utf-8"))["mask_piece"] == "[MASK]"
    loaded = Tokenizer.load(bert.out)
    assert loaded.encode_src(BERT_TEXTS) == tok.encode_src(BERT_TEXTS) and loaded.mask_id == tok.mask_id


def test_wordpiece_without_mask(bert: Bert, tmp_path: Path) -> None:
    tok = save_wordpiece(tmp_path, bert.tokenizer_json, bert.pieces, None)
    assert tok.mask_id is None and tok.encode_src(BERT_TEXTS) == bert.tok.encode_src(BERT_TEXTS)


def test_save_wordpiece_refuses_a_wrong_permutation(bert: Bert, tmp_path: Path) -> None:
    pieces = bert.pieces
    wrong = {
        "missing": (pieces[:-1], "1 missing"),
        "extra": (pieces + ["zzz"], "1 not in it"),
        "duplicate": (pieces + [pieces[5]], "has two ids"),
        "unk": ([pieces[0], pieces[2], pieces[1], *pieces[3:]], "id 1 is '\\[CLS\\]'"),
    }
    for name, (bad, message) in wrong.items():
        with pytest.raises(ValueError, match=message):
            save_wordpiece(tmp_path / name, bert.tokenizer_json, bad, "[MASK]")
    with pytest.raises(ValueError, match="mask piece '<mask>' is not in"):
        save_wordpiece(tmp_path / "mask", bert.tokenizer_json, pieces, "<mask>")
    assert not any(tmp_path.iterdir())  # nothing written


def test_save_wordpiece_refuses_other_tokenizers(tmp_path: Path) -> None:
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>")).to_str()
    for text, message in [("{", "not valid JSON"), (bpe, "has a BPE model, not WordPiece"),
                          ("[]", "has a missing model")]:
        with pytest.raises(UserError, match=message) as err:
            save_wordpiece(tmp_path, text, ["[PAD]", "[UNK]", "[CLS]", "[SEP]"], None)
        assert "\n" not in str(err.value)
    (tmp_path / "vocab.txt").write_text("[PAD]\na\nb\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"vocab\.txt: no \[UNK\] piece"):
        wordpiece_from_vocab_txt(tmp_path / "vocab.txt", True, None)


@pytest.mark.parametrize(("content", "message"), [
    (None, r"wordpiece\.json: WordPiece tokenizer file not found"),
    ("{not json", r"wordpiece\.json: not a tokenizer the `tokenizers` library can read"),
    ('{"model": {"type": "WordPiece"}}', r"wordpiece\.json: not a tokenizer the `tokenizers` library can read"),
])
def test_wordpiece_bad_files(bert: Bert, tmp_path: Path, content: str | None, message: str) -> None:
    run = tmp_path / "run"
    shutil.copytree(bert.out, run)
    assert_load_fails(run / "wordpiece.json", content, message)


def test_wordpiece_bad_metadata(bert: Bert, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(bert.out, run)
    meta = json.loads((run / TOKENIZER_FILE).read_text(encoding="utf-8"))
    for change, message in [({"mask_piece": 3}, "mask_piece 3 must be a string or null"),
                            ({"mask_piece": "<mask>"}, r"wordpiece\.json: no mask piece '<mask>'"),
                            ({"src_model": "/etc/passwd"}, "src_model '/etc/passwd' must be a file name")]:
        (run / TOKENIZER_FILE).write_text(json.dumps({**meta, **change}), encoding="utf-8")
        with pytest.raises(UserError, match=message):
            Tokenizer.load(run)


def test_vocab_txt_is_read_as_transformers_reads_it(tmp_path: Path) -> None:
    """Lines end at newlines only (not at U+2028 or U+0085), a later duplicate wins: ids as BERT's load_vocab."""
    pytest.importorskip("transformers", minversion="5")
    bert_module = importlib.import_module("transformers.models.bert.tokenization_bert")
    path = tmp_path / "vocab.txt"
    path.write_bytes("[PAD]\r\n[UNK]\na\u2028b\nc\x85d\nx\n##x\nx\n \n\n".encode())
    vocab = read_vocab_txt(path)
    assert vocab == dict(bert_module.load_vocab(str(path)))
    assert vocab["x"] == 6 and vocab["a\u2028b"] == 2 and vocab[""] == 8
