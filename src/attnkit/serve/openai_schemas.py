"""The OpenAI-compatible API's shapes (:mod:`attnkit.serve.openai_routes`): requests and responses with the fields of
OpenAI's API reference, and its error.

**Requests** are strict as the native ones (:class:`~attnkit.serve.schemas.Strict`: JSON types as given, an unknown
field is an error naming it). A field of OpenAI's that attnkit does not implement is taken only with a value that
asks for nothing (``"logprobs": false``, ``"tools": []``, ``"presence_penalty": 0``): any other value would change
the answer, so it is a 400 naming the field (:data:`CHAT_UNSUPPORTED`, :data:`COMPLETION_UNSUPPORTED`). Fields that
change nothing in the answer (``user``, ``metadata``, ``store``, ``service_tier``, ...) are taken and ignored.
Two fields are attnkit's own, as other servers add them: ``top_k`` and ``beyond_context`` (``POST /generate``'s).

**Errors** are OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}`` (:func:`openai_error`): ``type``
``invalid_request_error`` for a 4xx, ``server_error`` for a 5xx; ``param`` the field at fault where one is;
``code`` ``invalid_api_key`` (401) and ``model_not_found`` (404). A request that does not fit the schema is a 400,
as OpenAI answers it (the native routes' 422).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException

from .schemas import MAX_STOPS, Strict, check_stops, error_response, valid_unicode, validation_problems

__all__ = ["CHAT_UNSUPPORTED", "COMPLETION_UNSUPPORTED", "MAX_CHOICES", "OPENAI_PREFIX", "APIError", "ChatCompletion",
           "ChatCompletionRequest", "ChatMessage", "Completion", "CompletionRequest", "ModelCard", "ModelList",
           "Usage", "error_answer", "error_body", "openai_error", "validation_answer"]

#: The paths of the OpenAI-compatible routes begin so; errors there are OpenAI's shape (:func:`error_answer`).
OPENAI_PREFIX = "/v1/"
#: The most choices (``n``) one request may ask for (each is a row of the running batch).
MAX_CHOICES = 16

#: Chat fields of OpenAI's that attnkit does not implement -> the values that ask for nothing (taken, ignored).
CHAT_UNSUPPORTED: dict[str, tuple] = {
    "logprobs": (None, False), "top_logprobs": (None, 0), "logit_bias": (None, {}), "tools": (None, []),
    "tool_choice": (None, "none", "auto"), "functions": (None, []), "function_call": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}), "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0), "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,),
    "web_search_options": (None,), "reasoning_effort": (None,)}
#: The same for completions.
COMPLETION_UNSUPPORTED: dict[str, tuple] = {
    "logprobs": (None,), "echo": (None, False), "suffix": (None, ""), "best_of": (None, 1), "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0)}


def _asks_nothing(value: Any, harmless: tuple) -> bool:
    """``value`` is one of ``harmless``, of the same JSON type (``0`` is not ``false``)."""
    return any(value == h and type(value) is type(h) for h in harmless)


def _unsupported(table: dict[str, tuple], name: str) -> Any:
    """The field ``name`` of ``table``, described in the OpenAPI schema."""
    taken = " or ".join(json.dumps(h) for h in table[name])
    return Field(None, description=f"not implemented: taken only as {taken}, which asks for nothing")


def _refuse_unsupported(table: dict[str, tuple]) -> Any:
    """A validator of the fields of ``table``: a value that asks for something attnkit does not do is refused."""

    def refuse(cls: type, value: Any, info: ValidationInfo) -> Any:
        harmless = table[info.field_name]
        if not _asks_nothing(value, harmless):
            taken = " or ".join(json.dumps(h) for h in harmless)
            raise PydanticCustomError("unsupported", "not supported by attnkit serve (it would change the answer); "
                                      "leave it out, or send {taken}", {"taken": taken})
        return value

    return field_validator(*table, mode="before")(classmethod(refuse))


def _as_list(value: Any, expected: str) -> Any:
    """A string as a list of one, a list or null as it is; anything else is refused with ``expected``."""
    if value is None or isinstance(value, list):
        return value
    if isinstance(value, str):
        return [value]
    raise PydanticCustomError("string_or_list", expected, {})


class StreamOptions(Strict):
    include_usage: bool = Field(False, description="a last chunk (before [DONE]) with the usage and no choices")
    include_obfuscation: bool | None = Field(None, description="taken and ignored: nothing is padded")


class _Sampled(Strict):
    """What both requests take: the model, how many tokens, how to sample, how to answer."""

    model: str | None = Field(None, description="the model's id (GET /v1/models); optional when one language "
                                                "model is served")
    max_tokens: int | None = Field(None, description="the most tokens of each choice, 1..the server's "
                                                     "--max-new-tokens (default: 256, or that limit if lower, or what "
                                                     "fits in the model's context)")
    temperature: float | None = Field(None, description="softmax temperature; 0 is greedy (default 1)")
    top_p: float | None = Field(None, description="nucleus sampling, in (0, 1] (default 1)")
    top_k: int | None = Field(None, description="attnkit's: sample among the k most likely tokens (default 0: all)")
    n: int | None = Field(None, ge=1, le=MAX_CHOICES, description="choices, each sampled with its own seed "
                                                                  "(seed, seed + 1, ...)")
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="the same answer every time: attnkit "
                                                                  "generate's for --seed")
    stop: list[str] | None = Field(None, description=f"stop at the first of these strings (not returned), or at this "
                                                     f"one string; at most {MAX_STOPS}")
    stream: bool | None = Field(None, description="answer server-sent events, ending with data: [DONE]")
    stream_options: StreamOptions | None = None
    beyond_context: bool = Field(False, description="attnkit's: let prompt and answer run past the context a rope, "
                                                    "alibi or position-free model was trained on")
    user: Any = Field(None, description="taken and ignored")

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop(cls, stop: Any) -> Any:
        return _as_list(stop, "give a string or a list of strings")

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: list[str] | None) -> list[str]:
        stops = stop or []
        if len(stops) > MAX_STOPS:
            raise PydanticCustomError("too_many_stops", "at most {most} stop strings", {"most": MAX_STOPS})
        return check_stops(stops)

    @property
    def stops(self) -> tuple[str, ...]:
        return tuple(self.stop or ())


class CompletionRequest(_Sampled):
    """``POST /v1/completions``: continue ``prompt`` (or each of a list of prompts), as ``POST /generate``."""

    prompt: list[str] = Field(min_length=1, description="the text to continue, or a list of texts (each gets n "
                                                        "choices)")
    logprobs: Any = _unsupported(COMPLETION_UNSUPPORTED, "logprobs")
    echo: Any = _unsupported(COMPLETION_UNSUPPORTED, "echo")
    suffix: Any = _unsupported(COMPLETION_UNSUPPORTED, "suffix")
    best_of: Any = _unsupported(COMPLETION_UNSUPPORTED, "best_of")
    logit_bias: Any = _unsupported(COMPLETION_UNSUPPORTED, "logit_bias")
    presence_penalty: Any = _unsupported(COMPLETION_UNSUPPORTED, "presence_penalty")
    frequency_penalty: Any = _unsupported(COMPLETION_UNSUPPORTED, "frequency_penalty")

    _refused = _refuse_unsupported(COMPLETION_UNSUPPORTED)

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> Any:
        expected = "give a text or a list of texts (token ids are not taken: a model's ids are its own vocabulary's)"
        if isinstance(prompt, list) and any(isinstance(p, int | list) for p in prompt):
            raise PydanticCustomError("string_or_list", expected, {})
        return _as_list(prompt, expected)

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt: list[str]) -> list[str]:
        for i, text in enumerate(prompt):
            valid_unicode(text, f"prompt[{i}]")
        return prompt


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def for_template(self) -> dict[str, str]:
        """The message as a chat template reads it: ``developer`` is ``system`` (OpenAI's newer name for it), the
        text parts of a list are joined by line breaks, ``name`` is kept where given."""
        text = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        message = {"role": "system" if self.role == "developer" else self.role, "content": text}
        return message if self.name is None else {**message, "name": self.name}


class ChatCompletionRequest(_Sampled):
    """``POST /v1/chat/completions``: answer the conversation ``messages``, laid out by the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1, description="the conversation so far, oldest first")
    max_completion_tokens: int | None = Field(None, description="OpenAI's newer name for max_tokens")
    logprobs: Any = _unsupported(CHAT_UNSUPPORTED, "logprobs")
    top_logprobs: Any = _unsupported(CHAT_UNSUPPORTED, "top_logprobs")
    logit_bias: Any = _unsupported(CHAT_UNSUPPORTED, "logit_bias")
    tools: Any = _unsupported(CHAT_UNSUPPORTED, "tools")
    tool_choice: Any = _unsupported(CHAT_UNSUPPORTED, "tool_choice")
    functions: Any = _unsupported(CHAT_UNSUPPORTED, "functions")
    function_call: Any = _unsupported(CHAT_UNSUPPORTED, "function_call")
    response_format: Any = _unsupported(CHAT_UNSUPPORTED, "response_format")
    presence_penalty: Any = _unsupported(CHAT_UNSUPPORTED, "presence_penalty")
    frequency_penalty: Any = _unsupported(CHAT_UNSUPPORTED, "frequency_penalty")
    modalities: Any = _unsupported(CHAT_UNSUPPORTED, "modalities")
    audio: Any = _unsupported(CHAT_UNSUPPORTED, "audio")
    prediction: Any = _unsupported(CHAT_UNSUPPORTED, "prediction")
    web_search_options: Any = _unsupported(CHAT_UNSUPPORTED, "web_search_options")
    reasoning_effort: Any = _unsupported(CHAT_UNSUPPORTED, "reasoning_effort")
    parallel_tool_calls: Any = Field(None, description="taken and ignored (no tools)")
    metadata: Any = Field(None, description="taken and ignored")
    store: Any = Field(None, description="taken and ignored: nothing is stored")
    service_tier: Any = Field(None, description="taken and ignored")
    safety_identifier: Any = Field(None, description="taken and ignored")
    prompt_cache_key: Any = Field(None, description="taken and ignored")

    _refused = _refuse_unsupported(CHAT_UNSUPPORTED)

    @field_validator("messages")
    @classmethod
    def _unicode(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        for i, m in enumerate(messages):
            valid_unicode(m.for_template()["content"], f"messages[{i}].content")
            valid_unicode(m.name or "", f"messages[{i}].name")
        return messages


# -- responses ----------------------------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int = Field(description="the prompts' tokens (each prompt once, whatever n)")
    completion_tokens: int = Field(description="the tokens generated, every choice's, the end token included")
    total_tokens: int


class _Choice(BaseModel):
    """What a choice of either route has besides its text: its index, its ending, no log-probabilities."""

    index: int
    logprobs: None = None
    finish_reason: Literal["stop", "length"]


class _Answer(BaseModel):
    """What an answer of either route has besides its kind and its choices."""

    id: str
    created: int
    model: str
    usage: Usage


class CompletionChoice(_Choice):
    text: str


class Completion(_Answer):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Choice):
    message: AssistantMessage


