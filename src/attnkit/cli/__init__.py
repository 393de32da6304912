"""Command line: ``attnkit {demo,prepare,train,translate,evaluate,classify,attention,export,serve}``.

User errors (:class:`~attnkit.common.errors.UserError`), bad options included, print one line
``attnkit: error: ...`` and exit with status 2, without a traceback. Warnings (an input line
cut to the model's length) print ``attnkit: warning: ...`` on standard error.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..common.errors import UserError
from ..search import LENPEN, MAX_LEN_A, MAX_LEN_B
from ..serve.batching import Limits  # the serving limits' defaults (not .serve: --help does not import FastAPI)

if TYPE_CHECKING:
    from ..runs.load import LoadedRun

EXAMPLES = """examples:
  attnkit demo                                   # train on generated dates (a few minutes), print exact match
  attnkit prepare configs/multi30k-de-en.yaml --run-dir runs/de-en   # optional: train prepares when needed
  attnkit train configs/multi30k-de-en.yaml --run-dir runs/de-en
  attnkit train configs/multi30k-de-en.yaml --run-dir runs/de-en --resume train.max_updates=30000
  torchrun --standalone --nproc_per_node=2 -m attnkit train configs/multi30k-de-en.yaml --run-dir runs/de-en
  attnkit translate runs/de-en -i test.de -o test.hyp.en --beam 4
  attnkit evaluate runs/de-en --src test.de --ref test.en
  attnkit classify runs/sst2 -i reviews.txt --with-attention
  attnkit attention runs/de-en --src "Ein Hund rennt." -o attn/ --html
  attnkit export runs/de-en --to ctranslate2 -o runs/de-en-ct2 --quantization int8
  attnkit translate runs/de-en-ct2 -i test.de -o test.hyp.en
  attnkit serve runs/de-en runs/sst2 --port 8000          # HTTP API + a page at http://127.0.0.1:8000/
"""


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as :class:`UserError`: one line, exit status 2, like every other user error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(f"{message} (see `{self.prog} --help`)")


def number(kind: type[int] | type[float], at_least: float | None = None) -> Callable[[str], int | float]:
    """An argparse ``type`` for a finite ``int`` / ``float`` option, optionally with a lower bound."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'a whole' if kind is int else 'a'} number, got {text!r}") \
                from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if at_least is not None and value < at_least:
            raise argparse.ArgumentTypeError(f"must be at least {at_least:g}, got {text!r}")
        return value

    return parse


