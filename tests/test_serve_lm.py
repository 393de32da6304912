"""Serving a language model (``POST /generate``; attnkit.serve.generation): the app in process (Starlette's
TestClient runs its lifespan, so its worker) with a tiny character model trained once. Answers, JSON and streamed,
equal ``attnkit generate``'s for the same seed; concurrent requests share decoding steps without changing their
texts; a client that goes away frees its row; caps answer a JSON 4xx; the metrics; attention; a CTranslate2
export behind the same route."""

from __future__ import annotations

import json
import socket
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from attnkit.engine import Engine
from attnkit.serve.app import create_app
from attnkit.serve.batching import Limits
from attnkit.serve.servables import RunServable, load_servable
from attnkit.tasks import attention_maps, load_run
from attnkit.viz.explorer import explorer_data
from test_lm_task import cli, corpus, lm_config, train_lm

with warnings.catch_warnings():  # Starlette >= 1 asks for httpx2 under its TestClient; httpx still works
    warnings.filterwarnings("ignore", message="Using `httpx` with `starlette.testclient` is deprecated")
    from fastapi.testclient import TestClient

PROMPT = "ROMEO:\n"  # 7 tokens of a model with 48 positions


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory) -> Path:
    """A tiny character model (learned positions, max_len 48), trained a little so that its text has some shape."""
    tmp = tmp_path_factory.mktemp("serve-lm")
    (tmp / "train.txt").write_text(corpus(200), encoding="utf-8")
    train_lm(lm_config(tmp / "train.txt", train_options={"max_updates": 40, "valid_every": 40, "lr": 1e-2}),
             tmp / "play")
    return tmp / "play"


@pytest.fixture(scope="module")
def play(lm_run: Path) -> RunServable:
    return RunServable(load_run(lm_run), "play")


@pytest.fixture(scope="module")
def client(play: RunServable):
    with TestClient(create_app([play], Limits(max_wait_ms=0, max_new_tokens=40, max_chars=100))) as c:
        yield c


def slow(servable: RunServable, seconds: float) -> None:
    """Every forward pass of the servable's model takes ``seconds`` longer (its own copy of the run)."""
    servable.run.model.out_proj.register_forward_hook(lambda *_: time.sleep(seconds))


def reference(capsys, lm_run: Path, *options: str, prompt: str = PROMPT) -> str:
    """``attnkit generate --no-echo``'s continuation."""
    code, out, err = cli(capsys, "generate", lm_run, "--prompt", prompt, "--no-echo", *options)
    assert code == 0, err
    assert out.endswith("\n")
    return out[:-1]


def events(response) -> list[dict]:
    """The server-sent events of a streamed answer, parsed."""
    assert response.headers["content-type"].startswith("text/event-stream")
    chunks = [c for c in response.text.split("\n\n") if c]
    assert all(c.startswith("data: ") for c in chunks), chunks
    return [json.loads(c[len("data: "):]) for c in chunks]


def assert_error(response, status: int, *needles: str) -> str:
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"] == "application/json"
    message = response.json()["error"]
    assert "\n" not in message
    for needle in needles:
        assert needle in message, (needle, message)
    return message


def scrape(client) -> dict[tuple[str, frozenset], float]:
    text = client.get("/metrics").text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


# -- answers ---------------------------------------------------------------------------------------


def test_models_lists_the_language_model(client, play):
    (model,) = client.get("/models").json()["models"]
    assert model["name"] == "play" and model["task"] == "generate" and model["context"] == 48
    assert model["parameters"] == sum(p.numel() for p in play.run.model.parameters())
    assert client.post("/translate", json={"texts": ["x"]}).status_code == 422  # no translation model here


