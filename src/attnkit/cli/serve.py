"""Serve translation, classification and language-model runs over HTTP (FastAPI on uvicorn), each
under its run directory's name. Concurrent requests to a model are merged into one batch (those closest
in length together, within --max-batch texts and --max-batch-tokens padded tokens). A language model
generates by continuous batching: a new request's prompt runs between two decoding steps and joins
the running batch (at most --max-batch rows), and each request leaves it when its text ends.

  GET  /            a page: type sentences, see translations, click one to see its attention
  GET  /health      status; per model the texts queued and the batches run
  GET  /models      name, task, languages, parameters, beam defaults
  POST /translate   {"model", "texts": [...], "beam", "n_best", "lenpen", "attention": false}
  POST /classify    {"model", "texts": [...], "attention": false}
  POST /generate    {"model", "prompt", "max_new_tokens", "temperature", "top_k", "top_p", "seed",
                    "stop": [...], "stream": false, "attention": false} -> {"text", "tokens",
                    "prompt_tokens", "finish_reason": "eos" | "length" | "stop", "seed"}; with
                    "stream": true, server-sent events: one per token, data: {"token", "id"}, then
                    one with the counts and finish_reason. The same seed and options give the
                    text `attnkit generate --seed` gives, in float32 whatever else is generated beside it.
  GET  /v1/models, POST /v1/completions, POST /v1/chat/completions
                    a language model's OpenAI-compatible API: the openai package, LangChain and
                    curl scripts for OpenAI work unchanged (base_url http://HOST:PORT/v1); a chat is
                    laid out by the run's chat template and stops at its end of turn, as `attnkit chat`
  GET  /metrics     Prometheus text format: requests by route and status, latency, queued texts,
                    batch sizes (texts, tokens), queue wait, time per stage; for language models
                    time to first token, tokens generated, tokens/s, active streams
  GET  /docs        the OpenAPI page

Errors are JSON {"error": "..."} (under /v1/, OpenAI's {"error": {"message", ...}}) with a 4xx status:
422 bad field (400 under /v1/), 413 too large, 404 unknown model, 401 API key, 503 queue full or more
than --max-connections open (with Retry-After), 429 more than --max-streams generations in flight,
414/431 a request line or headers too long (8 KiB target, 32 KiB head), 408 a head or body slower than
--read-timeout; a bug is a 500 for its request alone, and closes its connection.
SIGTERM or Ctrl-C stops taking connections, finishes the requests in flight, prints "attnkit serve:
stopped (SIGTERM)" on stderr and exits with status 0.
"""

from __future__ import annotations

import argparse
import os
import sys

from ..common.errors import UserError
from ..inference.language_model import MAX_NEW_TOKENS
from ..serve.batching import Limits  # the limits' defaults, without loading FastAPI for --help
from .options import NON_NEGATIVE, POSITIVE_INT, add_device_option, add_engine_options, engine_of, number, pick_device

HELP = "serve trained models over HTTP: a JSON API and a page to translate and see attention"
EPILOG = """\
examples:
  attnkit serve runs/de-en &
  curl -s localhost:8000/translate -H 'Content-Type: application/json' \\
       -d '{"texts": ["Ein Hund rennt."], "beam": 1}'
  attnkit serve runs/shakespeare-char &
  curl -sN localhost:8000/generate -H 'Content-Type: application/json' \\
       -d '{"prompt": "ROMEO:", "max_new_tokens": 100, "seed": 1, "stream": true}'"""