POSITIVE_INT, FINITE, NON_NEGATIVE = number(int, 1), number(float), number(float, 0)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="attnkit", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES,
        description="Attention and the Transformer: train translation and classification models on a CPU, "
                    "translate with beam search, score with sacreBLEU, and look at what attention learned.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("demo", help="train a small Transformer on generated dates and show its attention",
                       description="Train a small Transformer to rewrite dates written in 18 formats and 5 "
                                   "languages as ISO 8601, report exact match on held-out dates and save a "
                                   "cross-attention heatmap. No download needed.")
    p.add_argument("-o", "--out-dir", default=".", help="where the run and the heatmap PNG go (default: .)")
    p.add_argument("--held-out", type=POSITIVE_INT, metavar="N",
                   help="how many held-out dates to score for exact match (default: 1000; fewer is quicker)")
    p.add_argument("--json", metavar="PATH",
                   help="also write exact match, minutes, updates, peak RSS, date and commit to PATH as JSON")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="config overrides, e.g. train.max_updates=200 (see configs/demo.yaml)")

    p = sub.add_parser("prepare", help="tokenize a config's training data once, for any number of runs",
                       description="Stream the training corpus, train the tokenizer on a sample, encode it in "
                                   "several processes and store the ids memory-mapped in RUN_DIR/data with a "
                                   "manifest. `attnkit train` reuses it while the inputs are unchanged (and "
                                   "prepares it itself when it is missing).")
    p.add_argument("config", help="YAML config file (see configs/)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. data.max_len=100")
    p.add_argument("--run-dir", help="the run directory to prepare (default: runs/<config name>)")
    p.add_argument("--workers", type=int, default=None,
                   help="encoding processes (default: one per CPU, none for inputs under a few MB)")

    p = sub.add_parser("train", help="train a model from a YAML config",
                       description="Train a translation or classification model, or pretrain an encoder on "
                                   "unlabelled text (task: pretrain; fine-tune it with model.init_from). The run "
                                   "directory receives the resolved config, the tokenizer, the prepared data, "
                                   "checkpoints and metrics.jsonl.")
    p.add_argument("config", help="YAML config file (see configs/)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. train.lr=5e-4")
    p.add_argument("--run-dir", help="output directory (default: runs/<config name>)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --run-dir (exactly where it stopped)")

    p = sub.add_parser("translate", help="translate text with a trained model",
                       description="Translate one sentence per line (stdin by default) with beam search. A line "
                                   "longer than the model reads is cut to it (with a warning); a blank line "
                                   "gives an empty one.")
    p.add_argument("model", help="run directory, a .safetensors checkpoint inside one, or a directory written "
                                 "by `attnkit export`")
    p.add_argument("-i", "--input", help="input file (default: stdin)")
    p.add_argument("-o", "--output", help="output file (default: stdout)")
    p.add_argument("--beam", type=POSITIVE_INT, default=None,
                   help="beam size; 1 = greedy (default: the run's decode_beam)")
    p.add_argument("--lenpen", type=FINITE, default=None,
                   help=f"GNMT length penalty alpha (default: the run's decode_lenpen, {LENPEN} unless configured)")
    p.add_argument("--n-best", type=POSITIVE_INT, default=1,
                   help="hypotheses per sentence, tab-separated (default: 1)")
    p.add_argument("--max-len-a", type=NON_NEGATIVE, default=MAX_LEN_A,
                   help="max output length = a * source length + b")
    p.add_argument("--max-len-b", type=FINITE, default=MAX_LEN_B,
                   help=f"(default: a={MAX_LEN_A:g}, b={MAX_LEN_B:g}, as in the paper)")
    p.add_argument("--batch-size", type=POSITIVE_INT, default=64, help="sentences per batch (default: 64)")
    p.add_argument("--attention-dir", metavar="DIR",
                   help="also save a cross-attention heatmap per input line (greedy decoding) as "
                        "DIR/attention-0001.png, ...")

    p = sub.add_parser("evaluate", help="score a trained model on a test set",
                       description="Translation: sacreBLEU (cased, 13a), lowercased BLEU and chrF with the "
                                   "signature. Classification: accuracy, macro-F1 and the confusion matrix.")
    p.add_argument("model", help="run directory or a .safetensors checkpoint inside one")
    p.add_argument("--src", help="translation: source file")
    p.add_argument("--ref", help="translation: reference file (line-aligned with --src)")
    p.add_argument("--data", help="classification: labelled .tsv/.csv with a header")
    p.add_argument("--beam", type=POSITIVE_INT, default=None, help="beam size (default: the run's decode_beam)")
    p.add_argument("--lenpen", type=FINITE, default=None, help="length penalty alpha (default: the run's)")
    p.add_argument("--hyp-out", help="also write the hypotheses / predictions to this file")

    p = sub.add_parser("classify", help="classify text with a trained classifier",
                       description="One prediction per input line: label<TAB>probability<TAB>text.")
    p.add_argument("model", help="run directory or a .safetensors checkpoint inside one")
    p.add_argument("-i", "--input", help="input file (default: stdin)")
    p.add_argument("--with-attention", action="store_true",
                   help="also print the 5 tokens the pooled representation drew on most")

    p = sub.add_parser(
        "attention", help="draw what attention learned: heatmaps and an interactive HTML explorer",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a trained model on one sentence and save its attention weights as PNG heatmaps:\n"
                    "cross-attention (mean over heads per layer, one panel per head, mean over layers),\n"
                    "encoder self-attention and decoder self-attention for Transformers; the alignment for\n"
                    "RNN models; self-attention and the pooled representation's token importance for\n"
                    "classifiers. Axes show the tokenizer's subword pieces (\u2581 marks a word start).",
        epilog="files written to OUT_DIR (L = layer number from 0; for one-layer kinds -layerL is dropped and\n"
               "there is no -mean):\n"
               "  cross-layerL.png, cross-layerL-heads.png, cross-mean.png\n"
               "  encoder-self-layerL.png, encoder-self-layerL-heads.png, encoder-self-mean.png\n"
               "  decoder-self-layerL.png, decoder-self-layerL-heads.png, decoder-self-mean.png\n"
               "  alignment.png (RNN); pooling.png (classifier); attention.html (--html)\n\n"
               "rows are queries, columns keys: cross-attention rows are the output pieces (what each decoder\n"
               "position produced), decoder self-attention rows and columns the decoder inputs (<s> first).")
    p.add_argument("model", help="run directory or a .safetensors checkpoint inside one")
    p.add_argument("--src", required=True, help="the source sentence (translation) or text (classification)")
    p.add_argument("--tgt", help="translation: force-decode this target instead of the model's own translation")
    p.add_argument("-o", "--out-dir", default="attention", help="where the PNGs (and HTML) go (default: attention)")
    p.add_argument("--html", action="store_true",
                   help="also write OUT_DIR/attention.html: one self-contained page (no network) to pick the "
                        "kind, layer and head and hover or click a token to see its attention")
    p.add_argument("--no-png", action="store_true", help="skip the PNG heatmaps (with --html: only the page)")
    p.add_argument("--beam", type=POSITIVE_INT, default=1,
                   help="beam size for the model's own translation (default: 1, greedy)")
    p.add_argument("--lenpen", type=FINITE, default=None,
                   help="length penalty alpha with --beam > 1 (default: the run's decode_lenpen)")

    p = sub.add_parser("export", help="export a Transformer translation run to CTranslate2",
                       description="Write a CTranslate2 model directory (model.bin, vocabulary, the SentencePiece "
                                   "model(s) and attnkit-export.json) from a Transformer translation run; "
                                   "`attnkit translate OUT` reads it. RNN runs and classifiers cannot be exported.")
    p.add_argument("model", help="run directory or a .safetensors checkpoint inside one")
    p.add_argument("--to", required=True, choices=["ctranslate2"], help="the inference engine (ctranslate2)")
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="the directory to write")
    p.add_argument("--quantization", default="float32", choices=["float32", "int8", "int8_float32", "bfloat16"],
                   help="weight type in the export (default: float32)")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p = sub.add_parser(
        "serve", help="serve trained models over HTTP: a JSON API and a page to translate and see attention",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Serve translation and classification runs over HTTP (FastAPI on uvicorn), each under its\n"
                    "run directory's name. Concurrent requests to a model are merged into one batch.\n\n"
                    "  GET  /            a page: type sentences, see translations, click one to see its attention\n"
                    "  GET  /health      status; per model the texts queued and the batches run\n"
                    "  GET  /models      name, task, languages, parameters, beam defaults\n"
                    "  POST /translate   {\"model\", \"texts\": [...], \"beam\", \"n_best\", \"lenpen\", "
                    "\"attention\": false}\n"
                    "  POST /classify    {\"model\", \"texts\": [...], \"attention\": false}\n"
                    "  GET  /docs        the OpenAPI page\n\n"
                    "Errors are JSON {\"error\": \"...\"} with a 4xx status: 422 bad field, 413 too large, "
                    "404 unknown model,\n401 API key, 503 queue full (with Retry-After). SIGTERM or Ctrl-C "
                    "finishes the requests in flight, then exits.",
        epilog="example:\n"
               "  attnkit serve runs/de-en &\n"
               "  curl -s localhost:8000/translate -H 'Content-Type: application/json' \\\n"
               "       -d '{\"texts\": [\"Ein Hund rennt.\"], \"beam\": 1}'")
    p.add_argument("models", nargs="+", metavar="RUN",
                   help="run directories (or .safetensors checkpoints inside one) of translation or classification "
                        "models")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: 127.0.0.1, this machine only; 0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default: 8000)")
    p.add_argument("--threads", type=POSITIVE_INT, metavar="N",
                   help="CPU threads for the models (default: torch's, one per core)")
    p.add_argument("--api-key", metavar="KEY",
                   help="require the header 'Authorization: Bearer KEY' on /models, /translate and /classify "
                        "(default: the environment variable ATTNKIT_API_KEY if set, else no key; the variable keeps "
                        "the key out of the process list)")
    defaults = Limits()
    p.add_argument("--max-texts", type=POSITIVE_INT, default=defaults.max_texts, metavar="N",
                   help=f"texts per request; more is refused with 413 (default: {defaults.max_texts})")
    p.add_argument("--max-chars", type=POSITIVE_INT, default=defaults.max_chars, metavar="N",
                   help=f"characters per text; longer is refused with 413 (default: {defaults.max_chars})")
    p.add_argument("--max-body", type=POSITIVE_INT, default=defaults.max_body, metavar="BYTES",
                   help=f"bytes per request body; larger is refused with 413 (default: {defaults.max_body})")
    p.add_argument("--max-queue", type=POSITIVE_INT, default=defaults.max_queue, metavar="N",
                   help=f"texts waiting per model; beyond, requests get 503 (default: {defaults.max_queue})")
    p.add_argument("--max-batch", type=POSITIVE_INT, default=defaults.max_batch, metavar="N",
                   help=f"texts the model runs at once, from several requests (default: {defaults.max_batch})")
    p.add_argument("--max-wait-ms", type=NON_NEGATIVE, default=defaults.max_wait_ms, metavar="MS",
                   help="how long a model's worker waits for more requests to join a batch (default: "
                        f"{defaults.max_wait_ms:g})")
    return parser


