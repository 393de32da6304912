"""The tokenizer a GGUF file describes (``tokenizer.ggml.*`` metadata), rebuilt for the ``tokenizers`` library.

A GGUF ships no ``tokenizer.json``: it lists the pieces (``tokens``, in id order), their ``token_type``, the
``merges`` or the ``scores``, the special ids and a few switches, and llama.cpp's code does the rest. This module
writes the ``tokenizers`` pipeline that encodes the same way, as transformers' GGUF loader does:

==========================  =================================================================================
 ``tokenizer.ggml.model``   pipeline
==========================  =================================================================================
 ``llama`` (SentencePiece)  BPE with byte fallback (``<0xNN>`` pieces) over text whose spaces are ``▁`` and that
                            starts with one (``add_space_prefix``, default true: Metaspace, ``prepend_scheme:
                            first``). The merges are ``merges`` where the file has them; else they come from the
                            scores, as SentencePiece's BPE applies them: every split of a piece into two pieces,
                            ranked by the piece's score (:func:`merges_from_scores`; llama.cpp merges the adjacent
                            pair whose union scores highest)
 ``gpt2`` (byte-level BPE)  the text split by the pattern ``tokenizer.ggml.pre`` names (:data:`PRE_TOKENIZERS`,
                            llama.cpp's table), its bytes spelt as GPT-2's printable characters, then ``merges``
==========================  =================================================================================

Pieces of type CONTROL, USER_DEFINED and UNKNOWN are matched whole in the text before the model runs, as
llama.cpp does (CONTROL and UNKNOWN ones are special: decoding drops them). ``add_bos_token`` (default: true for
``llama``, and for the Llama-3 pre-tokenizers, as in llama.cpp) puts ``bos_token_id`` in front of every text;
``add_eos_token: true`` is refused, as for a Hugging Face directory (attnkit ends each document itself). The chat
template (``tokenizer.chat_template``) goes into ``tokenizer_config.json`` with the special pieces' names.
"""

from __future__ import annotations

import json

import tokenizers
from tokenizers import Regex, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from ..common.errors import UserError
from .gguf_file import GGUFFile

#: ``tokenizer.ggml.token_type`` values (llama.cpp's ``llama_token_type``).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
#: The split patterns of the pre-tokenizers llama.cpp knows by these names (``llama-vocab.cpp``), as the models'
#: own ``tokenizer.json`` files write them (``tokenizers`` reads ``(?i:...)``, which llama.cpp spells out).
GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
#: ``tokenizer.ggml.pre`` -> (the patterns that split the text, one after another; whether a word that is a piece
#: skips the merges, llama.cpp's ``ignore_merges``; the default of ``add_bos_token``).
PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool, bool]] = {
    **{name: ((GPT2_SPLIT,), False, False) for name in ("gpt-2", "phi-2", "mpt", "olmo")},
    **{name: ((LLAMA3_SPLIT,), True, True) for name in ("llama3", "llama-v3", "llama-bpe")},
    **{name: ((LLAMA3_SPLIT,), False, False) for name in ("smaug-bpe", "dbrx")},
    **{name: ((QWEN2_SPLIT,), False, False) for name in ("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2")},
    **{name: ((r"\p{N}", GPT2_SPLIT), False, False) for name in ("smollm", "starcoder", "refact")},
}


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's spelling of bytes as printable characters (its ``bytes_to_unicode``): printable Latin-1 bytes are
    themselves, the rest (space, control bytes) are shifted past U+0100, so ``" "`` is ``"Ġ"`` and ``"\\n"``
    ``"Ċ"``."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(256 + i) for i, b in enumerate(shifted)}}


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE's merges, implied by its pieces' scores: every split of a piece into two pieces, best
    score first (ties: the longer left part, then the longer right part; then the piece's order, then the parts'
    ids), as transformers' GGUF loader (``generate_merges``) and its SentencePiece converter derive them."""
    ids = {t: i for i, t in enumerate(tokens)}
    merges = []
    for piece, score in zip(tokens, scores, strict=True):
        splits = [(piece[:k], piece[k:], score) for k in range(1, len(piece)) if piece[:k] in ids and piece[k:] in ids]
        merges += sorted(splits, key=lambda m: (ids[m[0]], ids[m[1]]))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)  # stable: equal keys keep their order
    return [(a, b) for a, b, _ in merges]


def _merges(g: GGUFFile) -> list[tuple[str, str]] | None:
    """``tokenizer.ggml.merges`` as pairs, or None when the file has none."""
    merges = g.value("tokenizer.ggml.merges", list, None)
    if merges is None:
        return None
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    bad = next((m for m, p in zip(merges, pairs, strict=True) if len(p) != 2), None)
    if bad is not None:
        raise UserError(f"{g.path}: key 'tokenizer.ggml.merges' holds {bad!r}, not two pieces joined by a space")
    return pairs  # type: ignore[return-value]


def _sentencepiece(g: GGUFFile, tokens: list[str], unk: int | None) -> tokenizers.Tokenizer:
    """``model: llama`` (module doc)."""
    merges = _merges(g)
    if merges is None:
        scores = g.value("tokenizer.ggml.scores", list)
        if len(scores) != len(tokens):
            raise UserError(f"{g.path}: key 'tokenizer.ggml.scores' has {len(scores)} scores for {len(tokens)} tokens")
        merges = merges_from_scores(tokens, [float(s) for s in scores])
    model = BPE({t: i for i, t in enumerate(tokens)}, merges, unk_token=tokens[unk] if unk is not None else None,
                byte_fallback=True, fuse_unk=True)
    tk = tokenizers.Tokenizer(model)
    prefix = g.value("tokenizer.ggml.add_space_prefix", bool, True)
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix else "never",
                                                split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tk.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tk


