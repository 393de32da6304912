"""Tests for attnkit.serve and attnkit.serve.batching: a real `attnkit serve` (uvicorn, a subprocess on a free
port) with a tiny translation and a tiny classification run, driven by httpx: every endpoint equals
the in-process functions it wraps, concurrent requests are batched without changing their results,
every malformed request gets a JSON 4xx, the API key, a full queue, SIGTERM draining; the page in
headless Chromium; the batching worker on its own."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

from attnkit.cli import main
from attnkit.common.errors import UserError
from attnkit.inference.classify import predict
from attnkit.inference.translate import translate_texts
from attnkit.runs.load import LoadedRun
from attnkit.serve.batching import Limits, ModelWorker, QueueFull
from attnkit.tasks import attention_maps, load_run
from attnkit.viz.explorer import explorer_data
from tiny_runs import write_lines

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["3. März 2021", "May 1, 1999", "12.10.1999", "Sonntag, 3. März 2024", "1999-05-01", "2021年3月3日"]
# the limits of the test server: small, so that the 413s are cheap to provoke
LIMITS = ["--max-texts", "8", "--max-chars", "200", "--max-body", "20000", "--max-batch", "8", "--max-wait-ms", "20",
          "--max-attention-texts", "2"]


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    dates: LoadedRun
    reviews: LoadedRun


def start_server(*argv: str, env: dict | None = None, timeout: float = 120) -> tuple[str, subprocess.Popen]:
    """``attnkit serve ARGV --port 0`` in a subprocess; returns (base URL, process) once it listens."""
    proc = subprocess.Popen([sys.executable, "-m", "attnkit", "serve", *argv, "--port", "0", "--threads", "1"],
                            env={**os.environ, "PYTHONPATH": str(ROOT / "src"), **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not lines or not lines[0].startswith("attnkit serve: http://"):
        proc.kill()
        raise RuntimeError(f"the server did not start: {lines} {proc.stderr.read()}")
    return re.search(r"(http://\S+?)/ ", lines[0])[1], proc


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


@pytest.fixture(scope="module")
def runs(translation_run: Path, classifier_run: Path, tmp_path_factory) -> dict[str, Path]:
    """The tiny runs under the names they are served as (a model is named after its run directory)."""
    tmp = tmp_path_factory.mktemp("served")
    (tmp / "dates").symlink_to(translation_run)
    (tmp / "reviews").symlink_to(classifier_run)
    return {"dates": tmp / "dates", "reviews": tmp / "reviews"}


@pytest.fixture(scope="module")
def server(runs: dict[str, Path]):
    url, proc = start_server(str(runs["dates"]), str(runs["reviews"]), *LIMITS)
    yield Server(url, proc, load_run(runs["dates"]), load_run(runs["reviews"]))
    stop(proc)


@pytest.fixture
def client(server: Server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def reference(run: LoadedRun, texts: list[str], beam: int | None = None, n_best: int = 1,
              lenpen: float | None = None) -> list[list[str]]:
    """What `attnkit translate` computes: translate_texts with the run's defaults."""
    return translate_texts(run.model, run.tok, texts, beam=beam or run.cfg.decode_beam, n_best=n_best,
                           lenpen=run.cfg.decode_lenpen if lenpen is None else lenpen)