def _read_input(path: str | None) -> list[str]:
    """Lines of ``path``, or of standard input (strict UTF-8 either way)."""
    from ..data.readers import read_lines, read_stream

    if path is None:
        return read_stream(sys.stdin.buffer, "<stdin>")
    return read_lines(path)


def _write_output(path: str | None, lines: list[str]) -> None:
    text = "".join(line + "\n" for line in lines)
    if path is None:
        sys.stdout.write(text)
        return
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as e:
        raise UserError(f"{path}: cannot write ({e.strerror}); check that the directory exists") from None


def _beam(given: int | None, default: int) -> int:
    """``--beam``, or the run's ``decode_beam`` when not given."""
    return default if given is None else given


def cmd_demo(args: argparse.Namespace) -> None:
    from ..demo import HELD_OUT, run_demo

    held_out = HELD_OUT if args.held_out is None else args.held_out
    run_demo(args.out_dir, args.overrides, held_out=held_out, json_path=args.json)


def cmd_prepare(args: argparse.Namespace) -> None:
    from ..config.loader import load_config
    from ..config.schema import RunConfig
    from ..runs.layout import DATA_DIR
    from ..tasks import prepare

    run_dir = Path(args.run_dir or Path("runs") / Path(args.config).stem)
    cfg = load_config(RunConfig, args.config, args.overrides)
    if args.workers is not None and args.workers < 0:
        raise UserError(f"--workers must be 0 (encode in this process) or more, got {args.workers}")
    trained = any((run_dir / "checkpoints").glob("step-*"))  # its checkpoints refer to the prepared data
    data = prepare(cfg, run_dir, lambda msg: print(msg, file=sys.stderr), resume=trained, workers=args.workers)
    size = sum(f.stat().st_size for f in (run_dir / DATA_DIR).iterdir())
    tokens = sum(side["tokens"] for side in data.manifest["sides"].values())
    print(f"{run_dir / DATA_DIR}: {len(data)} examples, {tokens} tokens, {size / 1e6:.1f} MB")


