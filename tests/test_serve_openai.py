"""The OpenAI-compatible API of ``attnkit serve`` (attnkit.serve.openai_routes), driven by the real ``openai`` package
against a real uvicorn server on a free port (in a thread of this process, so that the tests can slow a model down or
make one of its rows fail). Two models: a tiny character model trained here (no chat template) and a tiny Qwen2
instruct checkpoint imported with a ChatML template whose greedy answer ends its turn a few tokens in
(tests/test_chat.py builds it). Completions equal ``attnkit generate``'s text for the same seed and options, chat
completions ``attnkit chat --once``'s answer, streamed or not; ``n``, ``stop``, ``max_tokens`` and ``usage``; errors in
OpenAI's shape and status codes; and the hardening guarantees of ``/generate``: a request with extreme options or a
failing row, or a client that leaves mid-stream, breaks nothing beside it."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import pytest
import torch

from attnkit.data.chat_template import end_of_turn
from attnkit.inference.chat import encode_rendered, run_template
from attnkit.sampling import generate
from attnkit.serve.app import create_app, listen
from attnkit.serve.batching import Limits
from attnkit.serve.connections import BoundedHttp
from attnkit.serve.servables import RunServable
from attnkit.tasks import load_run
from attnkit.vocab import EOS_ID
from test_lm_task import cli, corpus, lm_config, train_lm

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("transformers")  # builds the instruct checkpoint
import hf_models  # noqa: E402
from test_chat import ANSWER_TOKENS, QUESTION, instruct_dir  # noqa: E402

KEY = "s3cret"
PROMPT = "ROMEO:\n"  # 7 tokens of the character model's 48 positions
LIMITS = Limits(max_wait_ms=0, max_new_tokens=40, max_chars=600)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory) -> Path:
    """A tiny character model (learned positions, max_len 48), trained a little; no chat template."""
    tmp = tmp_path_factory.mktemp("openai-lm")
    (tmp / "train.txt").write_text(corpus(200), encoding="utf-8")
    train_lm(lm_config(tmp / "train.txt", train_options={"max_updates": 40, "valid_every": 40, "lr": 1e-2}),
             tmp / "play")
    return tmp / "play"


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory) -> Path:
    """A tiny Qwen2 instruct checkpoint (ChatML, ``<|im_end|>`` ends a turn), imported."""
    _, run = hf_models.imported(tmp_path_factory.mktemp("openai-instruct"), instruct_dir)
    return run


class Hooks:
    """What the tests do to a model's forward passes: sleep ``delay`` seconds (steps long enough for requests to
    overlap), and once ``poison`` is set, make the oldest row's logits NaN in a step of three rows."""

    def __init__(self, served: RunServable) -> None:
        self.served, self.delay, self.poison = served, 0.0, threading.Event()
        served.run.model.out_proj.register_forward_hook(self)

    def __call__(self, _module, _inputs, logits: torch.Tensor) -> torch.Tensor | None:
        if self.delay:
            time.sleep(self.delay)
        if self.poison.is_set() and logits.size(0) == 3 == self.served.stepper.decoder.running:
            self.poison.clear()
            logits = logits.clone()
            logits[0] = float("nan")
            return logits
        return None


