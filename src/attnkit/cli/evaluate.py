"""Translation: sacreBLEU (cased, 13a), lowercased BLEU and chrF with the signature. Classification: accuracy,
macro-F1 and the confusion matrix. Language model: the mean cross-entropy of every token of a text file (in
non-overlapping windows of the training block size, or --context), its perplexity and bits per character.
"""

from __future__ import annotations

import argparse

from ..common.errors import UserError
from ..data.labelled import read_labelled
from ..data.readers import read_parallel
from ..export import open_translator
from ..inference.classify import evaluate_classifier
from ..inference.conversations import score_conversation_file
from ..inference.language_model import score_text_file
from ..inference.scores import translation_scores
from ..tasks import spec
from .options import FINITE, POSITIVE_INT, add_engine_options, add_reading_argument, engine_of, write_output

HELP = "score a trained model on a test set"


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("evaluate", help=HELP, description=__doc__)
    p.add_argument("model", help="run directory or a .safetensors checkpoint inside one")
    p.add_argument("--src", help="translation: source file")
    p.add_argument("--ref", help="translation: reference file (line-aligned with --src)")
    p.add_argument("--data", help="classification: labelled .tsv/.csv with a header; language model: a text file "
                                  "(read as the run's data.documents says: one document, or one per line; a JSONL "
                                  "file of conversations for documents: chat, scored on the assistant's tokens)")
    p.add_argument("--context", type=POSITIVE_INT, default=None,
                   help="language model: score in windows of this many tokens (default: the run's data.block_size)")
    p.add_argument("--beam", type=POSITIVE_INT, default=None, help="beam size (default: the run's decode_beam)")
    p.add_argument("--lenpen", type=FINITE, default=None, help="length penalty alpha (default: the run's)")
    p.add_argument("--hyp-out", help="also write the hypotheses / predictions to this file")
    add_reading_argument(p)
    add_engine_options(p, "the same as eager here (only a language model's generation has compiled steps)")


def run(args: argparse.Namespace) -> None:
    translator = open_translator(args.model, engine=engine_of(args))
    run = translator.run
    if run is not None and spec(run.task).generates:
        if not args.data:
            raise UserError("evaluating a language model needs --data FILE (a text file)")
        if run.cfg.data.documents == "chat":  # trained on conversations: their assistant tokens
            print(score_conversation_file(run, args.data, args.model))
            return
        print(score_text_file(run, args.data, args.context))
        return
    if run is not None and spec(run.task).serves is None:
        raise UserError(f"{args.model} is a pretraining run; fine-tune it (model.init_from) and evaluate that")
    if run is not None and run.classes is not None:  # a classifier
        if not args.data:
            raise UserError("evaluating a classifier needs --data FILE (a labelled .tsv/.csv)")
        data = read_labelled(args.data, text_column=run.cfg.data.text_column, label_column=run.cfg.data.label_column)
        scores, predictions = evaluate_classifier(run, data, reading=args.read)
        if args.hyp_out:
            write_output(args.hyp_out, predictions)
        print(scores)
        return
    if not (args.src and args.ref):
        raise UserError("evaluating a translation model needs --src FILE and --ref FILE")
    beam = translator.beam if args.beam is None else args.beam
    pairs = read_parallel(args.src, args.ref)
    lenpen = translator.lenpen if args.lenpen is None else args.lenpen
    hyps = [h[0] for h in translator.translate([s for s, _ in pairs], beam=beam, lenpen=lenpen)]
    if args.hyp_out:
        write_output(args.hyp_out, hyps)
    print(translation_scores(hyps, [t for _, t in pairs]))