def cmd_train(args: argparse.Namespace) -> None:
    from ..config.loader import load_config
    from ..config.schema import RunConfig
    from ..runs.layout import CONFIG_FILE
    from ..training.trainer import Trainer

    run_dir = Path(args.run_dir or Path("runs") / Path(args.config).stem)
    if args.resume and (run_dir / CONFIG_FILE).exists():
        cfg = load_config(RunConfig, run_dir / CONFIG_FILE, args.overrides)  # the run's own config
    else:
        cfg = load_config(RunConfig, args.config, args.overrides)
    if cfg.model.init_from:  # a missing or mismatched pretraining run: an error before the run directory is touched
        from ..tasks.init_from import check_init_from

        check_init_from(cfg.model.init_from, run_dir)
    trainer = Trainer(cfg, run_dir, resume=args.resume)
    metrics = trainer.run()
    if trainer.workers.is_main:  # under torchrun, one of several processes (see attnkit.training.distributed)
        print(" ".join(f"{k} {v}" for k, v in metrics.items()))


def _translation_model(path: str) -> tuple[Callable[..., list[list[str]]], int, float, LoadedRun | None]:
    """``(translate(texts, **options), decode_beam, decode_lenpen, run)`` for a run (or checkpoint) or an
    exported directory (``run`` is None then); ``options`` are those of
    :func:`attnkit.inference.translate.translate_texts`."""
    from ..export.ctranslate2 import ExportedTranslator, is_exported
    from ..inference.translate import translate_texts
    from ..runs.load import load_run

    if is_exported(path):
        exported = ExportedTranslator(path)
        return exported.translate, exported.decode.beam, exported.decode.lenpen, None
    run = load_run(path)

    def translate(texts: list[str], **options) -> list[list[str]]:
        return translate_texts(run.model, run.tok, texts, **options)

    return translate, run.cfg.decode_beam, run.cfg.decode_lenpen, run


