"""The schema of a run's YAML file (``attnkit train CONFIG.yaml``): typed dataclasses.

Loaded by :func:`attnkit.config.loader.load_config`, which rejects unknown or mistyped keys by
name. ``configs/*.yaml`` are commented examples; every key has the default shown here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ..common.errors import UserError
from ..common.numeric import round_up
from ..lora import LoRAConfig
from ..rnn import RNNConfig
from ..search import LENPEN
from ..transformer import TransformerConfig

#: How ``<br />`` tags in a document are read (:func:`attnkit.data.documents.clean_text`).
LineBreakTags = Literal["newline", "keep"]
#: Which subwords of a long document a classifier reads (:func:`attnkit.data.documents.truncate`).
Truncation = Literal["head", "head+tail"]


@dataclass
class TokenizerConfig:
    """SentencePiece subwords, trained by ``attnkit train`` on the training text."""

    vocab_size: int = 8000
    # char: SentencePiece's one piece per character (text normalised, no newlines); characters (task: lm): every
    # character of the training text its own id, nothing normalised, as nanoGPT's character level
    model_type: Literal["unigram", "bpe", "char", "characters"] = "unigram"
    joint: bool = True  # one vocabulary for source and target (needed for shared embeddings)
    max_sentences: int = 200_000  # train on a seeded sample of at most this many sentences per model: bounds
    #                               time and memory on corpora of millions of lines (SentencePiece input_sentence_size)


def read_chat_template(value: str) -> str:
    """``data.chat_template``'s template: ``value`` itself when it has a Jinja tag (``{{`` or ``{%``), else the text
    of the file it names (which must have one, or the run's ``config.yaml``, keeping the text, would read a path).

    :raises UserError: the file cannot be read, or holds no tag.
    """
    if not value or "{{" in value or "{%" in value:
        return value
    try:
        text = Path(value).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"data.chat_template: {value}: not found (give a file holding a Jinja chat template, or the "
                        f"template itself)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"data.chat_template: {value}: cannot read ({type(e).__name__})") from None
    if "{{" not in text and "{%" not in text:
        raise UserError(f"data.chat_template: {value} holds no Jinja tag ({{{{ or {{%); a chat template writes the "
                        f"messages with them")
    return text


@dataclass
class DataConfig:
    """Where the text comes from.

    Translation: ``train`` is the source file and ``train_tgt`` the line-aligned target file
    (plain text, optionally ``.gz``), or ``train`` alone is a ``.tsv`` / ``.jsonl`` holding
    both sides. Classification: ``train`` is a ``.tsv`` / ``.csv`` with a header.
    Pretraining (``task: pretrain``): ``train`` (and ``extra_text``) are ``.txt`` files, one text
    per line, or ``.tsv`` / ``.csv`` files whose text column is read (labels ignored).
    ``generate: dates`` uses the built-in date-normalisation task instead of files.
    Classification and pretraining may hold out validation rows of ``train`` instead of reading
    ``valid`` (``valid_fraction``; see :mod:`attnkit.data.documents`).
    Language models (``task: lm``): ``train`` (and ``extra_text``) are read as ``documents: text`` (each file one
    document, raw text; ``valid_fraction`` holds out the *last* share of the first file, nanoGPT's split) or
    ``documents: lines`` (one document per line, or the text column of a ``.tsv`` / ``.csv``, held out as
    pretraining holds them out); documents are joined with ``</s>`` and cut into blocks of ``block_size``.
    """

    train: str = ""
    train_tgt: str | None = None
    valid: str = ""
    valid_tgt: str | None = None
    generate: Literal["none", "dates"] = "none"
    generate_train: int = 40000  # generated examples (generate: dates)
    generate_valid: int = 500
    text_column: str | None = None  # classification: header names (detected when unambiguous)
    label_column: str | None = None
    group_column: str | None = None  # held-out rows keep each value of this column on one side (IMDB: movie)
    valid_fraction: float = 0.0  # > 0: validate on this share of the training rows (groups) instead of `valid`
    valid_seed: int = 1  # which rows are held out (a stable hash of seed and row number or group)
    line_break_tags: LineBreakTags = "newline"  # <br />: a line break (whitespace to SentencePiece), or keep
    truncate: Truncation = "head"  # classification: keep the first max_len subwords, or the head and the tail
    frame: bool = False  # classification: read each window as <s> window </s> (BERT's [CLS] .. [SEP]) in max_len
    extra_text: list[str] = field(default_factory=list)  # pretraining: more unlabelled text files
    max_len: int = 100  # translation: pairs with a side longer than this many subwords are dropped from training;
    #                     classification: texts are cut to this many subwords
    block_size: int = 256  # language models: tokens of context each training example has
    # language models: a file is one document (text), or one per line (lines), or a JSONL file of conversations,
    # one {"messages": [{"role": ..., "content": ...}, ...]} a line, rendered with the run's chat template and
    # trained on the assistant's tokens only (chat; with model.init_from)
    documents: Literal["text", "lines", "chat"] = "lines"
    valid_blocks: int = 0  # language models: validate while training on the first this many blocks (0: all)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    imported_from: str = ""  # the Hugging Face model directory `attnkit import` read (such a run has no data files)
    # language models: how a conversation is laid out for `attnkit chat` (a Jinja chat template, rendered as
    # transformers' apply_chat_template renders it): the template itself, or the path of a file holding it, read
    # when the config is loaded (the run's config.yaml keeps the text; the lm task checks that it parses);
    # `attnkit import` sets the checkpoint's
    chat_template: str = ""
    # language models: what ends an answer besides </s>: pieces of the vocabulary (an instruct model's <|im_end|>),
    # at which generation stops, or strings of text, at which the answer is cut; `attnkit import` sets them
    end_of_turn: list[str] = field(default_factory=list)

    def validate(self) -> None:
        if any(not s for s in self.end_of_turn):
            raise UserError("data.end_of_turn has an empty string; list the pieces or text that end an answer")
        if self.imported_from:
            return  # an imported run was not trained here: it names no training data; its template is as shipped
        self.chat_template = read_chat_template(self.chat_template)  # the file's text from now on
        if self.generate == "none" and not self.train:
            raise UserError("data.train is empty: give a training file (or data.generate: dates)")
        if not 0.0 <= self.valid_fraction < 1.0:
            raise UserError(f"data.valid_fraction must be in [0, 1), got {self.valid_fraction}")
        if self.valid_fraction and self.valid:
            raise UserError("give data.valid or data.valid_fraction, not both")
        if self.valid_blocks < 0:
            raise UserError(f"data.valid_blocks must be 0 (all) or positive, got {self.valid_blocks}")
        if self.generate == "none" and not self.valid and not self.valid_fraction:
            raise UserError("data.valid is empty: give a validation file (or data.valid_fraction)")


@dataclass
class ModelConfig:
    """``arch: transformer`` reads ``transformer:``, ``arch: rnn`` reads ``rnn:``."""

    arch: Literal["transformer", "rnn"] = "transformer"
    transformer: TransformerConfig = field(default_factory=TransformerConfig)
    rnn: RNNConfig = field(default_factory=RNNConfig)
    # classification: an encoder reads the text (BERT's route), or a causal language model's layers do
    # (decoder: GPT's and ULMFiT's route; model.init_from then names a `task: lm` run)
    classifier: Literal["encoder", "decoder"] = "encoder"
    pooling: Literal["max", "mean", "first", "last"] = "max"  # classification only; last: the last real token
    pooler: bool = False  # classification: tanh(W z + b) on the pooled vector before the head (BERT's pooler)
    init_from: str | None = None  # classification: start from this `task: pretrain` (or, decoder: `task: lm`) run;
    #                               task lm: train this `task: lm` run on (its tokenizer and every weight)
    # classification: > 0 adds an n-gram expert of this many hashed slots beside the head, NB-weighted logistic
    # regression over the text's subword uni+bigrams (attnkit/ngrams.py); the prediction is the two experts' product
    ngram_buckets: int = 0
    ngram_lr: float = 1.0  # the n-gram expert's learning rate as a multiple of train.lr (its weights start at zero)
    # task lm with model.init_from: train low-rank adapters (rank, alpha, dropout, targets: attnkit/lora.py) beside
    # the frozen weights of that run instead of every weight; checkpoints hold the adapters only
    lora: LoRAConfig | None = None


@dataclass
class MLMConfig:
    """Masked-language-model pretraining (``task: pretrain``), BERT's recipe (Devlin et al. 2019)."""

    select: float = 0.15  # share of the (non-special) subwords to predict
    mask: float = 0.8  # of those: replaced by <mask>
    random: float = 0.1  # of those: replaced by a random subword (the rest stay as they are)
    min_len: int = 4  # text windows shorter than this many subwords are not trained on
    valid_windows: int = 2000  # validate on at most this many held-out windows
    # mlm: restore the masked subwords (BERT); electra: detect the subwords a small generator replaced
    # (replaced-token detection, Clark et al. 2020; every selected subword -> <mask>, mask/random unused)
    objective: Literal["mlm", "electra"] = "mlm"
    generator_width: float = 0.25  # electra: the generator's d_model, d_ff and heads as a share of the encoder's
    electra_weight: float = 50.0  # electra: lambda, the weight of the discriminator's loss (the paper's 50)
    generator_lr: float = 1.0  # electra: the generator's learning rate as a multiple of train.lr (the paper: 1)

    def validate(self) -> None:
        if not 0.0 < self.select < 1.0:
            raise UserError(f"select must be in (0, 1), got {self.select}")
        if self.mask < 0 or self.random < 0 or self.mask + self.random > 1.0:
            raise UserError(f"mask ({self.mask}) and random ({self.random}) must be >= 0 and sum to at most 1")
        if not 0.0 < self.generator_width <= 1.0:
            raise UserError(f"generator_width must be in (0, 1], got {self.generator_width}")
        if not 0.0 <= self.electra_weight < float("inf"):
            raise UserError(f"electra_weight must be a finite number >= 0, got {self.electra_weight}")
        if not 0.0 < self.generator_lr < float("inf"):
            raise UserError(f"generator_lr must be a finite number > 0, got {self.generator_lr}")


@dataclass
class TrainConfig:
    """Optimisation, precision, validation and checkpointing."""

    seed: int = 1
    max_tokens: int = 4096  # padded tokens per batch (max of source and target side)
    # pad batch lengths to a multiple of this. Coarser means fewer distinct shapes (oneDNN builds
    # and keeps a kernel per bf16 matmul shape); finer means less padding
    pad_multiple: int = 4
    accumulate: int = 1  # batches per update and worker
    tokens_per_update: int = 0  # if set: accumulate = this / (max_tokens x workers), constant over worker counts
    max_updates: int = 20000
    max_epochs: int = 100
    max_minutes: float = 0.0  # wall-clock budget for training; 0 = none
    lr: float = 7e-4  # peak learning rate (reached at the end of warmup)
    # see attnkit.training.trainer
    schedule: Literal["inverse_sqrt", "noam", "constant", "linear", "cosine"] = "inverse_sqrt"
    warmup: int = 4000
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-9
    # adam: weight_decay is Adam's L2 term on every parameter; adamw: decoupled decay (Loshchilov & Hutter 2019)
    # of the matrices only (2+ dims; nanoGPT's choice), not of biases and norm gains
    optimizer: Literal["adam", "adamw"] = "adam"
    weight_decay: float = 0.0
    label_smoothing: float = 0.1
    clip_norm: float = 1.0  # 0 = no clipping
    # auto: bf16 autocast or float32, whichever computes the model's products faster here (measured once per host
    # and model shapes, attnkit.engine.precision; on CUDA bf16 where supported); fp32 is float32's other name
    precision: Literal["auto", "bf16", "float32", "fp32"] = "auto"
    valid_every: int = 1000  # updates between validations (and checkpoints)
    valid_bleu_sentences: int = 500  # greedy-decode this many dev sentences for BLEU (0 = skip)
    keep_checkpoints: int = 5  # most recent step checkpoints kept (for averaging and resume)
    average_last: int = 5  # average the last K checkpoints into averaged.safetensors at the end (0/1 = off)
    patience: int = 0  # stop after this many validations without improvement (0 = never)
    threads: int = 0  # torch intra-op threads (0 = torch's default)
    progress: bool = True  # a progress bar on a terminal, a plain line every 30 s otherwise
    # reference: the textbook path; eager: attnkit.engine's kernels (the same results); compiled: eager (training
    # has no compiled path); "fast", the old name of eager, is read as eager
    engine: Literal["reference", "eager", "compiled", "fast"] = "eager"

    def validate(self) -> None:
        if self.engine == "fast":
            self.engine = "eager"
        for key in ("max_tokens", "accumulate", "max_updates", "max_epochs", "valid_every", "pad_multiple",
                    "keep_checkpoints"):
            if getattr(self, key) < 1:
                raise UserError(f"{key} must be at least 1, got {getattr(self, key)}")
        if self.tokens_per_update < 0:
            raise UserError(f"tokens_per_update must be 0 (off) or positive, got {self.tokens_per_update}")
        if self.tokens_per_update and self.accumulate != 1:
            raise UserError(f"set train.tokens_per_update ({self.tokens_per_update}) or train.accumulate "
                            f"({self.accumulate}), not both: the former derives the latter")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise UserError(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")
        if self.average_last > self.keep_checkpoints:
            raise UserError(f"average_last ({self.average_last}) cannot exceed keep_checkpoints "
                            f"({self.keep_checkpoints}): only that many checkpoints are kept")


@dataclass
class RunConfig:
    """One training run."""

    task: Literal["translate", "classify", "pretrain", "lm"] = "translate"  # the registry: attnkit.tasks
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    mlm: MLMConfig = field(default_factory=MLMConfig)
    decode_beam: int = 4  # defaults for `attnkit translate` / `evaluate`
    decode_lenpen: float = LENPEN

    def validate(self) -> None:
        """What holds for every task; each task checks the rest (:attr:`attnkit.tasks.TaskSpec.check`)."""
        if self.data.max_len < 1:
            raise UserError(f"data.max_len must be at least 1, got {self.data.max_len}")
        if self.data.block_size < 1:
            raise UserError(f"data.block_size must be at least 1, got {self.data.block_size}")

    def check_lengths(self, ends: int) -> None:
        """``data.max_len`` subwords (+ ``ends`` markers, padded) fit the Transformer's positions."""
        if self.model.arch == "transformer":
            longest = round_up(self.data.max_len + ends, self.train.pad_multiple)  # padded
            if longest > self.model.transformer.max_len:
                raise UserError(f"data.max_len={self.data.max_len} (+ {ends} end marker(s), padded: {longest}) exceeds "
                                f"model.transformer.max_len={self.model.transformer.max_len}; raise the latter "
                                f"or lower the former")
