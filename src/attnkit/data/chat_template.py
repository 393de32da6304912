"""Chat templates: a conversation written out as the text an instruct model was trained to read.

An instruct model is trained on conversations laid out one way (ChatML's ``<|im_start|>user\\n...<|im_end|>``,
Llama-2's ``[INST] ... [/INST]``, Llama-3's ``<|start_header_id|>user<|end_header_id|>``, ...); shown another
layout it answers worse. Its checkpoint ships that layout as a Jinja template (``chat_template`` in
``tokenizer_config.json``, or ``chat_template.jinja``), which transformers' ``apply_chat_template`` renders.
:class:`ChatTemplate` renders it the same way, so a prompt is the string transformers would build:

* Jinja's sandbox (``ImmutableSandboxedEnvironment``): a template from a download is code, and the sandbox keeps it
  from Python's internals and from changing the lists and dicts it is given;
* ``trim_blocks`` and ``lstrip_blocks`` (a block tag's own line and indentation write nothing), the
  ``loopcontrols`` extension (``{% break %}``, ``{% continue %}``) and ``{% generation %}`` blocks (rendered as
  their text);
* the helpers templates call: ``raise_exception(message)``, the ``tojson`` filter (``json.dumps``, without
  Jinja's HTML escaping), ``strftime_now(format)``, ``dict``, and a ``namespace`` that refuses ``_`` names;
* the variables: ``messages`` (``[{"role": ..., "content": ...}]``), ``add_generation_prompt`` (end with the header
  of the assistant's next turn), and the tokenizer's special pieces as text (``bos_token``, ``eos_token``, ...:
  :func:`special_tokens`; a piece the tokenizer does not have is left undefined, as there).

A template that does not parse, or that cannot render a conversation (a Jinja error, or its own
``raise_exception``, e.g. Llama-2's "Conversation roles must alternate"), is a one-line
:class:`~attnkit.common.errors.UserError` naming the template and the reason.

End of a turn: an instruct model ends its answer with a piece of its own (``<|im_end|>``, ``<|eot_id|>``,
``<end_of_turn>``, or ``</s>``). :func:`end_of_turn` sorts a run's list of them (``data.end_of_turn``) into token
ids, which generation stops at, and strings of text, which the streamed text stops at.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..common.errors import UserError
from ..vocab import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from .tokenizer import Tokenizer
from .tokenizers_json import HF_TOKENIZER_CONFIG_FILE, HF_TOKENIZERS

__all__ = ["SPECIAL_TOKEN_NAMES", "ChatTemplate", "end_of_turn", "special_tokens", "token_text"]

#: The tokenizer's special pieces a template may name, as transformers passes them (``special_tokens_map``).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
#: attnkit's id for the part each name plays, where it has one.
_OWN_IDS = {"bos_token": BOS_ID, "eos_token": EOS_ID, "unk_token": UNK_ID, "pad_token": PAD_ID}


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _Dict:
    """``dict(...)`` and ``dict.fromkeys(...)`` in a template, without handing it the ``dict`` type itself."""

    def __call__(self, *args: object, **kwargs: object) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: object) -> dict:
        return dict.fromkeys(*args)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's ``namespace()``, refusing names that begin with ``_`` (the way into Python's internals)."""

    def __init__(*args: object, **kwargs: object) -> None:  # Jinja's signature: ``namespace(self=...)`` works
        self, rest = args[0], args[1:]
        for name in dict(*rest, **kwargs):
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, *rest, **kwargs)

    def __setitem__(self, name: str, value: object) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set the namespace attribute {name!r}")


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``, which marks the assistant's text for transformers' mask of the
    assistant's tokens: rendered as its body (in a scope of its own, as there)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    """The sandbox transformers renders chat templates in (module doc)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dict(),
                       namespace=_Namespace)
    return env


def _reason(e: Exception) -> str:
    """A Jinja error in one line: its message, and the template's line where Jinja knows it."""
    message = " ".join(str(e).split()) or type(e).__name__
    line = getattr(e, "lineno", None)
    return f"{message} (template line {line})" if line else message


class ChatTemplate:
    """A chat template, compiled once, and the special pieces it is rendered with.

    :param text: the Jinja source.
    :param where: how to name it in an error (``runs/chat: data.chat_template``).
    :param special_tokens: ``bos_token`` etc. as text (:data:`SPECIAL_TOKEN_NAMES`); a missing one stays undefined.
    :raises UserError: the template does not parse.
    """

    def __init__(self, text: str, where: str, special_tokens: Mapping[str, str] | None = None) -> None:
        self.text, self.where = text, where
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = _environment().from_string(text)
        except jinja2.exceptions.TemplateError as e:
            raise UserError(f"{where}: the chat template is not valid Jinja: {_reason(e)}") from None

    def render(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation as the model's text (transformers' ``apply_chat_template(..., tokenize=False)``).

        :param messages: ``{"role": "system" | "user" | "assistant", "content": text}`` in order.
        :raises UserError: the template cannot render this conversation (its own ``raise_exception`` included).
        """
        try:
            return self._template.render(messages=[dict(m) for m in messages], tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except jinja2.exceptions.TemplateError as e:
            raise UserError(f"{self.where}: the chat template cannot render this conversation: {_reason(e)}") \
                from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as e:
            # what a template's expressions can raise on a conversation it does not expect (``messages[0]`` of none)
            raise UserError(f"{self.where}: the chat template cannot render this conversation: {type(e).__name__}: "
                            f"{' '.join(str(e).split())}") from None


def token_text(value: object) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it (a string, or an ``AddedToken`` object) as text."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def special_tokens(tok: Tokenizer, directory: Path) -> dict[str, str]:
    """``bos_token`` etc. (:data:`SPECIAL_TOKEN_NAMES`) as a template sees them: an imported tokenizer's as its
    ``tokenizer_config.json`` names them (kept in ``directory``), else the piece of attnkit's id for the part
    (``<s>``, ``</s>``, ``<unk>``, ``<pad>``), where the vocabulary has one."""
    path = directory / HF_TOKENIZER_CONFIG_FILE
    settings: object = {}
    if tok.kind == HF_TOKENIZERS and path.is_file():
        try:
            settings = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"{path}: cannot read ({type(e).__name__}); re-import the checkpoint") from None
    settings = settings if isinstance(settings, dict) else {}
    own = {name: piece for (name, i), piece in zip(_OWN_IDS.items(), tok.src_pieces_from_ids(list(_OWN_IDS.values())),
                                                   strict=True) if i not in tok.absent_ids}
    out = {}
    for name in SPECIAL_TOKEN_NAMES:
        text = token_text(settings.get(name)) if name in settings else own.get(name)
        if text is not None:
            out[name] = text
    return out


def end_of_turn(tok: Tokenizer, pieces: Sequence[str]) -> tuple[list[int], list[str]]:
    """``(ids, strings)``: each of ``pieces`` that is one piece of the vocabulary as its id (generation stops when
    the model chooses it), the others as text (the streamed answer stops where it appears)."""
    if not pieces:
        return [], []
    ids_of: dict[str, int] = {}
    for i, piece in enumerate(tok.src_pieces_from_ids(range(tok.src_vocab_size))):
        if i not in tok.absent_ids:
            ids_of.setdefault(piece, i)
    ids = [ids_of[p] for p in pieces if p in ids_of]
    return list(dict.fromkeys(ids)), [p for p in pieces if p not in ids_of]