def assert_error(response: httpx.Response, status: int, *needles: str) -> str:
    """A JSON error with this status whose message names each needle."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"] == "application/json"
    message = response.json()["error"]
    assert isinstance(message, str) and message
    for needle in needles:
        assert needle in message, (needle, message)
    return message


# -- endpoints ---------------------------------------------------------------------------------


def test_health_and_models(client, server):
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["api_key_required"] is False
    assert set(health["models"]) == {"dates", "reviews"}
    models = {m["name"]: m for m in client.get("/models").json()["models"]}
    dates, reviews = models["dates"], models["reviews"]
    assert dates["task"] == "translate" and reviews["task"] == "classify"
    assert dates["parameters"] == sum(p.numel() for p in server.dates.model.parameters())
    assert reviews["parameters"] == sum(p.numel() for p in server.reviews.model.parameters())
    assert (dates["beam"], dates["lenpen"]) == (server.dates.cfg.decode_beam, server.dates.cfg.decode_lenpen)
    assert reviews["classes"] == ["neg", "pos"] and reviews["beam"] is None
    assert dates["precision"] == reviews["precision"] == "eager (float32)"


def test_a_run_served_in_bf16_holds_bf16_weights(runs):
    """--precision bf16: the run's weights are bfloat16 (no cast at every step), and what the servable returns is what
    the same calls give on that run."""
    from attnkit.engine import Engine
    from attnkit.serve.servables import load_servable

    texts = SOURCES[:6]
    bf16 = Engine(precision="bf16")
    served = load_servable(runs["dates"], engine=bf16)
    assert served.info.precision == "eager (bf16)"
    assert {p.dtype for p in served.run.model.parameters()} == {torch.bfloat16}
    run = load_run(runs["dates"], engine=bf16)
    assert served.translate(texts, beam=2, n_best=2, lenpen=0.6) == reference(run, texts, beam=2, n_best=2,
                                                                               lenpen=0.6)
    assert served.attention(texts[0], beam=1, lenpen=0.6).output == attention_maps(run, texts[0], beam=1).output
    reviews = load_servable(runs["reviews"], engine=bf16)
    probs = predict(load_run(runs["reviews"], engine=bf16), ["a good film", "a bad plot"])[0]
    torch.testing.assert_close(torch.tensor(reviews.classify(["a good film", "a bad plot"])), probs.float())
    with pytest.raises(UserError, match="--precision fp16"):
        Engine(precision="fp16")


def test_languages_come_from_corpus_file_names():
    from attnkit.runs.load import language

    assert language("../shared/data/multi30k/train.de.gz") == "de" and language("val.en") == "en"
    assert language("train.src") is None and language("data.tsv") is None and language("") is None


def test_translate_equals_attnkit_translate(client, server, tmp_path, capsys):
    got = client.post("/translate", json={"model": "dates", "texts": SOURCES, "beam": 2, "n_best": 2}).json()
    expected = reference(server.dates, SOURCES, beam=2, n_best=2)
    assert got["n_best"] == expected and got["translations"] == [h[0] for h in expected]
    # the command line, on the same lines
    assert main(["translate", str(server.dates.weights_path.parent), "-i", str(write_lines(tmp_path / "in", SOURCES)),
                 "--beam", "2", "--n-best", "2"]) == 0
    assert capsys.readouterr().out.splitlines() == ["\t".join(h) for h in got["n_best"]]
    # defaults: the model's beam and lenpen; the model may be left out when one translation model is served
    got = client.post("/translate", json={"texts": SOURCES}).json()
    assert got["model"] == "dates" and "n_best" not in got and got["translations"] == [
        h[0] for h in reference(server.dates, SOURCES)]
    got = client.post("/translate", json={"texts": SOURCES[:2], "beam": 1, "lenpen": 1.5}).json()
    assert got["translations"] == [h[0] for h in reference(server.dates, SOURCES[:2], beam=1, lenpen=1.5)]


def test_classify_equals_predict(client, server):
    texts = ["the film was great", "a really awful story", "plot and superb"]
    got = client.post("/classify", json={"model": "reviews", "texts": texts}).json()
    probs, _ = predict(server.reviews, texts)
    assert [r["label"] for r in got["results"]] == ["pos", "neg", "pos"]
    for result, p in zip(got["results"], probs, strict=True):
        assert list(result["probabilities"]) == ["neg", "pos"]
        torch.testing.assert_close(torch.tensor(list(result["probabilities"].values())), p, atol=1e-6, rtol=0)


def test_attention_is_the_explorer_data_of_attention_maps(client, server):
    text = SOURCES[0]
    got = client.post("/translate", json={"texts": [text], "beam": 1, "attention": True}).json()
    maps = attention_maps(server.dates, text, beam=1)
    assert got["attention"] == [json.loads(json.dumps(explorer_data(maps)))]
    cross = got["attention"][0]["views"][0]
    assert cross["kind"] == "cross" and cross["keys"] == maps.src_tokens and cross["queries"] == maps.tgt_tokens
    assert maps.output == got["translations"][0]
    got = client.post("/classify", json={"texts": ["the film was great"], "attention": True}).json()
    assert [v["kind"] for v in got["attention"][0]["views"]] == ["encoder_self", "pooling"]
    # the attention is joined to the response as bytes: the rest of it is what a request without attention gets
    ask = {"texts": SOURCES[:2], "beam": 2, "n_best": 2}
    two = client.post("/translate", json={**ask, "attention": True}).json()
    assert {k: v for k, v in two.items() if k != "attention"} == client.post("/translate", json=ask).json()
    titles = [f"{t} -> {h[0]}" for t, h in zip(SOURCES[:2], two["n_best"], strict=True)]
    assert [a["title"] for a in two["attention"]] == titles
    texts = ["the film was great", "a dull plot"]
    got = client.post("/classify", json={"texts": texts, "attention": True}).json()
    assert {k: v for k, v in got.items() if k != "attention"} == client.post("/classify", json={"texts": texts}).json()
    assert len(got["attention"]) == 2


@pytest.mark.parametrize("beam", [1, 2])
def test_concurrent_requests_are_batched_and_give_the_same_results(client, server, beam):
    """Greedy requests join one running batch (continuous batching), beam searches are merged into whole batches:
    either way each gets what it would get alone."""
    texts = [f"{d}. März {1990 + d}" for d in range(1, 25)] + SOURCES
    before = client.get("/health").json()["models"]["dates"]

    def one(text: str) -> str:
        r = httpx.post(f"{server.url}/translate", json={"texts": [text], "beam": beam}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["translations"][0]

    with ThreadPoolExecutor(len(texts)) as pool:
        served = list(pool.map(one, texts))
    alone = [reference(server.dates, [t], beam=beam)[0][0] for t in texts]  # unbatched, one by one
    assert served == alone
    after = client.get("/health").json()["models"]["dates"]
    assert after["texts"] - before["texts"] == len(texts)
    calls, batched = (after[k] - before[k] for k in ("batches", "batch_texts"))
    assert batched > calls  # some requests shared a model call (a batch, or a decoding step)
    if beam > 1:
        assert calls < len(texts) and batched == len(texts)
    assert after["queued"] == 0


def test_docs_and_openapi(client):
    schema = client.get("/openapi.json").json()
    assert {"/translate", "/classify", "/models", "/health"} <= set(schema["paths"])
    assert "beam" in json.dumps(schema["components"]["schemas"]["TranslateRequest"])
    assert client.get("/docs").status_code == 200


def test_page_is_self_contained(client):
    r = client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in r.headers["content-security-policy"]
    page = r.text
    assert "function mountExplorer" in page and "__ATTNKIT" not in page
    assert not re.search(r"""(src|href)\s*=|<link|@import|url\(""", page)
    assert set(re.findall(r"https?://[^\s\"'<>)`]+", page)) == {"http://www.w3.org/2000/svg"}


# -- errors --------------------------------------------------------------------------------------

JSON = {"Content-Type": "application/json"}
BAD_REQUESTS = [  # (path, body: JSON-able or raw bytes, headers, status, words the error names)
    ("/translate", {"texts": ["x"], "beam": 0}, None, 422, ["beam"]),
    ("/translate", {"texts": ["x"], "beam": 99}, None, 422, ["beam", "16"]),
    ("/translate", {"texts": ["x"], "beam": "2"}, None, 422, ["beam", "integer"]),
    ("/translate", {"texts": ["x"], "beam": 2.5}, None, 422, ["beam"]),
    ("/translate", {"texts": ["x"], "beam": True}, None, 422, ["beam"]),
    ("/translate", b'{"texts": ["x"], "lenpen": NaN}', JSON, 422, ["lenpen", "finite"]),
    ("/translate", b'{"texts": ["x"], "lenpen": -Infinity}', JSON, 422, ["lenpen", "finite"]),
    ("/translate", {"texts": ["x"], "beam": 1, "n_best": 2}, None, 422, ["n_best", "beam"]),
    ("/translate", {"texts": ["x"], "n_best": 0}, None, 422, ["n_best"]),
    ("/translate", {"beam": 1}, None, 422, ["texts", "required"]),
    ("/translate", {"texts": []}, None, 422, ["texts"]),
    ("/translate", {"texts": "Ein Hund."}, None, 422, ["texts", "list"]),
    ("/translate", {"texts": [1, 2]}, None, 422, ["texts[0]", "string"]),
    ("/translate", {"texts": [None]}, None, 422, ["texts[0]"]),
    ("/translate", {"texts": ["x"], "beem": 2}, None, 422, ["beem", "not permitted"]),
    ("/translate", {"texts": ["x"], "attention": "yes"}, None, 422, ["attention"]),
    ("/translate", [{"texts": ["x"]}], None, 422, ["body"]),
    ("/translate", b'{"texts": ["\\ud800"]}', JSON, 422, ["texts", "surrogate"]),
    ("/translate", b'{"texts": ["x"', JSON, 422, ["JSON"]),
    ("/translate", b"", JSON, 422, ["body"]),
    ("/translate", b'{"texts": ["x"]}', {"Content-Type": "text/plain"}, 422, ["Content-Type: application/json"]),
    ("/translate", '{"texts": ["M\xe4rz"]}'.encode("latin-1"), JSON, 400, ["UTF-8", "0xe4"]),
    ("/translate", {"texts": ["x"] * 9}, None, 413, ["9 texts", "8", "--max-texts"]),
    ("/translate", {"texts": ["x"] * 3, "attention": True}, None, 413, ["attention for 3 texts", "2",
                                                                      "--max-attention-texts"]),
    ("/classify", {"texts": ["x"] * 3, "attention": True}, None, 413, ["attention for 3 texts", "--max-attention"]),
    ("/translate", {"texts": ["x", "y" * 201]}, None, 413, ["texts[1]", "201", "--max-chars"]),
    ("/translate", {"texts": ["x" * 100] * 300}, None, 413, ["--max-body"]),
    ("/translate", {"texts": ["x"] * 10_000}, None, 413, []),
    ("/translate", {"model": "nope", "texts": ["x"]}, None, 404, ["nope", "dates"]),
    ("/translate", {"model": "reviews", "texts": ["x"]}, None, 422, ["reviews", "/classify"]),
    ("/classify", {"model": "dates", "texts": ["x"]}, None, 422, ["dates", "/translate"]),
    ("/classify", {"texts": ["x"], "beam": 2}, None, 422, ["beam"]),
    ("/nowhere", {"texts": ["x"]}, None, 404, []),
]


@pytest.mark.parametrize("path,body,headers,status,needles", BAD_REQUESTS,
                         ids=[f"{i}-{status}" for i, (_, _, _, status, _) in enumerate(BAD_REQUESTS)])
def test_malformed_requests_get_a_json_4xx(client, path, body, headers, status, needles):
    if isinstance(body, bytes):
        response = client.post(path, content=body, headers=headers)
    else:
        response = client.post(path, json=body)
    assert_error(response, status, *needles)


def test_errors_leave_the_server_working(client, server):
    assert_error(client.put("/translate", json={"texts": ["x"]}), 405)
    # a body larger than the limit, sent in chunks without a Content-Length
    chunked = client.post("/translate", content=iter([b'{"texts": ["' + b"x" * 8000] * 4), headers=JSON)
    assert_error(chunked, 413, "--max-body")
    assert client.post("/translate", json={"texts": [SOURCES[0]], "beam": 1}).json()["translations"] == [
        reference(server.dates, [SOURCES[0]], beam=1)[0][0]]
    assert server.proc.poll() is None


def metric_samples(response: httpx.Response) -> dict[tuple[str, frozenset], float]:
    """``GET /metrics`` parsed by prometheus_client: (sample name, labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    assert response.status_code == 200, response.text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def test_metrics_on_the_real_server(client, server):
    """uvicorn serves /metrics; the counts move by what was sent (tests/test_serve_metrics.py has the rest)."""
    def get(samples: dict, name: str, **labels: str) -> float:
        return samples.get((name, frozenset(labels.items())), 0.0)

    before = metric_samples(client.get("/metrics"))
    for text in SOURCES[:3]:
        assert client.post("/translate", json={"texts": [text], "beam": 1}).status_code == 200
    assert client.post("/translate", json={"texts": ["x"] * 9}).status_code == 413
    after = metric_samples(client.get("/metrics"))
    batches = client.get("/health").json()["models"]["dates"]["batches"]

    def moved(name: str, **labels: str) -> float:
        return get(after, name, **labels) - get(before, name, **labels)

    assert moved("attnkit_serve_requests_total", route="/translate", status="200") == 3
    assert moved("attnkit_serve_requests_total", route="/translate", status="413") == 1
    assert moved("attnkit_serve_stage_seconds_count", model="dates", stage="serialise") == 3
    assert get(after, "attnkit_serve_batch_texts_count", model="dates") == batches


# -- the API key, a full queue, SIGTERM ------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed_server(runs: dict[str, Path]):
    """A server that wants an API key (from the environment) and queues at most one text."""
    url, proc = start_server(str(runs["dates"]), "--max-queue", "1", "--max-batch", "1", "--max-wait-ms", "0",
                             env={"ATTNKIT_API_KEY": "s3cret"})
    yield url
    stop(proc)


def test_api_key(keyed_server):
    body = {"texts": ["3. März 2021"], "beam": 1}
    with httpx.Client(base_url=keyed_server, timeout=60) as c:
        assert_error(c.post("/translate", json=body), 401, "missing", "Authorization: Bearer")
        assert_error(c.post("/translate", json=body, headers={"Authorization": "Bearer s3cre"}), 401, "wrong")
        assert_error(c.post("/translate", json=body, headers={"Authorization": "s3cret"}), 401, "wrong")
        assert_error(c.get("/models"), 401)
        assert_error(c.post("/translate", content=b"\xff" * 10, headers={"Authorization": "Bearer x"}), 401)
        assert c.post("/translate", json=body, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert c.get("/models", headers={"Authorization": "bearer s3cret"}).status_code == 200
        assert c.get("/health").json()["api_key_required"] is True
        assert c.get("/").status_code == 200  # the page asks for the key itself


def test_metrics_need_the_api_key(keyed_server):
    with httpx.Client(base_url=keyed_server, timeout=60) as c:
        assert_error(c.get("/metrics"), 401, "missing")
        metric_samples(c.get("/metrics", headers={"Authorization": "Bearer s3cret"}))


def test_full_queue_is_503_with_retry_after(keyed_server):
    """One text in the worker, one queued, the rest refused: 24 requests at once cannot all fit."""
    headers = {"Authorization": "Bearer s3cret"}

    def one(i: int) -> httpx.Response:
        return httpx.post(f"{keyed_server}/translate", json={"texts": [f"{i}. März 2021"], "beam": 2},
                          headers=headers, timeout=60)

    with ThreadPoolExecutor(24) as pool:
        responses = list(pool.map(one, range(24)))
    full = [r for r in responses if r.status_code == 503]
    assert full and all(r.status_code == 200 for r in responses if r.status_code != 503)
    assert_error(full[0], 503, "busy", "--max-queue")
    assert full[0].headers["retry-after"] == "1"


def test_sigterm_finishes_the_requests_in_flight(runs, server):
    # every request waits up to 1.5 s for others to join its batch: it is in flight when SIGTERM comes
    url, proc = start_server(str(runs["dates"]), "--max-wait-ms", "1500")
    text = SOURCES[3]
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, f"{url}/translate", json={"texts": [text], "beam": 1}, timeout=60)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        response = pending.result()
    assert response.status_code == 200
    assert response.json()["translations"] == [reference(server.dates, [text], beam=1)[0][0]]
    assert proc.wait(timeout=60) == 0  # a clean shutdown, said in one line
    assert proc.stderr.read().splitlines()[-1] == "attnkit serve: stopped (SIGTERM)"
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health")


# -- the command line ------------------------------------------------------------------------------


def test_serve_user_errors_are_one_line(runs, tmp_path, capsys):
    def error(*argv: str) -> str:
        assert main(["serve", *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("attnkit: error: ") and "Traceback" not in err
        return err

    assert "not a run directory" in error(str(tmp_path))
    assert "--max-texts" in error(str(runs["dates"]), "--max-texts", "0")
    assert "--max-wait-ms" in error(str(runs["dates"]), "--max-wait-ms", "nan")
    assert "--port" in error(str(runs["dates"]), "--port", "70000")
    assert "named 'dates'" in error(str(runs["dates"]), str(runs["dates"]))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert "cannot listen" in error(str(runs["dates"]), "--port", str(taken.getsockname()[1]))


def test_serving_docs_state_the_serving_defaults():
    from attnkit.serve.connections import MAX_HEAD_BYTES, MAX_URL_BYTES
    from attnkit.serve.schemas import MAX_BEAM

    readme = (ROOT / "docs" / "serving.md").read_text(encoding="utf-8")
    d = Limits()
    for claim in (f"`--max-texts` texts ({d.max_texts})", f"`--max-chars` characters ({d.max_chars:,})",
                  f"`--max-attention-texts` ({d.max_attention_texts})",
                  f"`--max-body` bytes ({d.max_body // 1_000_000} MB)", f"`--max-queue` texts ({d.max_queue})",
                  f"`--max-batch` texts (default {d.max_batch})", f"`--max-wait-ms` (default {d.max_wait_ms:g})",
                  f"a beam outside 1-{MAX_BEAM}", f"`--read-timeout` seconds ({d.read_timeout:g})",
                  f"`--max-connections` ({d.max_connections})", f"target over {MAX_URL_BYTES // 1024} KiB gets 414",
                  f"headers over {MAX_HEAD_BYTES // 1024} KiB 431"):
        assert claim in " ".join(readme.split()), claim


def test_connections_get_tcp_nodelay():
    """uvicorn serves on the socket from listen(): asyncio turns Nagle off on its connections only when the
    socket says TCP, else every keep-alive response written in two parts waits for a delayed ACK."""
    from attnkit.serve.app import listen

    async def nodelay_of_a_connection() -> int:
        sock = listen("127.0.0.1", 0)
        seen = asyncio.get_running_loop().create_future()

        def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(connected, sock=sock)
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        value = await asyncio.wait_for(seen, 10)
        writer.close()
        server.close()
        return value

    assert asyncio.run(nodelay_of_a_connection()) != 0


# -- the page in a browser -------------------------------------------------------------------------


def test_page_in_headless_chromium(browser, server):
    """Type a German date, get the model's output, click it, hover a source piece: its attention is drawn."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    from test_explorer_browser import assert_shown

    text = "Sonntag, 3. März 2024"
    browser.get(server.url + "/")
    wait = WebDriverWait(browser, 60)
    wait.until(lambda d: len(Select(d.find_element(By.ID, "model")).options) == 2)
    Select(browser.find_element(By.ID, "model")).select_by_value("dates")
    assert browser.find_element(By.ID, "beam").get_attribute("value") == str(server.dates.cfg.decode_beam)
    browser.find_element(By.ID, "source").send_keys(text)
    browser.find_element(By.ID, "run").click()
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#results .sentence .out"))
    sentence = browser.find_element(By.CSS_SELECTOR, "#results .sentence")
    assert sentence.find_element(By.CSS_SELECTOR, ".src").text == text
    assert sentence.find_element(By.CSS_SELECTOR, ".out").text == reference(server.dates, [text])[0][0]

    sentence.click()
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#explorer #keys .tok"))
    maps = attention_maps(server.dates, text, beam=server.dates.cfg.decode_beam, lenpen=server.dates.cfg.decode_lenpen)
    assert browser.find_element(By.ID, "title").text == f"{text} -> {maps.output}"
    keys = browser.find_elements(By.CSS_SELECTOR, "#keys .tok")
    assert [k.text for k in keys] == maps.src_tokens
    ActionChains(browser).move_to_element(keys[1]).perform()  # a source piece: the outputs attending to it
    assert_shown(browser, "queries", maps.cross[0].mean(0)[:, 1])
    assert browser.find_elements(By.CSS_SELECTOR, "#lines line")
    assert "attending to source" in browser.find_element(By.ID, "info").text

    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors


# -- the batching worker on its own --------------------------------------------------------------


def test_worker_merges_jobs_by_key_up_to_max_batch_and_drains_on_close():
    calls: list[tuple[str, list[str]]] = []
    gate = threading.Event()

    def run(tag: str, texts: list[str]) -> list[str]:
        gate.wait(10)  # the first batch holds the worker until everything else is queued
        calls.append((tag, texts))
        return [f"{tag}:{t}" for t in texts]

    # after the first text is taken, 6 are queued: max_queue 6 leaves no room for one more
    async def checked() -> None:
        worker = ModelWorker("test", Limits(max_queue=6, max_batch=3, max_wait_ms=0))
        a = lambda texts: run("a", texts)  # noqa: E731
        b = lambda texts: run("b", texts)  # noqa: E731
        first = worker.submit(("a",), a, ["1"])
        await asyncio.sleep(0.2)
        futures = [first, worker.submit(("a",), a, ["2", "3"]), worker.submit(("b",), b, ["4"]),
                   worker.submit(("a",), a, ["5"]), worker.submit(("a",), a, ["6", "7"])]
        assert worker.stats()["queued"] == 6
        with pytest.raises(QueueFull):
            worker.submit(("a",), a, ["8"])
        gate.set()
        results = await asyncio.gather(*futures)
        assert results == [["a:1"], ["a:2", "a:3"], ["b:4"], ["a:5"], ["a:6", "a:7"]]
        # oldest first; same key merged up to 3 texts ("5" joins "2","3"; "6","7" would make 5)
        assert calls == [("a", ["1"]), ("a", ["2", "3", "5"]), ("b", ["4"]), ("a", ["6", "7"])]
        assert worker.stats() == {"queued": 0, "batches": 4, "texts": 7, "batch_texts": 7}
        late = worker.submit(("a",), a, ["9"])
        worker.close(timeout=10)  # drains: the job queued before close still runs
        assert await late == ["a:9"]
        with pytest.raises(QueueFull):
            worker.submit(("a",), a, ["10"])  # closed

    asyncio.run(checked())


@pytest.mark.parametrize("error", [UserError, RuntimeError], ids=["refused", "bug"])
def test_worker_isolates_a_request_it_cannot_run(error):
    """A batch that fails is run again request by request: the request it fails on gets the error (a UserError:
    422, a bug: 500), the others their results."""
    def run(texts: list[str]) -> list[str]:
        if "bad" in texts:
            raise error("cannot run 'bad'")
        return [t.upper() for t in texts]

    async def scenario() -> tuple:
        worker = ModelWorker("test", Limits(max_batch=8, max_wait_ms=200))
        good, bad, other = (worker.submit(("k",), run, texts) for texts in (["a"], ["bad"], ["b", "c"]))
        results = await asyncio.gather(good, bad, other, return_exceptions=True)
        worker.close(timeout=10)
        return results, worker.stats()

    (good, bad, other), stats = asyncio.run(scenario())
    assert good == ["A"] and other == ["B", "C"] and type(bad) is error
    assert stats["batches"] == 1  # one batch was tried; then each request alone


def test_a_text_that_fails_in_a_running_batch_fails_its_job_alone():
    """A stepper's result that is an exception (one text failed: a language model's row) answers that text's job
    with it while the running batch goes on: the other jobs get their results, a job with several texts
    is answered with its failure and the rest of its texts are let go."""
    class Steps:  # a text "bad..." fails at its second step; the others end at their third
        width = 1

        def __init__(self) -> None:
            self.live: dict[int, list] = {}  # handle -> [text, steps]
            self.handles = 0

        @property
        def running(self) -> int:
            return len(self.live)

        def start(self, texts: list[str]) -> list[int]:
            handles = list(range(self.handles, self.handles + len(texts)))
            self.handles += len(texts)
            self.live.update({h: [t, 0] for h, t in zip(handles, texts, strict=True)})
            return handles

        def step(self) -> list[tuple[int, object]]:
            ended = []
            for h, row in list(self.live.items()):
                row[1] += 1
                if row[0].startswith("bad") and row[1] == 2:
                    ended.append((h, RuntimeError(f"row {row[0]} failed")))
                elif row[1] == 3:
                    ended.append((h, row[0].upper()))
                if ended and ended[-1][0] == h:
                    del self.live[h]
            return ended

        def abandon(self) -> None:
            self.live = {}

    async def scenario() -> list:
        worker = ModelWorker("test", Limits(max_batch=8, max_wait_ms=0))
        stepper = Steps()
        futures = [worker.submit(("g",), lambda t: t, texts, stepper=stepper)
                   for texts in (["a"], ["bad1"], ["b", "bad2", "c"], ["d"])]
        results = await asyncio.gather(*futures, return_exceptions=True)
        worker.close(timeout=10)
        return results

    a, bad, mixed, d = asyncio.run(scenario())
    assert (a, d) == (["A"], ["D"])
    assert isinstance(bad, RuntimeError) and str(bad) == "row bad1 failed"
    assert isinstance(mixed, RuntimeError) and str(mixed) == "row bad2 failed"


def test_a_job_decoded_continuously_does_not_wait_for_others():
    """A batch that steps (continuous batching) starts each job on its own, later ones joining at the next step:
    waiting max_wait_ms for company would batch nothing, so even a job queued with others starts at once."""

    class OneStep:  # every text ends at its first step
        def __init__(self) -> None:
            self.live: list[int] = []
            self.next = 0
            self.width = 1

        @property
        def running(self) -> int:
            return len(self.live)

        def start(self, texts: list[str]) -> list[int]:
            handles = list(range(self.next, self.next + len(texts)))
            self.next += len(texts)
            self.live += handles
            return handles

        def step(self) -> list[tuple[int, str]]:
            ended, self.live = [(h, f"done {h}") for h in self.live], []
            return ended

        def abandon(self) -> None:
            self.live = []

    records = []

    async def scenario() -> list:
        worker = ModelWorker("test", Limits(max_batch=8, max_wait_ms=5000), on_batch=records.append)
        stepper = OneStep()
        futures = [worker.submit(("g",), lambda texts: texts, [t], stepper=stepper) for t in ("a", "b", "c")]
        results = await asyncio.gather(*futures)
        worker.close(timeout=10)
        return results

    assert asyncio.run(scenario()) == [["done 0"], ["done 1"], ["done 2"]]
    waits = [w for r in records for w in r.waits]
    assert len(waits) == 3 and max(waits) < 2.5  # not the 5 s that max_wait_ms would hold the first job


@pytest.mark.parametrize("refused", [False, True])
def test_jobs_joining_together_start_in_one_call_and_a_refused_one_alone(refused):
    """Jobs that queued while a step ran start on the stepper in one call (one prefill for a language model); if
    the stepper refuses a text of theirs, each starts alone and only that job gets the error."""
    from attnkit.common.errors import UserError

    gate = threading.Event()
    starts: list[list[str]] = []

    class Steps:
        width = 1

        def __init__(self) -> None:
            self.live: list[tuple[int, str]] = []
            self.handles = 0

        @property
        def running(self) -> int:
            return len(self.live)

        def start(self, texts: list[str]) -> list[int]:
            if "bad" in texts:
                raise UserError("cannot start 'bad'")  # before starting any of them
            starts.append(list(texts))
            handles = list(range(self.handles, self.handles + len(texts)))
            self.handles += len(texts)
            self.live += list(zip(handles, texts, strict=True))
            return handles

        def step(self) -> list[tuple[int, str]]:
            gate.wait(10)  # the first step holds the worker until the others are queued
            ended, self.live = [(h, t.upper()) for h, t in self.live], []
            return ended

        def abandon(self) -> None:
            self.live = []

    async def scenario() -> list:
        worker = ModelWorker("test", Limits(max_batch=8, max_wait_ms=0))
        stepper = Steps()
        submit = lambda texts: worker.submit(("g",), lambda t: t, texts, stepper=stepper)  # noqa: E731
        first = submit(["a"])
        await asyncio.sleep(0.2)  # "a" is stepping, held by the gate
        later = [submit(texts) for texts in (["b", "c"], ["d"], ["bad" if refused else "e"], ["f"])]
        await asyncio.sleep(0.1)
        gate.set()
        results = await asyncio.gather(first, *later, return_exceptions=True)
        worker.close(timeout=10)
        return results

    a, bc, d, e, f = asyncio.run(scenario())
    assert (a, bc, d, f) == (["A"], ["B", "C"], ["D"], ["F"])
    if not refused:
        assert e == ["E"] and starts == [["a"], ["b", "c", "d", "e", "f"]]  # the four queued jobs: one call
    else:
        assert isinstance(e, UserError) and starts == [["a"], ["b", "c"], ["d"], ["f"]]  # each alone


def test_a_worker_computes_with_its_own_threads_and_the_main_thread_keeps_its_own() -> None:
    """``threads`` is torch's intra-op thread count on the worker's thread (where the model's parallel regions
    start); the thread that made the worker keeps its own setting (the server's main thread computes with one)."""
    before = torch.get_num_threads()

    async def scenario() -> list:
        worker = ModelWorker("test", Limits(max_wait_ms=0), threads=3)
        seen = await worker.submit(("t",), lambda texts: [torch.get_num_threads() for _ in texts], ["x"])
        worker.close(timeout=10)
        return seen

    try:
        torch.set_num_threads(1)
        assert asyncio.run(scenario()) == [3]
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
