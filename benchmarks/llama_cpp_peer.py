"""llama.cpp as a contender of the generation race, through llama-cpp-python built from its source package.

Install (once; it builds llama.cpp with cmake, tuned for this CPU, and is not one of attnkit's dependencies)::

    pip install --no-binary llama-cpp-python llama-cpp-python

**The GGUF files** are made by the converter llama.cpp ships, ``convert_hf_to_gguf.py``, as llama-cpp-python's
source package vendors it (``vendor/llama.cpp/``: the script, its ``conversion`` package and ``gguf-py``): the
source package of the installed version is fetched with ``pip download`` into a cache folder and the three
extracted from it (:func:`converter`), then run by this Python (it needs torch, numpy, sentencepiece and
transformers, which attnkit has) on a Hugging Face model directory, once per weight type (:data:`GGUF_TYPES`:
``F32``, ``F16`` and ``Q8_0``, its ``--outtype`` names).

**Decoding** (:class:`LlamaCppGreedy`) uses llama.cpp's own C API through the package's ``ctypes`` bindings, not its
one-sequence ``Llama`` class, so that a batch of 32 prompts decodes as llama.cpp's batched examples do: one
context with a sequence per row (``n_seq_max``, a unified key/value cache), the prompts as one batch with logits
for each row's last token only, then one token per row per call of ``llama_decode``. The greedy choice is the
argmax of the logits llama.cpp returns (over every token, as attnkit's greedy decoding with ``ignore_eos``).
Everything else is llama.cpp's default: its key/value cache in float16, its own choice of flash attention.
Imports ``llama_cpp`` only when used, so this module loads where the package is not installed.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tarfile
from pathlib import Path

#: The converter's ``--outtype`` for each llama.cpp contender's weights.
GGUF_TYPES = {"F32": "f32", "F16": "f16", "Q8_0": "q8_0"}
#: The weight format (``benchmarks/bandwidth.py``'s ``FORMATS``) of each.
WEIGHTS = {"F32": "float32", "F16": "f16", "Q8_0": "q8_0"}
#: What the converter needs from the source package (under ``vendor/llama.cpp/``).
VENDORED = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def installed_version() -> str | None:
    """The installed llama-cpp-python's version, or None when it is not installed."""
    try:
        return importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        return None


def converter(cache: Path, version: str) -> Path:
    """``convert_hf_to_gguf.py`` of llama-cpp-python ``version``'s source package, extracted under ``cache`` (the
    package fetched by ``pip download`` the first time)."""
    root = cache / f"llama_cpp_python-{version}"
    script = root / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"
    if script.exists():
        return script
    cache.mkdir(parents=True, exist_ok=True)
    sdist = cache / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(cache),
                        f"llama-cpp-python=={version}"], check=True)
    prefix = f"{root.name}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        wanted = [m for m in tar.getmembers() if any(m.name.startswith(prefix + v) for v in VENDORED)]
        if not any(m.name == prefix + VENDORED[0] for m in wanted):
            raise SystemExit(f"{sdist}: no {prefix + VENDORED[0]} in llama-cpp-python's source package")
        tar.extractall(cache, members=wanted, filter="data")
    return script


def convert(script: Path, hf_dir: Path, out: Path, outtype: str) -> Path:
    """``out``, the GGUF of ``hf_dir`` with weights of ``outtype`` (``f32``, ``f16``, ``q8_0``), made by ``script``
    unless it exists; a failure raises ``RuntimeError`` with the converter's last line."""
    if out.exists():
        return out
    partial = out.with_suffix(".partial")
    done = subprocess.run([sys.executable, str(script), str(hf_dir), "--outfile", str(partial), "--outtype", outtype],
                          capture_output=True, text=True)
    if done.returncode != 0:
        lines = (done.stderr.strip() or done.stdout.strip() or f"exit status {done.returncode}").splitlines()
        raise RuntimeError(f"convert_hf_to_gguf.py --outtype {outtype}: {lines[-1]}")
    partial.rename(out)
    return out


class LlamaCppGreedy:
    """Greedy continuation of equal-length prompts by llama.cpp (module doc): ``self(prompts, new_tokens)`` ->
    ``new_tokens`` ids per prompt, in the GGUF's (the Hugging Face model's) ids. A context is made for each batch
    size on its first batch (``n_seq_max`` = the batch), as a program serving that many rows would make it.

    :param max_positions: the most positions of one row (prompt and continuation).
    """

    def __init__(self, gguf: Path, threads: int, max_positions: int) -> None:
        import llama_cpp
        import numpy as np

        self.lib, self.np = llama_cpp, np
        self.gguf, self.threads, self.max_positions = gguf, threads, max_positions
        llama_cpp.llama_backend_init()
        self._quiet = llama_cpp.llama_log_callback(lambda level, text, data: None)  # kept: C holds the pointer
        llama_cpp.llama_log_set(self._quiet, None)
        self.model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        self.vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.contexts: dict[int, tuple] = {}  # batch size -> (context, llama_batch)

    def _context(self, rows: int) -> tuple:
        if rows not in self.contexts:
            params = self.lib.llama_context_default_params()
            params.n_ctx = rows * self.max_positions
            params.n_batch = rows * self.max_positions  # a batch's prompts in one call (its default micro-batches)
            params.n_seq_max = rows
            params.kv_unified = True  # one cache for every sequence, n_ctx cells
            params.n_threads = params.n_threads_batch = self.threads
            ctx = self.lib.llama_init_from_model(self.model, params)
            if not ctx:
                raise RuntimeError(f"llama.cpp could not make a context of {rows} sequences for {self.gguf}")
            self.contexts[rows] = (ctx, self.lib.llama_batch_init(params.n_batch, 0, 1))
        return self.contexts[rows]

    def _decode(self, ctx, batch, rows: list[list[int]], start: int) -> list[int]:
        """Feed ``rows[b]`` to sequence ``b`` at positions ``start...``; the argmax after each row's last token."""
        n = 0
        for seq, tokens in enumerate(rows):
            for k, token in enumerate(tokens):
                batch.token[n], batch.pos[n], batch.n_seq_id[n] = token, start + k, 1
                batch.seq_id[n][0] = seq
                batch.logits[n] = k == len(tokens) - 1
                n += 1
        batch.n_tokens = n
        status = self.lib.llama_decode(ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")
        logits = self.np.ctypeslib.as_array(self.lib.llama_get_logits(ctx), shape=(len(rows), self.vocab))
        return logits.argmax(axis=1).tolist()  # (B,)

    def __call__(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        ctx, batch = self._context(len(prompts))
        self.lib.llama_memory_clear(self.lib.llama_get_memory(ctx), True)
        length = len(prompts[0])
        chosen = self._decode(ctx, batch, prompts, 0)
        out = [[t] for t in chosen]
        for step in range(1, new_tokens):
            chosen = self._decode(ctx, batch, [[t] for t in chosen], length + step - 1)
            for row, t in zip(out, chosen, strict=True):
                row.append(t)
        return out

    def close(self) -> None:
        for ctx, batch in self.contexts.values():
            self.lib.llama_batch_free(batch)
            self.lib.llama_free(ctx)
        self.lib.llama_model_free(self.model)