def cmd_translate(args: argparse.Namespace) -> None:
    translate, beam, lenpen, run = _translation_model(args.model)
    if run is None and args.attention_dir:
        raise UserError(f"{args.model}: an exported model gives no attention weights; use --attention-dir "
                        f"with the run directory it was exported from")
    if run is not None and run.cfg.task != "translate":
        hint = "use `attnkit classify`" if run.cfg.task == "classify" else "fine-tune it (model.init_from) first"
        raise UserError(f"{args.model} is a {run.cfg.task} model; {hint}")
    beam = _beam(args.beam, beam)
    if not 1 <= args.n_best <= beam:
        raise UserError(f"--n-best {args.n_best} must be between 1 and --beam {beam}")
    lenpen = lenpen if args.lenpen is None else args.lenpen
    lengths = {k: v for k, v in (("max_len_a", args.max_len_a), ("max_len_b", args.max_len_b)) if v is not None}
    texts = _read_input(args.input)
    hyps = translate(texts, beam=beam, lenpen=lenpen, n_best=args.n_best, batch_size=args.batch_size, **lengths)
    _write_output(args.output, ["\t".join(h) for h in hyps])
    if args.attention_dir:
        from ..viz.figures import attention_figure
        from ..viz.plot import save_figure

        for i, text in enumerate(texts, start=1):
            save_figure(attention_figure(run, text), Path(args.attention_dir) / f"attention-{i:04d}.png")


def cmd_evaluate(args: argparse.Namespace) -> None:
    from ..data.readers import read_labelled, read_parallel
    from ..inference.scores import translation_scores

    translate, beam, lenpen, run = _translation_model(args.model)
    if run is not None and run.cfg.task == "pretrain":
        raise UserError(f"{args.model} is a pretraining run; fine-tune it (model.init_from) and evaluate that")
    if run is not None and run.cfg.task == "classify":
        if not args.data:
            raise UserError("evaluating a classifier needs --data FILE (a labelled .tsv/.csv)")
        from ..inference.classify import evaluate_classifier

        scores, predictions = evaluate_classifier(run, read_labelled(args.data, text_column=run.cfg.data.text_column,
                                                                     label_column=run.cfg.data.label_column))
        if args.hyp_out:
            _write_output(args.hyp_out, predictions)
        print(scores)
        return
    if not (args.src and args.ref):
        raise UserError("evaluating a translation model needs --src FILE and --ref FILE")
    beam = _beam(args.beam, beam)
    pairs = read_parallel(args.src, args.ref)
    lenpen = lenpen if args.lenpen is None else args.lenpen
    hyps = [h[0] for h in translate([s for s, _ in pairs], beam=beam, lenpen=lenpen)]
    if args.hyp_out:
        _write_output(args.hyp_out, hyps)
    print(translation_scores(hyps, [t for _, t in pairs]))


