"""The HTTP API's shapes: requests and responses (pydantic), and the JSON error every failure answers.

Requests are strict (JSON types as given, no unknown fields) so that a misspelt field or a ``"4"``
for 4 is an error naming the field, not a silent default. An error is ``{"error": "..."}`` with a
4xx status (:func:`error_response`); a request that does not fit its schema gets 422 with every
problem in one line, and the problems one by one under ``detail`` (:func:`validation_error`).
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

__all__ = ["MAX_BEAM", "ClassifyRequest", "ClassifyResponse", "GenerateRequest", "GenerateResponse", "Prediction",
           "Strict", "TranslateRequest", "TranslateResponse", "check_stops", "error_response", "valid_unicode",
           "validation_error", "validation_problems"]

#: Largest beam a request may ask for (the search keeps beam x texts hypotheses in memory).
MAX_BEAM = 16
#: Stop strings one ``/generate`` request may give, and the longest (each is searched for after every token).
MAX_STOPS, MAX_STOP_CHARS = 8, 100


class Strict(BaseModel):
    # JSON types as given (no "4" for 4, no 2.0 for 2) and no unknown fields: a misspelt field is an error
    model_config = ConfigDict(strict=True, extra="forbid")


def _texts_field() -> Any:
    return Field(min_length=1, description="the sentences (translation) or texts (classification), one per item")


def _check_unicode(texts: list[str]) -> list[str]:
    """Texts are sent as UTF-8 to the tokenizer: a lone surrogate (``"\\ud800"`` in JSON) cannot be."""
    for i, text in enumerate(texts):
        valid_unicode(text, f"texts[{i}]")
    return texts


def valid_unicode(text: str, where: str) -> str:
    """``text``, when it can be sent as UTF-8 (see :func:`_check_unicode`)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise PydanticCustomError("lone_surrogate", "{where} holds a lone surrogate (\\ud800-\\udfff), which is not "
                                  "a character; send valid Unicode", {"where": where}) from None
    return text


def check_stops(stop: list[str]) -> list[str]:
    """``stop``, when each string is 1..:data:`MAX_STOP_CHARS` characters of valid Unicode."""
    for i, s in enumerate(stop):
        if not 0 < len(s) <= MAX_STOP_CHARS:
            raise PydanticCustomError("stop_length", "stop[{index}] must be 1..{most} characters long",
                                      {"index": i, "most": MAX_STOP_CHARS})
        valid_unicode(s, f"stop[{i}]")
    return stop


class TranslateRequest(Strict):
    model: str | None = Field(None, description="the model's name (GET /models); optional when one "
                                                "translation model is served")
    texts: list[str] = _texts_field()
    beam: int | None = Field(None, ge=1, le=MAX_BEAM, description="beam size, 1 = greedy (default: the model's)")
    n_best: int = Field(1, ge=1, le=MAX_BEAM, description="hypotheses per text, at most beam")
    lenpen: float | None = Field(None, ge=-10.0, le=10.0, allow_inf_nan=False,
                                 description="GNMT length penalty alpha (default: the model's)")
    attention: bool = Field(False, description="also return every attention map of each text (explorer data)")

    _unicode = field_validator("texts")(_check_unicode)


class ClassifyRequest(Strict):
    model: str | None = Field(None, description="the model's name (GET /models); optional when one "
                                                "classification model is served")
    texts: list[str] = _texts_field()
    attention: bool = Field(False, description="also return each text's attention maps (explorer data)")

    _unicode = field_validator("texts")(_check_unicode)