@pytest.mark.parametrize("options", [
    {"temperature": 1.0, "seed": 3},
    {"temperature": 0.0},
    {"temperature": 0.9, "top_k": 5, "top_p": 0.9, "seed": 11},
    {"temperature": 1.0, "seed": 5, "stop": ["e", "o"]},
], ids=["sampled", "greedy", "top-k-top-p", "stop"])
def test_json_and_stream_answers_are_attnkit_generate_for_the_seed(client, lm_run, capsys, options):
    flags = ["--max-new-tokens", "30", "--temperature", str(options["temperature"]),
             "--seed", str(options.get("seed", 1)), "--top-k", str(options.get("top_k", 0)),
             "--top-p", str(options.get("top_p", 1.0))] + [f for s in options.get("stop", []) for f in ("--stop", s)]
    expected = reference(capsys, lm_run, *flags)
    body = {"prompt": PROMPT, "max_new_tokens": 30, **options}
    answer = client.post("/generate", json=body)
    assert answer.status_code == 200, answer.text
    got = answer.json()
    assert got["text"] == expected
    assert got["prompt_tokens"] == 7 and got["model"] == "play"
    assert got["finish_reason"] in ("eos", "length", "stop")
    if "stop" in options:
        assert got["finish_reason"] == "stop"
    if got["finish_reason"] == "length":
        assert got["tokens"] == 30
    if options["temperature"] > 0:
        assert got["seed"] == options["seed"]

    streamed = events(client.post("/generate", json={**body, "stream": True}))
    *tokens, last = streamed
    assert [set(e) for e in tokens] == [{"token", "id"}] * len(tokens)
    assert "".join(e["token"] for e in tokens) == expected == last["text"]
    assert len(tokens) == last["tokens"] == got["tokens"]
    assert last["finish_reason"] == got["finish_reason"] and last["prompt_tokens"] == 7


def test_an_unseeded_request_says_its_seed_and_that_seed_gives_its_text_again(client):
    first = client.post("/generate", json={"prompt": PROMPT, "max_new_tokens": 20, "temperature": 1.0}).json()
    again = client.post("/generate", json={"prompt": PROMPT, "max_new_tokens": 20, "temperature": 1.0,
                                           "seed": first["seed"]}).json()
    assert isinstance(first["seed"], int) and again["text"] == first["text"]


def test_concurrent_requests_share_decoding_steps_and_keep_their_texts(lm_run):
    """Requests sent at once, with different seeds, prompts and options, decode in one running batch (rows per step
    above one) and each gets the text it gets alone."""
    served = RunServable(load_run(lm_run), "play")
    slow(served, 0.002)  # steps long enough for the requests to overlap
    bodies = [{"prompt": p, "max_new_tokens": n, "temperature": t, "seed": s}
              for p, n, t, s in [(PROMPT, 30, 1.0, 1), ("JULIET:\n", 25, 0.0, 2), ("the king", 35, 0.8, 3),
                                 ("NURSE:", 20, 1.2, 4), ("my lord", 30, 0.0, 5), ("sweet ", 28, 1.0, 6)]]
    with TestClient(create_app([served], Limits(max_wait_ms=0))) as client:
        alone = [client.post("/generate", json=b).json()["text"] for b in bodies]
        before = client.get("/health").json()["models"]["play"]
        with ThreadPoolExecutor(len(bodies)) as pool:
            together = list(pool.map(lambda b: client.post("/generate", json=b).json()["text"], bodies))
        after = client.get("/health").json()["models"]["play"]
    assert together == alone
    steps, rows = after["batches"] - before["batches"], after["batch_texts"] - before["batch_texts"]
    assert rows / steps > 1.5, (rows, steps)  # the requests shared decoding steps


# -- cancelling and caps ---------------------------------------------------------------------------