@pytest.fixture(scope="module")
def served(lm_run, chat_run):
    """``(base URL, the character model's servable, each model's hooks, the app's state)``: uvicorn serving both
    models (as ``play`` and ``chat``) with an API key, in a thread, on a free port."""
    play, chat = RunServable(load_run(lm_run), "play"), RunServable(load_run(chat_run), "chat")
    hooks = {"play": Hooks(play), "chat": Hooks(chat)}
    app = create_app([play, chat], LIMITS, api_key=KEY, threads=1)
    server = uvicorn.Server(uvicorn.Config(app, http=partial(BoundedHttp, limits=LIMITS), ws="none",
                                           log_level="warning", lifespan="on"))
    sock = listen("127.0.0.1", 0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_until(lambda: server.started)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", play, hooks, app.app.app.state.serve
    server.should_exit = True
    thread.join(30)


@pytest.fixture
def client(served):
    """The ``openai`` client, pointed at the server (no retries: a test sees each answer as it came)."""
    return openai.OpenAI(base_url=served[0] + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture
def http(served):
    with httpx.Client(base_url=served[0], headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


def wait_until(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def reference(capsys, lm_run: Path, *options: str, prompt: str = PROMPT) -> str:
    """``attnkit generate --no-echo``'s continuation."""
    code, out, err = cli(capsys, "generate", lm_run, "--prompt", prompt, "--no-echo", *options)
    assert code == 0, err
    return out.removesuffix("\n")


def native(http, **body) -> dict:
    """``POST /generate``'s answer."""
    answer = http.post("/generate", json={"model": "play", **body})
    assert answer.status_code == 200, answer.text
    return answer.json()


def sse(response) -> list[str]:
    """The data of each server-sent event of a streamed answer."""
    assert response.headers["content-type"].startswith("text/event-stream")
    return [c[len("data: "):] for c in response.text.split("\n\n") if c]


# -- models -------------------------------------------------------------------------------------------------------


def test_models_lists_the_language_models(client):
    assert [m.id for m in client.models.list()] == ["chat", "play"]
    card = client.models.retrieve("play")
    assert card.id == "play" and card.object == "model" and card.owned_by == "attnkit" and card.created > 0
    with pytest.raises(openai.NotFoundError) as error:
        client.models.retrieve("elsewhere")
    assert error.value.code == "model_not_found" and "'elsewhere'" in error.value.message


# -- completions: attnkit generate's text ------------------------------------------------------------------------


@pytest.mark.parametrize("options", [
    {"temperature": 1.0, "seed": 3},
    {"temperature": 0.0},
    {"temperature": 0.9, "top_p": 0.9, "seed": 11},
    {"temperature": 1.0, "seed": 5, "stop": ["e", "o"]},
], ids=["sampled", "greedy", "top-p", "stop"])
def test_completions_are_attnkit_generate_for_the_seed(client, http, lm_run, capsys, options):
    flags = ["--max-new-tokens", "30", "--temperature", str(options["temperature"]),
             "--seed", str(options.get("seed", 1)), "--top-p", str(options.get("top_p", 1.0))]
    flags += [f for s in options.get("stop", []) for f in ("--stop", s)]
    expected = reference(capsys, lm_run, *flags)
    counts = native(http, prompt=PROMPT, max_new_tokens=30, **options)
    answer = client.completions.create(model="play", prompt=PROMPT, max_tokens=30, **options)
    (choice,) = answer.choices
    assert choice.text == expected == counts["text"] and choice.index == 0
    assert choice.finish_reason == {"eos": "stop", "stop": "stop", "length": "length"}[counts["finish_reason"]]
    if "stop" in options:
        assert choice.finish_reason == "stop"
    assert answer.object == "text_completion" and answer.id.startswith("cmpl-") and answer.model == "play"
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens, answer.usage.total_tokens) == \
        (7, counts["tokens"], 7 + counts["tokens"])

    chunks = list(client.completions.create(model="play", prompt=PROMPT, max_tokens=30, stream=True,
                                            stream_options={"include_usage": True}, **options))
    *pieces, end, usage = chunks
    assert all(c.choices[0].finish_reason is None and c.choices[0].text for c in pieces)
    assert "".join(c.choices[0].text for c in pieces) == expected
    assert end.choices[0].finish_reason == choice.finish_reason and end.choices[0].text == ""
    assert usage.choices == [] and usage.usage == answer.usage
    assert len({c.id for c in chunks}) == 1


def test_a_stream_ends_with_done(http):
    body = {"model": "play", "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "stream": True}
    events = sse(http.post("/v1/completions", json=body))
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    chunk = json.loads(events[0])
    assert set(chunk) == {"id", "object", "created", "model", "choices"} and "usage" not in chunk
    events = sse(http.post("/v1/chat/completions", json={"model": "chat", "messages": [
        {"role": "user", "content": QUESTION}], "temperature": 0, "stream": True}))
    first = json.loads(events[0])["choices"][0]
    assert events[-1] == "[DONE]" and first["delta"] == {"role": "assistant", "content": ""}


def test_n_choices_are_the_seeds_that_follow(client, http):
    """``n`` choices are ``n`` rows seeded ``seed``, ``seed + 1``, ...; a list of prompts gets ``n`` each, in order;
    the usage counts each prompt once."""
    alone = [native(http, prompt=p, max_new_tokens=12, temperature=1.0, seed=s)
             for p, s in [(PROMPT, 7), (PROMPT, 8), ("the king", 7), ("the king", 8)]]
    answer = client.completions.create(model="play", prompt=[PROMPT, "the king"], n=2, seed=7, max_tokens=12)
    assert [c.text for c in answer.choices] == [a["text"] for a in alone]
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    assert answer.usage.prompt_tokens == 7 + 8 and answer.usage.completion_tokens == sum(a["tokens"] for a in alone)
    streamed = {}
    for chunk in client.completions.create(model="play", prompt=PROMPT, n=2, seed=7, max_tokens=12, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {0: alone[0]["text"], 1: alone[1]["text"]}


def test_max_tokens_ends_with_length(client):
    answer = client.completions.create(model="play", prompt=PROMPT, max_tokens=5, temperature=0)
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 5


# -- chat completions: attnkit chat --once's answer --------------------------------------------------------------


def greedy_answer_tokens(chat_run: Path) -> tuple[int, int]:
    """``(prompt tokens, tokens generated)`` of the greedy answer to :data:`QUESTION`, its end of turn included."""
    run = load_run(chat_run)
    ids = encode_rendered(run.tok, run_template(run, "chat").render([{"role": "user", "content": QUESTION}]))
    ends = set(end_of_turn(run.tok, run.cfg.data.end_of_turn)[0]) | {EOS_ID}
    tokens = [int(t[0]) for t in generate(run.model, [ids], ANSWER_TOKENS, temperature=0)]
    return len(ids), next(i + 1 for i, t in enumerate(tokens) if t in ends)


def test_chat_is_attnkit_chat_once_ending_at_the_end_of_turn(client, chat_run, capsys):
    code, out, err = cli(capsys, "chat", chat_run, "--once", QUESTION, "--temperature", "0",
                         "--max-new-tokens", ANSWER_TOKENS)
    assert code == 0, err
    expected = out.removesuffix("\n")
    prompt_tokens, answer_tokens = greedy_answer_tokens(chat_run)
    messages = [{"role": "user", "content": QUESTION}]
    answer = client.chat.completions.create(model="chat", messages=messages, temperature=0, max_tokens=ANSWER_TOKENS)
    (choice,) = answer.choices
    assert choice.message.content == expected and choice.message.role == "assistant"
    assert choice.finish_reason == "stop" and answer_tokens < ANSWER_TOKENS  # its end of turn, not the budget
    assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-")
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (prompt_tokens, answer_tokens)

    first, *pieces, end = client.chat.completions.create(model="chat", messages=messages, temperature=0,
                                                         max_tokens=ANSWER_TOKENS, stream=True)
    assert first.object == "chat.completion.chunk" and first.choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content for c in pieces) == expected
    assert end.choices[0].finish_reason == "stop" and end.choices[0].delta.content is None


def test_a_sampled_chat_is_attnkit_chat_for_the_seed(client, chat_run, capsys):
    code, out, err = cli(capsys, "chat", chat_run, "--once", "hello there", "--temperature", "1", "--seed", "3",
                         "--max-new-tokens", "12", "--system", "Be brief.")
    assert code == 0, err
    messages = [{"role": "developer", "content": "Be brief."},  # OpenAI's newer name for the system message
                {"role": "user", "content": [{"type": "text", "text": "hello there"}]}]
    answer = client.chat.completions.create(model="chat", messages=messages, temperature=1, seed=3, max_tokens=12)
    assert answer.choices[0].message.content == out.removesuffix("\n")


def test_a_model_without_a_chat_template_still_completes(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="play", messages=[{"role": "user", "content": "hi"}])
    assert "has no chat template" in error.value.message and "/v1/completions" in error.value.message
    assert error.value.type == "invalid_request_error"
    assert client.completions.create(model="play", prompt=PROMPT, max_tokens=3).choices[0].text is not None


# -- errors in OpenAI's shape ------------------------------------------------------------------------------------


@pytest.mark.parametrize("body, status, param, needles", [
    ({"model": "elsewhere"}, 404, "model", ["'elsewhere' is not served here", "GET /v1/models"]),
    ({"temperature": -1.0}, 400, None, ["temperature must be a finite number >= 0"]),
    ({"max_tokens": 41}, 400, None, ["max_tokens must be in 1..40", "--max-new-tokens"]),
    ({"max_completion_tokens": 0}, 400, None, ["max_completion_tokens must be in 1..40"]),
    ({"top_p": 0.0}, 400, None, ["top_p must be in (0, 1]"]),
    ({"n": 17}, 400, "n", ["n:"]),
    ({"seed": -1}, 400, "seed", ["seed:"]),
    ({"stop": [""]}, 400, "stop", ["stop[0] must be 1..100 characters"]),
    ({"temprature": 1.0}, 400, "temprature", ["temprature"]),
    ({"logprobs": True}, 400, "logprobs", ["not supported", "false"]),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools", ["not supported"]),
    ({"response_format": {"type": "json_object"}}, 400, "response_format", ["not supported"]),
    ({"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].role", ["messages[0].role"]),
    ({"messages": []}, 400, "messages", ["messages"]),
    ({"messages": [{"role": "user", "content": "x" * 601}]}, 413, "messages", ["601 characters", "--max-chars"]),
    ({"messages": [{"role": "user", "content": "long " * 20}]}, 400, None,
     ["the conversation (", "128 positions", "max_tokens 40"]),
])
def test_bad_chat_requests_get_openais_error_and_the_server_goes_on(http, body, status, param, needles):
    request = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, **body}
    if "max_completion_tokens" in body:
        del request["max_tokens"]
    answer = http.post("/v1/chat/completions", json=request)
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"] == "application/json"
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and "\n" not in error["message"]
    for needle in needles:
        assert needle in error["message"], (needle, error["message"])
    assert http.post("/v1/chat/completions", json={"model": "chat", "messages": [{"role": "user", "content": "hi"}],
                                                   "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("body, status, param, needles", [
    ({"prompt": [1, 2, 3]}, 400, "prompt", ["token ids are not taken"]),
    ({"prompt": []}, 400, "prompt", ["at least 1"]),
    ({"prompt": "ZZ top"}, 400, None, ["'Z'", "not in this model's vocabulary"]),
    ({"prompt": "x" * 601}, 413, "prompt", ["prompt: 601 characters"]),
    ({"prompt": ["ROMEO: " * 6, "x"], "max_tokens": 20}, 400, None, ["the prompt (42 tokens)", "at most 6 tokens"]),
    ({"stop": 5}, 400, "stop", ["give a string or a list of strings"]),
    ({"echo": True}, 400, "echo", ["not supported"]),
    ({"logprobs": 0}, 400, "logprobs", ["not supported"]),
    ({"model": "chat", "seed": 1, "n": 2, "max_tokens": 3}, 200, None, []),
])
def test_bad_completion_requests_get_openais_error(http, body, status, param, needles):
    answer = http.post("/v1/completions", json={"model": "play", "prompt": PROMPT, "max_tokens": 5, **body})
    assert answer.status_code == status, answer.text
    if status == 200:
        assert [c["index"] for c in answer.json()["choices"]] == [0, 1]
        return
    error = answer.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    for needle in needles:
        assert needle in error["message"], (needle, error["message"])


def test_fields_that_change_nothing_are_taken(client):
    answer = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": QUESTION}],
                                            temperature=0, max_tokens=4, user="someone", logprobs=False,
                                            presence_penalty=0, response_format={"type": "text"}, store=False,
                                            metadata={"k": "v"}, parallel_tool_calls=False)
    assert answer.choices[0].message.content is not None
    answer = client.completions.create(model="play", prompt=PROMPT, max_tokens=3, echo=False, best_of=1,
                                       user="someone", extra_body={"top_k": 5})
    assert answer.choices[0].text is not None


def test_the_api_key_is_a_bearer_token(served, client):
    url = served[0]
    wrong = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as error:
        wrong.models.list()
    assert error.value.code == "invalid_api_key" and "API key wrong" in error.value.message
    for path in ("/v1/models", "/v1/chat/completions"):
        answer = httpx.post(url + path, json={}) if "chat" in path else httpx.get(url + path)
        assert answer.status_code == 401 and answer.headers["www-authenticate"] == "Bearer"
        assert answer.json() == {"error": {"message": "API key missing: send the header Authorization: Bearer KEY",
                                           "type": "invalid_request_error", "param": None,
                                           "code": "invalid_api_key"}}
    assert httpx.get(url + "/models").json() == {"error": "API key missing: send the header Authorization: Bearer "
                                                          "KEY"}  # the native routes keep their shape
    assert [m.id for m in client.models.list()] == ["chat", "play"]


# -- hardening: one bad request breaks nothing beside it ---------------------------------------------------------


def test_extreme_options_beside_good_requests_answer_every_one(served, client):
    """Temperatures at a float's ends and a top-p that is 0 in float32, sent at once among good requests: every one
    is answered, the good ones with the text they get alone, the tiny temperatures with the greedy text."""
    hooks = served[2]["play"]
    good = [{"prompt": p, "max_tokens": 15, "temperature": t, "seed": s}
            for p, t, s in [(PROMPT, 1.0, 1), ("the king", 0.0, 2), ("NURSE:", 0.8, 3)] * 2]
    extreme = [{"prompt": PROMPT, "max_tokens": 15, **o} for o in
               ({"temperature": 1e-300}, {"temperature": 1e308}, {"temperature": 1.0, "top_p": 5e-324})]
    alone = [client.completions.create(model="play", **b).choices[0].text for b in good[:3]]
    greedy = client.completions.create(model="play", prompt=PROMPT, max_tokens=15, temperature=0).choices[0].text
    hooks.delay = 0.002
    try:
        with ThreadPoolExecutor(len(good) + len(extreme)) as pool:
            answers = list(pool.map(lambda b: client.completions.create(model="play", **b), good + extreme))
    finally:
        hooks.delay = 0.0
    assert [a.choices[0].text for a in answers[:len(good)]] == alone * 2
    assert answers[len(good)].choices[0].text == greedy == answers[-1].choices[0].text


@pytest.mark.parametrize("stream", [False, True], ids=["json", "streamed"])
def test_a_failing_row_ends_its_request_alone(served, client, caplog, stream):
    """A row that fails in a running batch (NaN logits) ends its own request: a 500 (streamed: OpenAI's error event,
    which the client raises); the requests decoded beside it get the text they get alone; the server goes on."""
    _, play, hooks, _ = served
    hooks = hooks["play"]
    others = [{"prompt": "the king", "max_tokens": 15, "temperature": 0.0},
              {"prompt": "NURSE:", "max_tokens": 15, "temperature": 0.9, "seed": 5}]
    alone = [client.completions.create(model="play", **b).choices[0].text for b in others]

    def failing():
        answer = client.completions.create(model="play", prompt=PROMPT, max_tokens=40, temperature=1.0, seed=1,
                                           stream=stream)
        return list(answer) if stream else answer

    hooks.delay = 0.01
    hooks.poison.set()
    try:
        with ThreadPoolExecutor(3) as pool:
            bad = pool.submit(failing)
            wait_until(lambda: play.stepper.decoder.running == 1)
            beside = list(pool.map(lambda b: client.completions.create(model="play", **b), others))
            with pytest.raises(openai.APIError) as error:
                bad.result()
    finally:
        hooks.delay = 0.0
    assert not hooks.poison.is_set()  # the three shared a step, where the first one's row failed
    assert "internal error (RuntimeError)" in error.value.message
    if not stream:
        assert isinstance(error.value, openai.InternalServerError) and error.value.type == "server_error"
    assert [a.choices[0].text for a in beside] == alone
    wait_until(lambda: play.stepper.running == 0)
    assert client.completions.create(model="play", prompt=PROMPT, max_tokens=3).usage.completion_tokens >= 1


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_a_client_leaving_mid_stream_frees_its_row(served, client, route):
    _, _, hooks, state = served
    model = "chat" if route == "chat" else "play"

    def create(**options):
        options = {"max_tokens": 40, "temperature": 1.0, **options}
        if route == "chat":
            return client.chat.completions.create(model="chat", messages=[{"role": "user", "content": QUESTION}],
                                                  **options)
        return client.completions.create(model="play", prompt=PROMPT, **options)

    seed = next(s for s in range(20) if create(seed=s).choices[0].finish_reason == "length")  # it runs 40 tokens
    hooks[model].delay = 0.05  # 40 tokens would take 2 s
    try:
        started = time.monotonic()
        stream = create(seed=seed, stream=True)
        next(iter(stream))
        stream.close()
        wait_until(lambda: state.streams[model] == 0 and hooks[model].served.stepper.running == 0)
        assert time.monotonic() - started < 1.5  # not the 40 tokens' 2 s: the row left early
    finally:
        hooks[model].delay = 0.0
    assert create(seed=seed, max_tokens=3).usage.completion_tokens == 3