class ChatCompletion(_Answer):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(description="when this server loaded it (Unix seconds)")
    owned_by: str = "attnkit"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- errors -------------------------------------------------------------------------------------------------------


class APIError(HTTPException):
    """An error of the OpenAI-compatible routes that names its ``param`` (the field at fault) or its ``code``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(status, message)
        self.param, self.code = param, code


#: OpenAI's ``code`` of an error answered outside a route (the API-key gate).
_CODES = {401: "invalid_api_key"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object, ``{"error": {"message", "type", "param", "code"}}``."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code or _CODES.get(status)}}


def openai_error(status: int, message: str, headers: dict[str, str] | None = None, param: str | None = None,
                 code: str | None = None) -> JSONResponse:
    """An error in OpenAI's shape (:func:`error_body`); the native routes' 422 is OpenAI's 400."""
    status = 400 if status == 422 else status
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def error_answer(path: str, status: int, message: str, headers: dict[str, str] | None = None,
                 exc: Exception | None = None) -> JSONResponse:
    """The error answer to a request for ``path``: OpenAI's shape under :data:`OPENAI_PREFIX` (with ``exc``'s
    ``param`` and ``code``, an :class:`APIError`'s), the native ``{"error": "..."}`` elsewhere."""
    if path.startswith(OPENAI_PREFIX):
        return openai_error(status, message, headers, getattr(exc, "param", None), getattr(exc, "code", None))
    return error_response(status, message, headers)


def validation_answer(request: Request, exc: RequestValidationError) -> JSONResponse:
    """A request that does not fit its schema: OpenAI's 400 naming the first field at fault under
    :data:`OPENAI_PREFIX`, the native 422 elsewhere (the app's exception handler)."""
    message, detail = validation_problems(request, exc)
    if request.url.path.startswith(OPENAI_PREFIX):
        return openai_error(400, message, param=detail[0]["field"] if detail else None)
    return error_response(422, message, detail=detail)
