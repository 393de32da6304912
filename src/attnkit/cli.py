"""Command line: ``attnkit {demo,train,translate,evaluate,classify,attention}``.

User errors (:class:`~attnkit.errors.UserError`) print one line ``attnkit: error: ...`` and
exit with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from .errors import UserError

EXAMPLES = """examples:
  attnkit demo                                   # train on generated dates (~3 min), print exact match
  attnkit train configs/multi30k-de-en.yaml --run-dir runs/de-en
  attnkit train configs/multi30k-de-en.yaml --run-dir runs/de-en --resume train.max_updates=30000
  torchrun --standalone --nproc_per_node=2 -m attnkit train configs/multi30k-de-en.yaml --run-dir runs/de-en
  attnkit translate runs/de-en -i test.de -o test.hyp.en --beam 4
  attnkit evaluate runs/de-en --src test.de --ref test.en
  attnkit classify runs/sst2 -i reviews.txt --with-attention
  attnkit attention runs/de-en --src "Ein Hund rennt." -o attn/ --html
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnkit", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES,
        description="Attention and the Transformer: train translation and classification models on a CPU, "
                    "translate with beam search, score with sacreBLEU, and look at what attention learned.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("demo", help="train a small Transformer on generated dates and show its attention",
                       description="Train a small Transformer to rewrite dates written in 18 formats and 5 "
                                   "languages as ISO 8601, report exact match on held-out dates and save a "
                                   "cross-attention heatmap. No download needed.")
    p.add_argument("-o", "--out-dir", default=".", help="where the run and the heatmap PNG go (default: .)")
    p.add_argument("--held-out", type=int, metavar="N",
                   help="how many held-out dates to score for exact match (default: 1000; fewer is quicker)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="config overrides, e.g. train.max_updates=200 (see configs/demo.yaml)")

    p = sub.add_parser("train", help="train a model from a YAML config",
                       description="Train a translation or classification model. The run directory receives "
                                   "the resolved config, the tokenizer, checkpoints and metrics.jsonl.")
    p.add_argument("config", help="YAML config file (see configs/)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. train.lr=5e-4")
    p.add_argument("--run-dir", help="output directory (default: runs/<config name>)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --run-dir (exactly where it stopped)")

    p = sub.add_parser("translate", help="translate text with a trained model",
                       description="Translate one sentence per line (stdin by default) with beam search.")
    p.add_argument("model", help="run directory or a .safetensors checkpoint inside one")
    p.add_argument("-i", "--input", help="input file (default: stdin)")
    p.add_argument("-o", "--output", help="output file (default: stdout)")
    p.add_argument("--beam", type=int, default=None, help="beam size; 1 = greedy (default: the run's decode_beam)")
    p.add_argument("--lenpen", type=float, default=None,
                   help="GNMT length penalty alpha (default: the run's decode_lenpen, 0.6 unless configured)")
    p.add_argument("--n-best", type=int, default=1, help="hypotheses per sentence, tab-separated (default: 1)")
    p.add_argument("--max-len-a", type=float, default=1.0, help="max output length = a * source length + b")
    p.add_argument("--max-len-b", type=float, default=50, help="(default: a=1, b=50, as in the paper)")
    p.add_argument("--batch-size", type=int, default=64, help="sentences per batch (default: 64)")
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
    p.add_argument("--beam", type=int, default=None, help="beam size (default: the run's decode_beam)")
    p.add_argument("--lenpen", type=float, default=None, help="length penalty alpha (default: the run's)")
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
    p.add_argument("--beam", type=int, default=1, help="beam size for the model's own translation (default: 1, "
                                                       "greedy)")
    p.add_argument("--lenpen", type=float, default=None,
                   help="length penalty alpha with --beam > 1 (default: the run's decode_lenpen)")
    return parser


def _read_input(path: str | None) -> list[str]:
    """Lines of ``path``, or of standard input (strict UTF-8 either way)."""
    from .data import decode_utf8, read_lines, split_lines

    if path is None:
        return split_lines(decode_utf8(sys.stdin.buffer.read(), "<stdin>"))
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
    """``--beam``, or the run's ``decode_beam`` when not given; at least 1."""
    beam = default if given is None else given
    if beam < 1:
        raise UserError(f"--beam must be at least 1 (1 = greedy), got {beam}")
    return beam


def cmd_demo(args: argparse.Namespace) -> None:
    from .demo import run_demo

    if args.held_out is None:
        run_demo(args.out_dir, args.overrides)
    else:
        run_demo(args.out_dir, args.overrides, held_out=args.held_out)


def cmd_train(args: argparse.Namespace) -> None:
    from .config import load_config
    from .runconfig import RunConfig
    from .tasks import CONFIG_FILE
    from .train import Trainer

    run_dir = Path(args.run_dir or Path("runs") / Path(args.config).stem)
    if args.resume and (run_dir / CONFIG_FILE).exists():
        cfg = load_config(RunConfig, run_dir / CONFIG_FILE, args.overrides)  # the run's own config
    else:
        cfg = load_config(RunConfig, args.config, args.overrides)
    if cfg.model.init_from:  # a missing or mismatched pretraining run: an error before the run directory is touched
        from .pretrain import check_init_from

        check_init_from(cfg.model.init_from, run_dir)
    trainer = Trainer(cfg, run_dir, resume=args.resume)
    metrics = trainer.run()
    if trainer.workers.is_main:  # under torchrun, one of several processes (see attnkit.distributed)
        print(" ".join(f"{k} {v}" for k, v in metrics.items()))


def cmd_translate(args: argparse.Namespace) -> None:
    from .tasks import load_run, translate_texts

    run = load_run(args.model)
    if run.cfg.task != "translate":
        raise UserError(f"{args.model} is a {run.cfg.task} model; use `attnkit classify`")
    beam = _beam(args.beam, run.cfg.decode_beam)
    if args.batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {args.batch_size}")
    if not 1 <= args.n_best <= beam:
        raise UserError(f"--n-best {args.n_best} must be between 1 and --beam {beam}")
    lenpen = run.cfg.decode_lenpen if args.lenpen is None else args.lenpen
    texts = _read_input(args.input)
    hyps = translate_texts(run.model, run.tok, texts, beam=beam, lenpen=lenpen,
                           n_best=args.n_best, batch_size=args.batch_size, max_len_a=args.max_len_a,
                           max_len_b=args.max_len_b)
    _write_output(args.output, ["\t".join(h) for h in hyps])
    if args.attention_dir:
        from .attention_maps import attention_figure
        from .plot import save_figure

        for i, text in enumerate(texts, start=1):
            save_figure(attention_figure(run, text), Path(args.attention_dir) / f"attention-{i:04d}.png")


def cmd_evaluate(args: argparse.Namespace) -> None:
    from .data import read_labelled, read_parallel
    from .evaluate import translation_scores
    from .tasks import load_run, translate_texts

    run = load_run(args.model)
    if run.cfg.task == "pretrain":
        raise UserError(f"{args.model} is a pretraining run; fine-tune it (model.init_from) and evaluate that")
    if run.cfg.task == "classify":
        if not args.data:
            raise UserError("evaluating a classifier needs --data FILE (a labelled .tsv/.csv)")
        from .classify import evaluate_classifier

        scores, predictions = evaluate_classifier(run, read_labelled(args.data, text_column=run.cfg.data.text_column,
                                                                     label_column=run.cfg.data.label_column))
        if args.hyp_out:
            _write_output(args.hyp_out, predictions)
        print(scores)
        return
    if not (args.src and args.ref):
        raise UserError("evaluating a translation model needs --src FILE and --ref FILE")
    beam = _beam(args.beam, run.cfg.decode_beam)
    pairs = read_parallel(args.src, args.ref)
    lenpen = run.cfg.decode_lenpen if args.lenpen is None else args.lenpen
    hyps = [h[0] for h in translate_texts(run.model, run.tok, [s for s, _ in pairs], beam=beam, lenpen=lenpen)]
    if args.hyp_out:
        _write_output(args.hyp_out, hyps)
    print(translation_scores(hyps, [t for _, t in pairs]))


def cmd_classify(args: argparse.Namespace) -> None:
    from .classify import classify_texts
    from .tasks import load_run

    run = load_run(args.model)
    if run.cfg.task != "classify":
        hint = "use `attnkit translate`" if run.cfg.task == "translate" else "fine-tune it (model.init_from) first"
        raise UserError(f"{args.model} is a {run.cfg.task} model; {hint}")
    _write_output(None, classify_texts(run, _read_input(args.input), with_attention=args.with_attention))


def cmd_attention(args: argparse.Namespace) -> None:
    from .attention_maps import attention_figures, attention_maps
    from .plot import save_figure
    from .tasks import load_run

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
    print(f"{maps.source} -> {maps.output}" + (" (given)" if maps.forced else ""))
    written = []
    if not args.no_png:
        written += [save_figure(fig, out / f"{stem}.png") for stem, fig in attention_figures(maps).items()]
    if args.html:
        from .explorer import write_explorer

        written.append(write_explorer(maps, out / "attention.html"))
    for path in written:
        print(path)


COMMANDS = {"demo": cmd_demo, "train": cmd_train, "translate": cmd_translate, "evaluate": cmd_evaluate,
            "classify": cmd_classify, "attention": cmd_attention}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # KEY=VALUE overrides may also follow options (`train c.yaml --run-dir r --resume train.lr=1e-3`),
    # which argparse alone rejects once the positional list has been consumed before the options.
    args, extra = parser.parse_known_args(argv)
    if extra:
        if hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
            args.overrides += extra
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
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