class GenerateRequest(Strict):
    """``POST /generate``: continue ``prompt``. The numbers' ranges are checked as ``attnkit generate`` checks its
    options (:func:`attnkit.inference.language_model.check_sampling`, ``prompt_ids``), with the same messages."""

    model: str | None = Field(None, description="the model's name (GET /models); optional when one language model "
                                                "is served")
    prompt: str = Field(min_length=1, description="the text to continue")
    max_new_tokens: int | None = Field(None, description="the most tokens to generate, 1..the server's "
                                                         "--max-new-tokens (default: 256, or that limit if lower, "
                                                         "or what fits in the model's context after the prompt)")
    beyond_context: bool = Field(False, description="let prompt and continuation run past the context a rope, alibi "
                                                    "or position-free model was trained on (GET /models: context); "
                                                    "its predictions get worse there")
    temperature: float = Field(0.8, description="softmax temperature T = 1/beta; 0 is greedy (as attnkit generate)")
    top_k: int = Field(0, description="sample among the k most likely tokens (0: all)")
    top_p: float = Field(1.0, description="nucleus: the most likely tokens whose probabilities reach p, in (0, 1]")
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="random seed: the same text every time, "
                                                                  "attnkit generate's for --seed (default: a random "
                                                                  "one, returned in the answer)")
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOPS,
                            description=f"stop at the first of these strings (not returned); at most {MAX_STOPS}")
    stream: bool = Field(False, description="answer server-sent events: one per token, then one with the counts")
    attention: bool = Field(False, description="also return the attention maps of prompt and continuation "
                                               "(explorer data, with head scores); not with stream")

    @field_validator("prompt")
    @classmethod
    def _prompt_unicode(cls, prompt: str) -> str:
        return valid_unicode(prompt, "prompt")

    _stops = field_validator("stop")(check_stops)


class GenerateResponse(BaseModel):
    model: str
    text: str = Field(description="the continuation (without the prompt, and without the stop string)")
    tokens: int = Field(description="tokens generated (</s>, and the one that completed a stop string, included)")
    prompt_tokens: int = Field(description="the prompt's tokens")
    finish_reason: str = Field(description="eos (the model ended the document), length (max_new_tokens), or stop")
    seed: int | None = Field(description="the seed it sampled with (null: a CTranslate2 export's own generator)")
    attention: dict | None = Field(None, description="with attention: the explorer data of prompt + continuation")


class TranslateResponse(BaseModel):
    model: str
    translations: list[str] = Field(description="the best translation of each text")
    n_best: list[list[str]] | None = Field(None, description="with n_best > 1: every text's hypotheses, best first")
    attention: list[dict] | None = Field(
        None, description="with attention: per text {title, views: [{kind, title, queries, keys, queries_label, "
                          "keys_label, layers: [layer][head][query][key]}]}; the cross-attention view has the "
                          "target pieces as queries and the source pieces as keys")


class Prediction(BaseModel):
    label: str
    probabilities: dict[str, float]


class ClassifyResponse(BaseModel):
    model: str
    results: list[Prediction]
    attention: list[dict] | None = None


def error_response(status: int, message: str, headers: dict[str, str] | None = None, **extra: Any) -> JSONResponse:
    """The API's error: ``{"error": message, **extra}`` with ``status``."""
    return JSONResponse({"error": message, **extra}, status_code=status, headers=headers)


def _where(loc: tuple) -> str:
    """``("body", "texts", 3)`` -> ``texts[3]``."""
    parts = [p for p in loc if p != "body"]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "body"


def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """422 for a request that does not fit its schema, naming each field (the app's exception handler)."""
    message, detail = validation_problems(request, exc)
    return error_response(422, message, detail=detail)


def validation_problems(request: Request, exc: RequestValidationError) -> tuple[str, list[dict]]:
    """What does not fit the schema: every problem in one line, and each as ``{"field", "message", "type"}``."""
    errors = exc.errors()
    problems = []
    for e in errors:
        if e.get("type") == "json_invalid":
            problems.append(f"body: not valid JSON ({e.get('ctx', {}).get('error', 'decode error')} at character "
                            f"{e['loc'][-1]})")
            continue
        problem = f"{_where(tuple(e['loc']))}: {e['msg']}"
        if tuple(e["loc"]) == ("body",) and "json" not in request.headers.get("content-type", ""):
            problem += " (send JSON with the header Content-Type: application/json)"
        problems.append(problem)
    detail = [{"field": "body" if e.get("type") == "json_invalid" else _where(tuple(e["loc"])), "message": e["msg"],
               "type": e["type"]} for e in errors]
    return "; ".join(problems), detail
