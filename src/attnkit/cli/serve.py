"""Serve translation and classification runs over HTTP (FastAPI on uvicorn), each under its
run directory's name. Concurrent requests to a model are merged into one batch (those closest in
length together, within --max-batch texts and --max-batch-tokens padded tokens).

  GET  /            a page: type sentences, see translations, click one to see its attention
  GET  /health      status; per model the texts queued and the batches run
  GET  /models      name, task, languages, parameters, beam defaults
  POST /translate   {"model", "texts": [...], "beam", "n_best", "lenpen", "attention": false}
  POST /classify    {"model", "texts": [...], "attention": false}
  GET  /metrics     Prometheus text format: requests by route and status, latency, queued texts,
                    batch sizes (texts, tokens), queue wait, time per stage
  GET  /docs        the OpenAPI page

Errors are JSON {"error": "..."} with a 4xx status: 422 bad field, 413 too large, 404 unknown model,
401 API key, 503 queue full (with Retry-After). SIGTERM or Ctrl-C finishes the requests in flight, then exits.
"""

from __future__ import annotations

import argparse
import os
import sys

from ..common.errors import UserError
from ..serve.batching import Limits  # the limits' defaults, without loading FastAPI for --help
from ..serve.servables import PRECISIONS
from .options import NON_NEGATIVE, POSITIVE_INT

HELP = "serve trained models over HTTP: a JSON API and a page to translate and see attention"
EPILOG = """\
example:
  attnkit serve runs/de-en &
  curl -s localhost:8000/translate -H 'Content-Type: application/json' \\
       -d '{"texts": ["Ein Hund rennt."], "beam": 1}'"""


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help=HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
                       description=__doc__, epilog=EPILOG)
    p.add_argument("models", nargs="+", metavar="RUN",
                   help="run directories (or .safetensors checkpoints inside one) of translation or classification "
                        "models")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: 127.0.0.1, this machine only; 0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default: 8000)")
    p.add_argument("--threads", type=POSITIVE_INT, metavar="N",
                   help="CPU threads for the models (default: torch's, one per core)")
    p.add_argument("--precision", choices=list(PRECISIONS), default="float32",
                   help="what a run computes in: float32 (default; outputs equal attnkit translate's) or bf16 "
                        "(bfloat16 autocast: faster where the CPU has AVX512-BF16 or AMX, outputs may differ "
                        "slightly); a CTranslate2 export computes in the quantization it was exported with")
    p.add_argument("--batching", choices=["whole", "continuous"], default="whole",
                   help="how a run's greedy translations (beam 1) are batched: whole (default: requests merged "
                        "into batches that decode from start to end) or continuous (a request's texts join the "
                        "running decoding batch at its next step and leave it as they end; slower on the 2-core "
                        "CPU we measured, docs/serving.md); beam search, attention, classification and "
                        "CTranslate2 exports always run in whole batches")
    p.add_argument("--api-key", metavar="KEY",
                   help="require the header 'Authorization: Bearer KEY' on /models, /translate, /classify and "
                        "/metrics "
                        "(default: the environment variable ATTNKIT_API_KEY if set, else no key; the variable keeps "
                        "the key out of the process list)")
    defaults = Limits()
    p.add_argument("--max-texts", type=POSITIVE_INT, default=defaults.max_texts, metavar="N",
                   help=f"texts per request; more is refused with 413 (default: {defaults.max_texts})")
    p.add_argument("--max-attention-texts", type=POSITIVE_INT, default=defaults.max_attention_texts, metavar="N",
                   help="texts per request that asks for attention (a long text's maps run to megabytes of JSON); "
                        f"more is refused with 413 (default: {defaults.max_attention_texts})")
    p.add_argument("--max-chars", type=POSITIVE_INT, default=defaults.max_chars, metavar="N",
                   help=f"characters per text; longer is refused with 413 (default: {defaults.max_chars})")
    p.add_argument("--max-body", type=POSITIVE_INT, default=defaults.max_body, metavar="BYTES",
                   help=f"bytes per request body; larger is refused with 413 (default: {defaults.max_body})")
    p.add_argument("--max-queue", type=POSITIVE_INT, default=defaults.max_queue, metavar="N",
                   help=f"texts waiting per model; beyond, requests get 503 (default: {defaults.max_queue})")
    p.add_argument("--max-batch", type=POSITIVE_INT, default=defaults.max_batch, metavar="N",
                   help=f"texts the model runs at once, from several requests (default: {defaults.max_batch})")
    p.add_argument("--max-batch-tokens", type=POSITIVE_INT, default=defaults.max_batch_tokens, metavar="N",
                   help="source tokens a model batch may hold, padded (texts x the longest text's tokens); a "
                        f"request longer than that runs alone (default: {defaults.max_batch_tokens})")
    p.add_argument("--max-wait-ms", type=NON_NEGATIVE, default=defaults.max_wait_ms, metavar="MS",
                   help="how long a model's worker waits for more requests to join a batch; a lone request "
                        f"does not wait (default: {defaults.max_wait_ms:g})")


def run(args: argparse.Namespace) -> None:
    from ..serve.app import serve  # FastAPI and uvicorn: loaded only to serve

    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be between 0 and 65535, got {args.port}")
    api_key = args.api_key if args.api_key is not None else os.environ.get("ATTNKIT_API_KEY")
    if api_key is not None and not api_key.strip():
        raise UserError("--api-key is empty; give a key, or none to serve without one")
    limits = Limits(max_texts=args.max_texts, max_chars=args.max_chars, max_body=args.max_body,
                    max_queue=args.max_queue, max_batch=args.max_batch, max_wait_ms=args.max_wait_ms,
                    max_batch_tokens=args.max_batch_tokens, max_attention_texts=args.max_attention_texts)
    try:
        serve(args.models, host=args.host, port=args.port, threads=args.threads, api_key=api_key, limits=limits,
              precision=args.precision, continuous=args.batching == "continuous")
    except KeyboardInterrupt:  # Ctrl-C: the requests in flight were answered; nothing to resume
        print("attnkit serve: stopped", file=sys.stderr)