def cmd_classify(args: argparse.Namespace) -> None:
    from ..inference.classify import classify_texts
    from ..runs.load import load_run

    run = load_run(args.model)
    if run.cfg.task != "classify":
        hint = "use `attnkit translate`" if run.cfg.task == "translate" else "fine-tune it (model.init_from) first"
        raise UserError(f"{args.model} is a {run.cfg.task} model; {hint}")
    _write_output(None, classify_texts(run, _read_input(args.input), with_attention=args.with_attention))


def cmd_attention(args: argparse.Namespace) -> None:
    from ..inference.attention_maps import attention_maps
    from ..runs.load import load_run
    from ..viz.figures import attention_figures
    from ..viz.plot import save_figure

    if args.no_png and not args.html:
        raise UserError("--no-png without --html would write nothing; drop --no-png or add --html")
    run = load_run(args.model)
    if run.cfg.task == "pretrain":
        raise UserError(f"{args.model} is a pretraining run; look at the attention of a model fine-tuned from it")
    lenpen = run.cfg.decode_lenpen if args.lenpen is None else args.lenpen
    maps = attention_maps(run, args.src, args.tgt, beam=args.beam, lenpen=lenpen)
    out = Path(args.out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{out}: cannot create the output directory ({e.strerror})") from None
    print(maps.heading())
    written = []
    if not args.no_png:
        written += [save_figure(fig, out / f"{stem}.png") for stem, fig in attention_figures(maps).items()]
    if args.html:
        from ..viz.explorer import write_explorer

        written.append(write_explorer(maps, out / "attention.html"))
    for path in written:
        print(path)


def cmd_export(args: argparse.Namespace) -> None:
    from ..export.ctranslate2 import export_ctranslate2

    print(export_ctranslate2(args.model, args.output, quantization=args.quantization, force=args.force))


def cmd_serve(args: argparse.Namespace) -> None:
    import os

    from ..serve.app import serve

    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be between 0 and 65535, got {args.port}")
    api_key = args.api_key if args.api_key is not None else os.environ.get("ATTNKIT_API_KEY")
    if api_key is not None and not api_key.strip():
        raise UserError("--api-key is empty; give a key, or none to serve without one")
    limits = Limits(max_texts=args.max_texts, max_chars=args.max_chars, max_body=args.max_body,
                    max_queue=args.max_queue, max_batch=args.max_batch, max_wait_ms=args.max_wait_ms)
    try:
        serve(args.models, host=args.host, port=args.port, threads=args.threads, api_key=api_key, limits=limits)
    except KeyboardInterrupt:  # Ctrl-C: the requests in flight were answered; nothing to resume
        print("attnkit serve: stopped", file=sys.stderr)


COMMANDS = {"demo": cmd_demo, "prepare": cmd_prepare, "train": cmd_train, "translate": cmd_translate,
            "evaluate": cmd_evaluate, "classify": cmd_classify, "attention": cmd_attention, "export": cmd_export,
            "serve": cmd_serve}


class _WarningLine(logging.Handler):
    """attnkit's warnings as ``attnkit: warning: ...`` lines on the current standard error."""

    def emit(self, record: logging.LogRecord) -> None:
        print(f"attnkit: warning: {record.getMessage()}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    logger = logging.getLogger("attnkit")
    if not any(isinstance(h, _WarningLine) for h in logger.handlers):
        logger.addHandler(_WarningLine(logging.WARNING))
    try:
        # KEY=VALUE overrides may also follow options (`train c.yaml --run-dir r --resume train.lr=1e-3`),
        # which argparse alone rejects once the positional list has been consumed before the options.
        args, extra = parser.parse_known_args(argv)
        if extra:
            if hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
                args.overrides += extra
            else:
                parser.error(f"unrecognized arguments: {' '.join(extra)}")
        COMMANDS[args.command](args)
    except UserError as e:
        print(f"attnkit: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("attnkit: interrupted; `attnkit train ... --resume` continues from the last checkpoint",
              file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