def wait_until(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_stream_closed_early_frees_its_row_and_the_server_goes_on(lm_run):
    served = RunServable(load_run(lm_run), "play")
    slow(served, 0.05)  # 40 tokens would take 2 s
    app = create_app([served], Limits(max_wait_ms=0, max_new_tokens=40))
    with TestClient(app) as client:
        state = app.app.app.state.serve  # Measured(_Gate(FastAPI)): the app's own state
        body = {"prompt": PROMPT, "max_new_tokens": 40, "temperature": 1.0, "seed": 2, "stream": True}
        started = time.monotonic()
        with client.stream("POST", "/generate", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    break  # the first token came: go away
        wait_until(lambda: state.streams["play"] == 0 and served.stepper.running == 0)
        assert time.monotonic() - started < 1.5  # not the 40 tokens' 2 s: the row left early
        assert scrape(client)[("attnkit_serve_active_streams", frozenset({("model", "play")}))] == 0
        after = client.post("/generate", json={"prompt": PROMPT, "max_new_tokens": 3, "temperature": 0.0})
        assert after.status_code == 200 and after.json()["tokens"] >= 1


def test_beyond_max_streams_is_429_and_the_server_goes_on(lm_run):
    served = RunServable(load_run(lm_run), "play")
    gate = threading.Event()
    served.run.model.out_proj.register_forward_hook(lambda *_: None if gate.wait(10) else None)
    app = create_app([served], Limits(max_wait_ms=0, max_streams=1))
    with TestClient(app) as client:
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(client.post, "/generate", json={"prompt": PROMPT, "max_new_tokens": 5, "seed": 1})
            wait_until(lambda: app.app.app.state.serve.streams["play"] == 1)
            refused = client.post("/generate", json={"prompt": PROMPT, "max_new_tokens": 5})
            gate.set()
            assert first.result().status_code == 200
        assert_error(refused, 429, "--max-streams")
        assert refused.headers["retry-after"] == "1"
        assert client.post("/generate", json={"prompt": PROMPT, "max_new_tokens": 5}).status_code == 200


@pytest.mark.parametrize("stream", [False, True], ids=["json", "streamed"])
def test_a_request_whose_row_fails_ends_alone_and_the_batch_goes_on(lm_run, caplog, stream):
    """A row that fails in a running batch (its logits made NaN by a hook: sampling cannot draw from them) ends its
    own request, a 500 that closes its connection (or, streamed, an error event), with one line on the log; the
    requests decoded beside it get the text they get alone, and the server goes on."""
    served = RunServable(load_run(lm_run), "play")
    slow(served, 0.01)
    poison = threading.Event()

    def nan_first_row(_module, _inputs, logits: torch.Tensor) -> torch.Tensor | None:
        if poison.is_set() and logits.size(0) == 3 == served.stepper.decoder.running:  # a step of the three
            poison.clear()
            logits = logits.clone()
            logits[0] = float("nan")  # the oldest row: the request that joined first
            return logits
        return None

    served.run.model.out_proj.register_forward_hook(nan_first_row)
    bad = {"prompt": PROMPT, "max_new_tokens": 40, "temperature": 1.0, "seed": 1, "stream": stream}
    others = [{"prompt": "the king", "max_new_tokens": 20, "temperature": 0.0},
              {"prompt": "NURSE:", "max_new_tokens": 20, "temperature": 0.9, "seed": 5}]
    app = create_app([served], Limits(max_wait_ms=0))
    with TestClient(app) as client:
        alone = [client.post("/generate", json=b).json()["text"] for b in others]
        poison.set()
        caplog.clear()
        with ThreadPoolExecutor(3) as pool:
            failing = pool.submit(client.post, "/generate", json=bad)
            wait_until(lambda: served.stepper.decoder.running == 1)
            beside = list(pool.map(lambda b: client.post("/generate", json=b), others))
            failed = failing.result()
        wait_until(lambda: served.stepper.running == 0)
        after = client.post("/generate", json={**bad, "stream": False})
    assert not poison.is_set()  # the three shared a step, where the first one's row failed
    assert [r.json()["text"] for r in beside] == alone
    if stream:
        assert events(failed)[-1] == {"error": "internal error (RuntimeError)"}
    else:
        assert_error(failed, 500, "internal error (RuntimeError)")
        assert failed.headers["connection"] == "close"
    logged = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(logged) == 1 and "\n" not in logged[0].getMessage() and logged[0].exc_info is None
    assert "internal error in POST /generate" in logged[0].getMessage()
    assert after.status_code == 200 and after.json()["tokens"] >= 1


def test_every_request_is_counted_once_streams_closed_early_too(lm_run):
    """``attnkit_serve_requests_total`` counts each request once: a stream whose client went away before its end
    as 499, the others with their status."""
    served = RunServable(load_run(lm_run), "play")
    slow(served, 0.02)
    app = create_app([served], Limits(max_wait_ms=0))
    body = {"prompt": PROMPT, "max_new_tokens": 30, "temperature": 1.0, "seed": 2}

    def counted(samples: dict) -> dict[str, float]:
        return {dict(labels)["status"]: value for (name, labels), value in samples.items()
                if name == "attnkit_serve_requests_total" and dict(labels)["route"] == "/generate"}

    with TestClient(app) as client:
        for _ in range(4):
            with client.stream("POST", "/generate", json={**body, "stream": True}) as response:
                next(line for line in response.iter_lines() if line.startswith("data: "))  # one token, then away
        events(client.post("/generate", json={**body, "max_new_tokens": 3, "stream": True}))
        assert client.post("/generate", json={**body, "max_new_tokens": 3}).status_code == 200
        assert client.post("/generate", json={**body, "top_p": 2.0}).status_code == 422
        wait_until(lambda: sum(counted(scrape(client)).values()) >= 7)
        time.sleep(0.2)  # a request counted twice would be by now
        assert counted(scrape(client)) == {"499": 4, "200": 2, "422": 1}


@pytest.mark.parametrize("body, status, needles", [
    ({"prompt": PROMPT, "max_new_tokens": 41}, 422, ["max_new_tokens must be in 1..40", "--max-new-tokens"]),
    ({"prompt": PROMPT, "max_new_tokens": 0}, 422, ["max_new_tokens must be in 1..40"]),
    ({"prompt": "x" * 101}, 413, ["prompt: 101 characters", "--max-chars"]),
    ({"prompt": "ROMEO: " * 6, "max_new_tokens": 20}, 422, ["the prompt (42 tokens)", "48 positions",
                                                             "max_new_tokens 20", "at most 6 tokens"]),
    ({"prompt": "ROMEO: " * 7}, 422, ["the prompt (49 tokens) leaves no room in the model's 48 positions"]),
    ({"prompt": "ROMEO: " * 6, "max_new_tokens": 20, "beyond_context": True}, 422, ["48 positions"]),  # a table
    ({"prompt": PROMPT, "temperature": -1.0}, 422, ["temperature must be a finite number >= 0"]),
    ({"prompt": PROMPT, "top_p": 0.0}, 422, ["top_p must be in (0, 1]"]),
    ({"prompt": PROMPT, "top_k": -2}, 422, ["top_k must be >= 0"]),
    ({"prompt": "ZZ top"}, 422, ["'Z'", "not in this model's vocabulary"]),
    ({"prompt": ""}, 422, ["prompt"]),
    ({"prompt": PROMPT, "stream": True, "attention": True}, 422, ["attention: not with stream"]),
    ({"prompt": PROMPT, "stop": [""]}, 422, ["stop[0] must be 1..100 characters"]),
    ({"prompt": PROMPT, "max_new_tokens": "5"}, 422, ["max_new_tokens"]),
    ({"prompt": PROMPT, "temprature": 1.0}, 422, ["temprature"]),
    ({"prompt": PROMPT, "seed": -1}, 422, ["seed"]),
    ({"prompt": PROMPT, "model": "elsewhere"}, 404, ["'elsewhere'"]),
])
def test_bad_requests_get_a_one_line_json_4xx_and_the_server_goes_on(client, body, status, needles):
    assert_error(client.post("/generate", json=body), status, *needles)
    ok = client.post("/generate", json={"prompt": PROMPT, "max_new_tokens": 2, "temperature": 0.0})
    assert ok.status_code == 200


def test_a_request_without_max_new_tokens_gets_what_fits(client, capsys, lm_run):
    """The default (256, at most --max-new-tokens: 40 here) never asks for more than the context leaves: a prompt of
    42 of the model's 48 positions gets 6 tokens, attnkit generate's default continuation."""
    prompt = "ROMEO: " * 6
    answer = client.post("/generate", json={"prompt": prompt, "temperature": 0.0})
    assert answer.status_code == 200, answer.text
    assert answer.json()["text"] == reference(capsys, lm_run, "--temperature", "0", prompt=prompt)
    assert answer.json()["tokens"] <= 6
    assert client.post("/generate", json={"prompt": PROMPT, "temperature": 0.0}).json()["tokens"] <= 40


# -- metrics, attention, the page ------------------------------------------------------------------


def test_metrics_time_to_first_token_tokens_and_active_streams(lm_run):
    served = RunServable(load_run(lm_run), "play")
    with TestClient(create_app([served], Limits(max_wait_ms=0))) as client:
        answers = [client.post("/generate", json={"prompt": PROMPT, "max_new_tokens": n, "temperature": 1.0,
                                                  "seed": n}).json() for n in (5, 12)]
        answers += [events(client.post("/generate", json={"prompt": PROMPT, "max_new_tokens": 9, "seed": 9,
                                                          "stream": True}))[-1]]
        samples = scrape(client)
    model = frozenset({("model", "play")})
    assert samples[("attnkit_serve_time_to_first_token_seconds_count", model)] == 3
    assert samples[("attnkit_serve_time_to_first_token_seconds_sum", model)] > 0
    assert samples[("attnkit_serve_generated_tokens_total", model)] == sum(a["tokens"] for a in answers)
    assert samples[("attnkit_serve_generation_tokens_per_second_count", model)] == sum(a["tokens"] > 1
                                                                                       for a in answers)
    assert samples[("attnkit_serve_active_streams", model)] == 0
    assert samples[("attnkit_serve_requests_total", frozenset({("route", "/generate"), ("status", "200")}))] == 3


def test_attention_is_the_explorer_data_of_prompt_and_continuation(client, play):
    got = client.post("/generate", json={"prompt": PROMPT, "max_new_tokens": 12, "temperature": 0.0,
                                         "attention": True}).json()
    maps = attention_maps(play.run, PROMPT, got["text"])
    assert got["attention"] == json.loads(json.dumps(explorer_data(maps)))
    assert "head_scores" in json.dumps(got["attention"]) or got["attention"]["views"]


def test_the_page_has_a_prompt_box_that_streams(client):
    page = client.get("/").text
    assert 'id="prompt-options"' in page and '"/generate"' in page and "getReader()" in page


# -- a CTranslate2 export behind the same route ----------------------------------------------------


def test_a_ctranslate2_export_generates_greedily_as_the_run(lm_run, play, tmp_path, capsys):
    pytest.importorskip("ctranslate2")
    pytest.importorskip("attnkit.export.ctranslate2_lm")
    code, _, err = cli(capsys, "export", lm_run, "--to", "ctranslate2", "-o", tmp_path / "play-ct2")
    assert code == 0, err
    exported = load_servable(tmp_path / "play-ct2", threads=1)
    assert exported.info.task == "generate" and exported.stepper is None
    body = {"prompt": PROMPT, "max_new_tokens": 20, "temperature": 0.0}
    with TestClient(create_app([exported, play], Limits(max_wait_ms=0))) as client:
        from_run = client.post("/generate", json={**body, "model": "play"}).json()
        from_export = client.post("/generate", json={**body, "model": "play-ct2"}).json()
        streamed = events(client.post("/generate", json={**body, "model": "play-ct2", "stream": True}))
        with ThreadPoolExecutor(3) as pool:  # arriving together with the same options: one batch
            batched = list(pool.map(lambda _: client.post("/generate", json={**body, "model": "play-ct2"}).json(),
                                    range(3)))
        seeded = client.post("/generate", json={**body, "model": "play-ct2", "seed": 1})
    assert from_export["text"] == from_run["text"] and "seed" not in from_export  # null: left out
    assert_error(seeded, 422, "seed:", "CTranslate2 export")
    assert "".join(e["token"] for e in streamed[:-1]) == from_run["text"] == streamed[-1]["text"]
    assert [b["text"] for b in batched] == [from_run["text"]] * 3


# -- a real server: uvicorn, a client that goes away, the page in a browser ------------------------


@pytest.fixture(scope="module")
def server(lm_run: Path):
    from test_serve import start_server, stop

    url, proc = start_server(str(lm_run), "--max-wait-ms", "0", "--max-new-tokens", "40")
    yield url
    stop(proc)


def test_on_uvicorn_a_stream_closed_early_is_let_go(server, play):
    import httpx

    body = {"prompt": PROMPT, "max_new_tokens": 40, "temperature": 1.0, "seed": 4}
    with httpx.Client(base_url=server, timeout=60) as client:
        whole = client.post("/generate", json=body).json()
        with client.stream("POST", "/generate", json={**body, "stream": True}) as response:
            first = next(line for line in response.iter_lines() if line.startswith("data: "))
        assert json.loads(first[len("data: "):])["id"] >= 0
        wait_until(lambda: "attnkit_serve_active_streams{model=\"play\"} 0.0" in client.get("/metrics").text)
        assert client.post("/generate", json=body).json()["text"] == whole["text"]


def test_page_streams_a_continuation_and_shows_its_attention(browser, server, play):
    """Pick the language model, type a prompt, Generate: the greedy continuation streams in, then its attention."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    browser.get(server + "/")
    wait = WebDriverWait(browser, 60)
    wait.until(lambda d: len(Select(d.find_element(By.ID, "model")).options) == 1)
    assert browser.find_element(By.ID, "run").text == "Generate"
    assert browser.find_element(By.ID, "prompt-options").is_displayed()
    for field, value in (("max-new-tokens", "20"), ("temperature", "0")):
        box = browser.find_element(By.ID, field)
        box.clear()
        box.send_keys(value)
    browser.find_element(By.ID, "source").send_keys(PROMPT.strip())
    browser.find_element(By.ID, "run").click()
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#explorer #keys .tok"))
    expected = attention_maps(play.run, PROMPT.strip(), None, new_tokens=20)  # greedy, as the page asked
    out = browser.find_element(By.CSS_SELECTOR, "#results .continuation .out")
    assert out.get_attribute("textContent") == expected.output
    shown = attention_maps(play.run, PROMPT.strip(), expected.output)  # the page asks for the text it streamed
    assert len(browser.find_elements(By.CSS_SELECTOR, "#keys .tok")) == len(shown.tgt_in_tokens)
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors


def test_a_compiled_server_serves_the_same_texts(lm_run):
    """``attnkit serve --engine compiled``: prompts run through a pass compiled ahead of time and the running rows
    through a compiled step (on the worker's thread, before the first request: for one row and for several); the
    texts, alone and sent together, are the eager server's."""
    bodies = [{"prompt": p, "max_new_tokens": 20, "temperature": t, "seed": s}
              for p, t, s in [(PROMPT, 0.0, 1), (PROMPT, 1.0, 2), ("the king", 0.0, 3), ("the kin", 0.8, 4)]]
    eager = RunServable(load_run(lm_run), "play")
    compiled = RunServable(load_run(lm_run, engine=Engine("compiled")), "play")
    texts = {}
    for served in (eager, compiled):
        slow(served, 0.002)  # steps long enough for the requests to overlap
        with TestClient(create_app([served], Limits(max_wait_ms=0))) as client:
            alone = [client.post("/generate", json=b).json()["text"] for b in bodies]
            with ThreadPoolExecutor(len(bodies)) as pool:
                together = list(pool.map(lambda b: client.post("/generate", json=b).json()["text"], bodies))
        texts[served is compiled] = (alone, together)
    assert texts[True] == texts[False] and texts[False][0] == texts[False][1]
    for passes in (compiled.compiled.prefills, compiled.compiled.steps):
        [programs] = passes.values()  # nothing compiled after the warm-up, whatever the batch
        assert sorted(p.ranges["batch"][0] for p in programs) == [1, 2]


# -- a hostile client on uvicorn: requests that break nothing beside them, bounded heads, bodies and connections --


def test_on_uvicorn_a_flood_with_extreme_options_answers_every_request(server):
    """Requests with the extreme sampling options that once failed their whole batch (temperatures at a float's
    ends, a top-p that is 0 in float32), sent at once among good ones: every one is answered 200, and the good
    ones with the text they get alone."""
    import httpx

    good = [{"prompt": p, "max_new_tokens": 20, "temperature": t, "seed": s}
            for p, t, s in [(PROMPT, 1.0, 1), ("the king", 0.0, 2), ("NURSE:", 0.8, 3), ("my lord", 1.2, 4)] * 3]
    extreme = [{"prompt": PROMPT, "max_new_tokens": 20, **o} for o in
               ({"temperature": 1e-300}, {"temperature": 1e-38}, {"temperature": 1e39}, {"temperature": 1e308},
                {"temperature": 1.0, "top_p": 1e-46}, {"temperature": 1.0, "top_p": 5e-324})]
    with httpx.Client(base_url=server, timeout=60) as client:
        alone = [client.post("/generate", json=b).json()["text"] for b in good[:4]]
        greedy = client.post("/generate", json={"prompt": PROMPT, "max_new_tokens": 20, "temperature": 0.0}).json()
        with ThreadPoolExecutor(len(good) + len(extreme)) as pool:
            answers = list(pool.map(lambda b: client.post("/generate", json=b), good + extreme))
    assert [a.status_code for a in answers] == [200] * len(answers), [a.text for a in answers if a.status_code != 200]
    assert [a.json()["text"] for a in answers[:len(good)]] == alone * 3
    tiny = [answers[len(good) + i].json()["text"] for i in (0, 1, 4, 5)]  # all the probability on the top token
    assert tiny == [greedy["text"]] * 4


@pytest.fixture(scope="module")
def bounded_server(lm_run: Path):
    """A server with an API key, a read timeout of 1 s and at most 8 connections."""
    from test_serve import start_server, stop

    url, proc = start_server(str(lm_run), "--read-timeout", "1", "--max-connections", "8",
                             env={"ATTNKIT_API_KEY": "s3cret"})
    port = int(url.rsplit(":", 1)[1])
    yield port, proc
    assert stop(proc) == 0


def exchange(port: int, raw: bytes = b"", wait: float = 5.0) -> bytes:
    """Send ``raw`` on a new connection and read until the server closes it (what a client that cannot write all of
    ``raw`` reads then); the answer, or what came before the time ran out."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(wait)
        try:
            sock.sendall(raw)
        except OSError:  # the server answered and closed while this was being sent
            pass
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    return data


def answered(data: bytes) -> tuple[int, dict[str, str], dict]:
    """An answer's status, headers (lower case) and JSON body."""
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, json.loads(body)


def rss_kib(proc) -> int:
    return int(next(line.split()[1] for line in open(f"/proc/{proc.pid}/status") if line.startswith("VmRSS")))


def test_on_uvicorn_heads_beyond_their_bounds_are_refused_before_the_api_key(bounded_server):
    """A request target over 8 KiB gets 414, a head over 32 KiB 431, whether it has ended or is still coming,
    before the API key is asked for; the connection closes, and the server holds on to nothing of it."""
    from attnkit.serve.connections import MAX_HEAD_BYTES, MAX_URL_BYTES

    port, proc = bounded_server
    target = b"/generate?" + b"q" * MAX_URL_BYTES
    cases = [(b"POST " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),  # ended
             (b"GET " + target * 8, 414),  # still coming
             (b"GET /models HTTP/1.1\r\nX: " + b"a" * MAX_HEAD_BYTES + b"\r\n\r\n", 431),
             (b"GET /models HTTP/1.1\r\n" + b"X-Many: 1234567890\r\n" * 4000 + b"\r\n", 431),
             (b"GET /models HTTP/1.1\r\nX: " + b"a" * 200_000 + b"\r\n\r\n", 431),
             (b"GET /models HTTP/1.1\r\nX: " + b"a" * 2_000_000, 431)]
    for raw, status in cases:
        got, headers, body = answered(exchange(port, raw))
        assert got == status and headers["connection"] == "close" and str(MAX_URL_BYTES if status == 414 else
                                                                            MAX_HEAD_BYTES) in body["error"]
    before = rss_kib(proc)
    for _ in range(16):  # heads that never end, 2 MB each: buffered whole, they would add 32 MB
        exchange(port, b"GET /models HTTP/1.1\r\nX: " + b"a" * 2_000_000)
    assert rss_kib(proc) - before < 8 * 1024
    status, _, _ = answered(exchange(port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"))
    assert status == 200
    status, _, body = answered(exchange(port, b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"))
    assert status == 401 and "API key missing" in body["error"]  # /generate needs the key


def test_on_uvicorn_slow_heads_and_bodies_get_408_and_lose_their_connection(bounded_server):
    """A head that stalls, a body shorter than its Content-Length, a chunked body that never ends: 408 once the
    read timeout (1 s) has passed, and the connection closes; a connection that sends nothing is closed."""
    port, _ = bounded_server
    post = b"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\nContent-Type: application/json\r\n"
    slow = {"head": b"GET /health HTTP/1.1\r\nHost: x\r\nX-Sl",
            "short body": post + b"Content-Length: 100\r\n\r\n{\"prompt\": ",
            "endless chunks": post + b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"pro\r\n",
            "nothing": b""}
    started = time.monotonic()
    with ThreadPoolExecutor(len(slow)) as pool:
        got = dict(zip(slow, pool.map(lambda raw: exchange(port, raw, wait=10), slow.values()), strict=True))
    assert time.monotonic() - started < 5
    assert got["nothing"] == b""
    for name in ("head", "short body", "endless chunks"):
        status, headers, body = answered(got[name])
        assert status == 408 and headers["connection"] == "close" and "--read-timeout" in body["error"], name


def test_on_uvicorn_connections_beyond_the_limit_are_refused_as_they_open(bounded_server):
    port, _ = bounded_server
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(8)]
    try:
        status, headers, body = answered(exchange(port))  # nothing sent: answered as it opens
        assert status == 503 and headers["retry-after"] == "1" and "--max-connections" in body["error"]
    finally:
        for sock in held:
            sock.close()
    wait_until(lambda: answered(exchange(port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"))[0]
               == 200)
