"""Tests for attnkit.data.tokenizer: SentencePiece training, round trips, special ids, loading."""

from __future__ import annotations

import io
import json
import random
import shutil
from pathlib import Path

import pytest
import sentencepiece as spm

from attnkit.common.errors import UserError
from attnkit.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, TOKENIZER_FILE, UNK_ID, Tokenizer, train_tokenizer

SHARED = Path(__file__).resolve().parents[2] / "shared"
MULTI30K_VAL_DE = SHARED / "data" / "multi30k" / "val.de.gz"

DE_WORDS = ("ein Mädchen Junge Hund läuft über die grüne Wiese schön Straße Fußgänger "
            "größer Bäume Übung öffnet").split()
EN_WORDS = "a girl boy dog runs over the green meadow nice street pedestrian taller trees".split()
KO_WORDS = "고양이가 잔다 개가 달린다 아이 공원에서 논다 빨간 사과".split()


def corpus(words: list[str], n: int, seed: int) -> list[str]:
    """``n`` random sentences of 3-12 words, ending with a full stop."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) + "." for _ in range(n)]


SRC = corpus(DE_WORDS + KO_WORDS, 300, seed=1)
TGT = corpus(EN_WORDS, 300, seed=2)


@pytest.fixture(scope="module")
def joint_tok(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, Path]:
    out = tmp_path_factory.mktemp("joint")
    return train_tokenizer(SRC, TGT, out, vocab_size=120, model_type="unigram"), out


@pytest.fixture(scope="module")
def separate_tok(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, Path]:
    out = tmp_path_factory.mktemp("separate")
    return train_tokenizer(SRC, TGT, out, vocab_size=100, model_type="bpe", joint=False), out


ROUND_TRIP = [
    "ein Mädchen läuft über die grüne Wiese.",
    "Fußgänger öffnet größer Bäume.",
    "고양이가 잔다.",
    "a girl runs over the street.",
]


def test_special_ids(joint_tok: tuple[Tokenizer, Path]) -> None:
    tok, _ = joint_tok
    assert (PAD_ID, UNK_ID, BOS_ID, EOS_ID) == (0, 1, 2, 3)
    assert tok.tgt_pieces_from_ids([0, 1, 2, 3]) == ["<pad>", "<unk>", "<s>", "</s>"]
    ids = tok.encode_src(ROUND_TRIP)
    assert all(i not in (PAD_ID, BOS_ID, EOS_ID) for seq in ids for i in seq)  # no BOS/EOS added
    with pytest.raises(TypeError, match="list of texts"):
        tok.encode_src("ein Hund")  # type: ignore[arg-type]


def test_round_trip_joint(joint_tok: tuple[Tokenizer, Path]) -> None:
    tok, _ = joint_tok
    ids = tok.encode_src(ROUND_TRIP)
    assert all(UNK_ID not in seq for seq in ids)
    assert tok.decode_src(ids) == ROUND_TRIP
    assert tok.decode_tgt(tok.encode_tgt(ROUND_TRIP)) == ROUND_TRIP


def test_round_trip_separate(separate_tok: tuple[Tokenizer, Path]) -> None:
    tok, _ = separate_tok
    src = ROUND_TRIP[:3]
    assert tok.decode_src(tok.encode_src(src)) == src
    tgt = ["a girl runs over the street.", "nice trees."]
    assert tok.decode_tgt(tok.encode_tgt(tgt)) == tgt


def test_decode_skips_specials_and_stops_at_eos(joint_tok: tuple[Tokenizer, Path]) -> None:
    tok, _ = joint_tok
    a, b = tok.encode_tgt(["a dog runs.", "the boy."])
    batch = [[BOS_ID, *a, EOS_ID, *b, EOS_ID], [BOS_ID, *b, EOS_ID, PAD_ID, PAD_ID], [PAD_ID, *a]]
    assert tok.decode_tgt(batch) == ["a dog runs.", "the boy.", "a dog runs."]
    assert tok.decode_tgt([[EOS_ID, *a]]) == [""]
    with pytest.raises(ValueError, match="out of range"):
        tok.decode_tgt([[tok.tgt_vocab_size]])


def test_pieces_align_with_ids(joint_tok: tuple[Tokenizer, Path]) -> None:
    tok, _ = joint_tok
    text = "ein Hund läuft."
    (ids,) = tok.encode_src([text])
    pieces = tok.src_pieces(text)
    assert len(pieces) == len(ids)
    assert pieces[0].startswith("\u2581")  # SentencePiece word-boundary marker
    assert tok.src_pieces_from_ids(ids) == pieces
    assert tok.tgt_pieces_from_ids([BOS_ID, *ids, EOS_ID]) == ["<s>", *pieces, "</s>"]


def test_joint_vs_separate_files(
    joint_tok: tuple[Tokenizer, Path], separate_tok: tuple[Tokenizer, Path]
) -> None:
    jtok, jdir = joint_tok
    stok, sdir = separate_tok
    assert jtok.joint and jtok.has_target and jtok.src_vocab_size == jtok.tgt_vocab_size
    assert (jdir / "spm.model").is_file() and not (jdir / "src.model").exists()
    assert not stok.joint and (sdir / "src.model").is_file() and (sdir / "tgt.model").is_file()
    # Korean is only on the source side, so only the source model knows it.
    (src_ids,) = stok.encode_src(["고양이가"])
    (tgt_ids,) = stok.encode_tgt(["고양이가"])
    assert UNK_ID not in src_ids and UNK_ID in tgt_ids
    meta = json.loads((sdir / TOKENIZER_FILE).read_text(encoding="utf-8"))
    assert meta["joint"] is False and meta["model_type"] == "bpe"
    assert (meta["src_model"], meta["tgt_model"]) == ("src.model", "tgt.model")
    assert meta["src_vocab_size"] == stok.src_vocab_size and meta["tgt_vocab_size"] == stok.tgt_vocab_size


def test_load_round_trip(separate_tok: tuple[Tokenizer, Path]) -> None:
    tok, out = separate_tok
    loaded = Tokenizer.load(out)
    assert (loaded.joint, loaded.src_vocab_size, loaded.tgt_vocab_size) == (
        tok.joint, tok.src_vocab_size, tok.tgt_vocab_size)
    assert loaded.encode_src(ROUND_TRIP) == tok.encode_src(ROUND_TRIP)


def test_classification_has_source_only(tmp_path: Path) -> None:
    tok = train_tokenizer(SRC, None, tmp_path, vocab_size=80)
    assert (tmp_path / "spm.model").is_file()
    assert not tok.has_target
    assert tok.decode_src(tok.encode_src(ROUND_TRIP[:1])) == ROUND_TRIP[:1]
    with pytest.raises(ValueError, match="no target model"):
        tok.encode_tgt(["x"])
    assert not Tokenizer.load(tmp_path).has_target


@pytest.mark.parametrize("model_type", ["unigram", "bpe"])
def test_training_is_deterministic(tmp_path: Path, model_type: str) -> None:
    a = train_tokenizer(SRC, TGT, tmp_path / "a", vocab_size=100, model_type=model_type)
    b = train_tokenizer(SRC, TGT, tmp_path / "b", vocab_size=100, model_type=model_type)
    assert (tmp_path / "a" / "spm.model").read_bytes() == (tmp_path / "b" / "spm.model").read_bytes()
    assert a.tgt_pieces_from_ids(range(a.tgt_vocab_size)) == b.tgt_pieces_from_ids(range(b.tgt_vocab_size))


def test_sampling_is_deterministic_and_bounded(tmp_path: Path) -> None:
    """A stream longer than max_sentences is sampled, the same way every time; a shorter one is used whole."""
    def model(name: str, texts, max_sentences: int) -> list[tuple[str, float]]:
        train_tokenizer(texts, None, tmp_path / name, vocab_size=80, max_sentences=max_sentences)
        sp = spm.SentencePieceProcessor(model_file=str(tmp_path / name / "spm.model"))
        return [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]  # the proto also
        # records the options, input_sentence_size among them

    sampled = model("a", iter(SRC), 120)  # a one-pass stream, as attnkit.data.prepare gives it
    assert sampled == model("b", SRC, 120)
    assert sampled != model("c", SRC, 1000)
    assert model("c", SRC, 1000) == model("d", SRC, len(SRC))  # below the bound: every sentence, in order
    with pytest.raises(UserError, match="more than 100"):
        train_tokenizer(SRC, None, tmp_path / "e", vocab_size=80, max_sentences=100)


def test_below_the_bound_the_model_is_the_unsampled_one(tmp_path: Path) -> None:
    """A corpus under max_sentences trains exactly the model SentencePiece makes without any sampling (the
    tokenizers of runs made before sampling existed are unchanged)."""
    tok = train_tokenizer(SRC, TGT, tmp_path, vocab_size=100)
    unsampled = io.BytesIO()
    spm.set_random_generator_seed(1)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(SRC + TGT), model_writer=unsampled, vocab_size=100, model_type="unigram",
        character_coverage=1.0, hard_vocab_limit=False, pad_id=PAD_ID, unk_id=1, bos_id=2, eos_id=3,
        pad_piece="<pad>", unk_piece="<unk>", bos_piece="<s>", eos_piece="</s>", input_sentence_size=0,
        shuffle_input_sentence=False, max_sentence_length=1 << 15, num_threads=2, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=unsampled.getvalue())
    assert tok.src_pieces_from_ids(range(tok.src_vocab_size)) == [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    assert tok.encode_src(SRC[:50]) == sp.encode(SRC[:50], out_type=int)


def test_small_corpus_shrinks_vocab(tmp_path: Path) -> None:
    tok = train_tokenizer(["ein Hund.", "zwei Hunde."], ["a dog.", "two dogs."], tmp_path,
                          vocab_size=8000, model_type="bpe")
    assert 4 < tok.src_vocab_size < 8000
    meta = json.loads((tmp_path / TOKENIZER_FILE).read_text(encoding="utf-8"))
    assert meta["requested_vocab_size"] == 8000
    assert tok.decode_src(tok.encode_src(["zwei Hunde."])) == ["zwei Hunde."]


def test_training_errors(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="model_type 'wordpiece' is not supported"):
        train_tokenizer(SRC, TGT, tmp_path, vocab_size=100, model_type="wordpiece")
    with pytest.raises(UserError, match="vocab_size=10 is too small"):
        train_tokenizer(SRC, TGT, tmp_path, vocab_size=10)
    with pytest.raises(UserError, match="no non-empty source"):
        train_tokenizer(["", "  "], None, tmp_path, vocab_size=100)


def test_load_errors(tmp_path: Path, joint_tok: tuple[Tokenizer, Path]) -> None:
    _, good = joint_tok
    with pytest.raises(UserError, match=f"{TOKENIZER_FILE}: not found"):
        Tokenizer.load(tmp_path / "nowhere")

    bad_json = tmp_path / "bad_json"
    bad_json.mkdir()
    (bad_json / TOKENIZER_FILE).write_text("{not json", encoding="utf-8")
    with pytest.raises(UserError, match=r"tokenizer\.json:1:2: invalid JSON"):
        Tokenizer.load(bad_json)

    missing_model = tmp_path / "missing_model"
    shutil.copytree(good, missing_model)
    (missing_model / "spm.model").unlink()
    with pytest.raises(UserError, match=r"spm\.model: tokenizer model file not found"):
        Tokenizer.load(missing_model)

    corrupt = tmp_path / "corrupt"
    shutil.copytree(good, corrupt)
    (corrupt / "spm.model").write_bytes(b"this is not a model")
    with pytest.raises(UserError, match=r"spm\.model: not a valid SentencePiece model"):
        Tokenizer.load(corrupt)


@pytest.mark.skipif(not MULTI30K_VAL_DE.is_file(),
                    reason=f"Multi30k not available at {MULTI30K_VAL_DE} (shared data directory absent)")
def test_multi30k_round_trip(tmp_path: Path) -> None:
    from attnkit.data.readers import read_lines

    lines = read_lines(MULTI30K_VAL_DE)[:400]
    tok = train_tokenizer(lines, None, tmp_path, vocab_size=1000)
    sample = [" ".join(line.split()) for line in lines[:50]]  # SentencePiece collapses spaces
    assert tok.decode_src(tok.encode_src(sample)) == sample


@pytest.mark.parametrize("key", ["src_model", "tgt_model"])
@pytest.mark.parametrize("where", ["absolute", "parent", "subdir"])
def test_load_refuses_model_names_that_are_paths(
    tmp_path: Path, separate_tok: tuple[Tokenizer, Path], key: str, where: str
) -> None:
    """tokenizer.json names its model files; a name that reaches elsewhere is refused, even if that file exists."""
    _, good = separate_tok
    run = tmp_path / "run"
    shutil.copytree(good, run)
    (run / "sub").mkdir()
    shutil.copy(good / "src.model", run / "sub" / "src.model")
    name = {"absolute": str(good / "src.model"), "parent": f"../{good.name}/src.model", "subdir": "sub/src.model"}
    shutil.copytree(good, tmp_path / good.name, dirs_exist_ok=True)  # so "../<name>/src.model" exists too
    meta = json.loads((run / TOKENIZER_FILE).read_text(encoding="utf-8"))
    meta[key] = name[where]
    assert (run / name[where]).is_file()  # the path resolves: only the check can refuse it
    (run / TOKENIZER_FILE).write_text(json.dumps(meta), encoding="utf-8")
    with pytest.raises(UserError, match=rf"tokenizer\.json: {key} .* must be a file name in that directory") as err:
        Tokenizer.load(run)
    assert "\n" not in str(err.value)
