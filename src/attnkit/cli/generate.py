"""Continue text with a trained language model (task: lm), streaming it to standard output as it is generated.

Each prompt (--prompt, repeatable, or one per line of -i FILE or of standard input) is echoed, then continued
--num-samples times. Temperature T samples from softmax(logits / T), the seeds' soft attention with beta = 1/T;
--temperature 0 is greedy decoding (hard attention, argmax). --top-k and --top-p keep the sample off the long
tail. A --seed gives the same text every time. Generation stops at the end of a document (</s>), at a --stop
string (not printed), or after --max-new-tokens.

A prompt and its continuation must fit the model's context: a table of positions (learned, sinusoidal) has
max_len rows and nothing past them can be read; a model with rope, alibi or no positions reads past the context it
was trained on (an imported model's max_position_embeddings, else data.block_size) only with --beyond-context,
where its predictions get worse and worse. Without --max-new-tokens a sample gets 256 tokens, or what fits.

MODEL may also be a directory written by `attnkit export RUN --to ctranslate2`: CTranslate2 generates then.
Greedy decoding gives the same text; samples come from CTranslate2's own random numbers.

--engine compiled decodes through the engine's compiled prompt pass and step (compiled ahead of time by
torch.export and AOTInductor, a static key/value cache): the same logits up to float rounding, faster per token
once compiled, after seconds of compiling per batch size (docs/engine.md); one layer is compiled and loaded once
per layer, so a deep model compiles in a shallow one's time. The compiled code (no weights) is kept in
$ATTNKIT_CACHE/compiled-steps (else attnkit/compiled-steps under $XDG_CACHE_HOME or ~/.cache; ATTNKIT_CACHE=off:
nowhere), so the next run of a model of the same architecture skips the compiling. --quantize int8 (eager or
compiled) decodes through a copy of the model whose linear layers hold int8 weights, one scale per output row
(attnkit.engine.quantize): a quarter of the bytes to read per token, logits within rounding of the float model's,
so a greedy choice between two nearly equal tokens may differ. --engine reference runs the textbook's own code.
"""

from __future__ import annotations

import argparse
import sys

import torch

from ..common.errors import UserError
from ..engine import Engine, generation_decoder
from ..export.ctranslate2 import is_exported
from ..export.ctranslate2_lm import ExportedGenerator
from ..inference.language_model import (
    DEFAULT_NEW_TOKENS,
    MAX_NEW_TOKENS,
    check_sampling,
    context_limit,
    continue_text,
    prompt_ids,
)
from ..tasks import load_run, require
from .options import (
    POSITIVE_INT,
    add_device_option,
    add_engine_options,
    add_sampling_options,
    engine_of,
    number,
    pick_device,
    read_input,
)

HELP = "continue text with a language model, streamed"


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help=HELP, description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="language-model run directory (task: lm), a .safetensors checkpoint inside one, "
                                 "or a directory written by `attnkit export --to ctranslate2`")
    p.add_argument("--prompt", action="append", help="text to continue (repeat for several prompts)")
    p.add_argument("-i", "--input", help="prompts, one per line (default with no --prompt: standard input)")
    p.add_argument("--max-new-tokens", type=number(int),
                   help=f"tokens to generate per sample, 1..{MAX_NEW_TOKENS} (default {DEFAULT_NEW_TOKENS}, or "
                        "what fits in the model's context after the prompt)")
    add_sampling_options(p)
    p.add_argument("--num-samples", type=POSITIVE_INT, default=1, help="continuations per prompt (default 1)")
    p.add_argument("--beyond-context", action="store_true",
                   help="let prompt and continuation run past the context a rope, alibi or position-free model was "
                        "trained on (its predictions get worse there); a table of positions cannot be read past")
    p.add_argument("--stop", action="append", default=[], help="stop at this string (repeatable)")
    p.add_argument("--no-echo", action="store_true", help="print only the continuation, not the prompt")
    add_device_option(p, "the model (a run; the same --seed gives the same text on the same device)")
    add_engine_options(p, "eager, and each token through a step compiled ahead of time with a static cache: "
                          "seconds of compiling first, then faster tokens (worth it for long or many continuations)")


def run(args: argparse.Namespace) -> None:
    check_sampling(args.temperature, args.top_k, args.top_p)  # --max-new-tokens: prompt_ids checks it
    if any(s == "" for s in args.stop):
        raise UserError("--stop needs a non-empty string")
    if args.prompt is not None and args.input is not None:
        raise UserError("give --prompt or -i FILE, not both")
    engine = engine_of(args, compiled=True)
    exported = ExportedGenerator(args.model, seed=args.seed) if is_exported(args.model) else None
    if exported is not None and engine != Engine():
        raise UserError("--engine / --precision / --quantize: a CTranslate2 export generates with CTranslate2 (its "
                        "weights are quantized when exported: attnkit export --quantization); drop them or give a run")
    if exported is not None and args.device != "cpu":
        raise UserError("--device: a CTranslate2 export generates on the CPU here; drop --device or give a run")
    lm = None if exported is not None else require(load_run(args.model, pick_device(args.device), engine),
                                                   "generate", args.model)
    tok, limit = (exported.tok, exported.limit) if exported is not None else (lm.tok, context_limit(lm))
    prompts = args.prompt if args.prompt is not None else read_input(args.input)
    checked = [prompt_ids(tok, p, limit, args.max_new_tokens, beyond_context=args.beyond_context)
               for p in prompts]  # all, before any output
    generator = torch.Generator(device=next(lm.model.parameters()).device).manual_seed(args.seed) if lm else None
    decoder, choose = generation_decoder(lm.model, engine) if lm is not None else (None, None)
    out = sys.stdout
    first = True
    for prompt, (ids, max_new_tokens) in zip(prompts, checked, strict=True):
        for _ in range(args.num_samples):
            if not first:
                out.write("\n---\n")
            first = False
            if not args.no_echo:
                out.write(prompt)
            sampling = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "stop": args.stop}
            if exported is not None:
                pieces = exported.continue_text(ids, max_new_tokens, **sampling)
            else:
                pieces = continue_text(decoder, lm.tok, ids, max_new_tokens, generator=generator, choose=choose,
                                       **sampling)
            for piece in pieces:
                out.write(piece)
                out.flush()
    out.write("\n")