def _byte_level(g: GGUFFile, tokens: list[str], types: list[int]) -> tuple[tokenizers.Tokenizer, bool]:
    """``model: gpt2`` (module doc) and the default of ``add_bos_token``. A piece that is not spelt in GPT-2's
    byte alphabet is respelt from its UTF-8 bytes (some converters write them raw), unless it is matched whole."""
    pre = g.value("tokenizer.ggml.pre", str, None)
    if pre not in PRE_TOKENIZERS:
        what = "missing key 'tokenizer.ggml.pre'" if pre is None else f"key 'tokenizer.ggml.pre' is {pre!r}"
        raise UserError(f"{g.path}: {what}: a byte-level BPE's pre-tokenizer attnkit cannot rebuild (it rebuilds "
                        f"{', '.join(PRE_TOKENIZERS)})")
    patterns, ignore_merges, add_bos = PRE_TOKENIZERS[pre]
    merges = _merges(g)
    if merges is None:
        raise UserError(f"{g.path}: missing key 'tokenizer.ggml.merges' (a byte-level BPE needs its merges)")
    spelling = byte_level_alphabet()
    alphabet = set(spelling.values())
    vocab = {}
    for i, (t, kind) in enumerate(zip(tokens, types, strict=True)):
        whole = kind in (CONTROL, USER_DEFINED, UNKNOWN)
        vocab[t if whole or set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))] = i
    tk = tokenizers.Tokenizer(BPE(vocab, merges, ignore_merges=ignore_merges))
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in patterns]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    return tk, add_bos


def gguf_tokenizer(g: GGUFFile, rows: int) -> tuple[str, dict]:
    """``(tokenizer.json text, tokenizer_config.json settings)`` of the tokenizer GGUF ``g`` describes, for a model
    of ``rows`` vocabulary rows (module doc)."""
    model = g.value("tokenizer.ggml.model", str)
    if model not in ("llama", "gpt2"):
        raise UserError(f"{g.path}: key 'tokenizer.ggml.model' is {model!r}; attnkit rebuilds 'llama' "
                        f"(SentencePiece) and 'gpt2' (byte-level BPE) tokenizers")
    tokens = g.value("tokenizer.ggml.tokens", list)
    if len(tokens) > rows:
        raise UserError(f"{g.path}: key 'tokenizer.ggml.tokens' has {len(tokens)} pieces, more than the {rows} rows "
                        f"of tensor 'token_embd.weight'")
    first = {}
    for i, t in enumerate(tokens):
        if first.setdefault(t, i) != i:
            raise UserError(f"{g.path}: key 'tokenizer.ggml.tokens' has {t!r} twice (ids {first[t]} and {i})")
    types = g.value("tokenizer.ggml.token_type", list, [NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise UserError(f"{g.path}: key 'tokenizer.ggml.token_type' has {len(types)} types for {len(tokens)} tokens")
    ids = {}
    for name in ("bos", "eos", "unknown", "padding"):
        i = g.value(f"tokenizer.ggml.{name}_token_id", int, None)
        if i is not None and not 0 <= i < len(tokens):
            raise UserError(f"{g.path}: key 'tokenizer.ggml.{name}_token_id' is {i}, not one of the {len(tokens)} "
                            f"tokens")
        ids[name] = i
    if ids["eos"] is None:
        raise UserError(f"{g.path}: missing key 'tokenizer.ggml.eos_token_id' (attnkit stops generating there)")
    if model == "llama":
        tk, add_bos = _sentencepiece(g, tokens, ids["unknown"]), True
    else:
        tk, add_bos = _byte_level(g, tokens, types)
    tk.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                           for t, kind in zip(tokens, types, strict=True) if kind in (CONTROL, UNKNOWN)])
    tk.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False)
                   for t, kind in zip(tokens, types, strict=True) if kind == USER_DEFINED])
    if g.value("tokenizer.ggml.add_eos_token", bool, False):
        raise UserError(f"{g.path}: key 'tokenizer.ggml.add_eos_token' is true; attnkit ends each document with the "
                        f"end-of-text token itself")
    add_bos = g.value("tokenizer.ggml.add_bos_token", bool, add_bos)
    if add_bos:
        if ids["bos"] is None:
            raise UserError(f"{g.path}: key 'tokenizer.ggml.add_bos_token' is true, but key "
                            f"'tokenizer.ggml.bos_token_id' is missing")
        bos = tokens[ids["bos"]]
        tk.post_processor = processors.TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                                                          special_tokens=[(bos, ids["bos"])])
    names = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": add_bos, "add_eos_token": False,
                **{key: tokens[ids[name]] if ids[name] is not None else None for key, name in names.items()},
                "clean_up_tokenization_spaces": False}
    template = g.value("tokenizer.chat_template", str, None)
    if template is not None:
        settings["chat_template"] = template
    return json.dumps(json.loads(tk.to_str()), indent=2, ensure_ascii=False) + "\n", settings