#: ``--max-...``: every field of :class:`~attnkit.serve.batching.Limits` as a flag, in --help's order: (field,
#: metavar, what the help says of it; its default is appended). A whole number must be positive, milliseconds
#: may be 0, seconds must be at least 0.1.
LIMIT_FLAGS = (
    ("max_texts", "N", "texts per request; more is refused with 413"),
    ("max_attention_texts", "N", "texts per request that asks for attention (a long text's maps run to megabytes "
                                 "of JSON); more is refused with 413"),
    ("max_chars", "N", "characters per text; longer is refused with 413"),
    ("max_body", "BYTES", "bytes per request body; larger is refused with 413"),
    ("max_queue", "N", "texts waiting per model; beyond, requests get 503"),
    ("max_batch", "N", "texts the model runs at once, from several requests"),
    ("max_batch_tokens", "N", "source tokens a model batch may hold, padded (texts x the longest text's tokens; a "
                              "language model's running batch: rows x cached positions); a request longer than "
                              "that runs alone"),
    ("max_wait_ms", "MS", "how long a model's worker waits for more requests to join a batch; a lone request "
                          "does not wait, nor does continuous batching (later requests join at the next step)"),
    ("max_new_tokens", "N", f"tokens one /generate request may ask for, at most {MAX_NEW_TOKENS}; more is refused "
                            "with 422 (a request without max_new_tokens gets 256, or this if lower)"),
    ("max_streams", "N", "generations in flight per language model, streamed or not (each holds a row of the "
                         "running batch, or waits for one); more are refused with 429"),
    ("max_connections", "N", "open connections (kept-alive ones included); a connection beyond is answered 503 "
                             "and closed before anything of it is read"),
    ("read_timeout", "SECONDS", "how long a request's head (request line and headers) may take to arrive, and "
                                "then its body; a request slower than that is answered 408 and its connection "
                                "closed"),
)
#: The type of a limit's flag, by its metavar.
LIMIT_TYPES = {"N": POSITIVE_INT, "BYTES": POSITIVE_INT, "MS": NON_NEGATIVE, "SECONDS": number(float, 0.1)}


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help=HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
                       description=__doc__, epilog=EPILOG)
    p.add_argument("models", nargs="+", metavar="RUN",
                   help="run directories (or .safetensors checkpoints inside one) of translation, classification or "
                        "language models, or their CTranslate2 exports (attnkit export --to ctranslate2)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: 127.0.0.1, this machine only; 0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default: 8000)")
    p.add_argument("--threads", type=POSITIVE_INT, metavar="N",
                   help="CPU threads for the models (default: torch's, one per core)")
    p.add_argument("--batching", choices=["whole", "continuous"], default="whole",
                   help="how a run's greedy translations (beam 1) are batched: whole (default: requests merged "
                        "into batches that decode from start to end) or continuous (a request's texts join the "
                        "running decoding batch at its next step and leave it as they end; docs/results.md "
                        "compares the two); beam search, attention, classification and "
                        "CTranslate2 exports always run in whole batches, and a language model's generations "
                        "always continuously")
    add_engine_options(p, "language-model runs: eager, and each prompt's pass and the running rows' steps "
                          "compiled ahead of time (torch.export and AOTInductor; seconds to minutes of compiling "
                          "before the first request is served, the code kept in $ATTNKIT_CACHE/compiled-steps); "
                          "other runs as eager. Each run is loaded this way; a CTranslate2 export computes as it was "
                          "exported")
    add_device_option(p, "language-model runs (translation, classification and CTranslate2 exports are served "
                         "on the CPU)")
    p.add_argument("--api-key", metavar="KEY",
                   help="require the header 'Authorization: Bearer KEY' on /models, /translate, /classify, "
                        "/generate, /metrics and /v1/ (the openai package's api_key) "
                        "(default: the environment variable ATTNKIT_API_KEY if set, else no key; the variable keeps "
                        "the key out of the process list)")
    defaults = Limits()
    for name, metavar, what in LIMIT_FLAGS:
        default = getattr(defaults, name)
        p.add_argument(f"--{name.replace('_', '-')}", type=LIMIT_TYPES[metavar], default=default, metavar=metavar,
                       help=f"{what} (default: {default if isinstance(default, int) else format(default, 'g')})")


def run(args: argparse.Namespace) -> None:
    from ..serve.app import serve  # FastAPI and uvicorn: loaded only to serve

    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be between 0 and 65535, got {args.port}")
    api_key = args.api_key if args.api_key is not None else os.environ.get("ATTNKIT_API_KEY")
    if api_key is not None and not api_key.strip():
        raise UserError("--api-key is empty; give a key, or none to serve without one")
    if args.max_new_tokens > MAX_NEW_TOKENS:
        raise UserError(f"--max-new-tokens must be at most {MAX_NEW_TOKENS}, got {args.max_new_tokens}")
    limits = Limits(**{name: getattr(args, name) for name, _, _ in LIMIT_FLAGS})
    stopped_by = serve(args.models, host=args.host, port=args.port, threads=args.threads, api_key=api_key,
                       limits=limits, engine=engine_of(args, compiled=True), continuous=args.batching == "continuous",
                       device=pick_device(args.device))
    print(f"attnkit serve: stopped ({stopped_by or 'the server ended'})", file=sys.stderr)  # exit status 0
