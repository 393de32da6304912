"""The memory bandwidth of this host, and the speed limit it puts on decoding at batch 1.

    python benchmarks/bandwidth.py                 # 1 and 2 threads, arrays of 512 MB
    python benchmarks/bandwidth.py --threads 2 --megabytes 1024

A STREAM-like probe (McCalpin's STREAM: copy ``a = b``, triad ``a = b + s c``) in torch, plus a read-only kernel
(``b.sum()``), over float32 arrays far larger than the last-level cache, each timed ``repeats`` times in a fresh
process per thread count (torch's thread pool is set once per process); the best time of each kernel counts, as
STREAM reports it. Bytes are counted as STREAM counts them: copy moves ``2 N`` words, triad ``3 N``, read ``N``
(the cache's write-allocate reads are not counted).

At batch 1 a decoding step multiplies one vector by every weight matrix, so it reads every weight once per token:
``limit tokens/s = read bandwidth / bytes of the weights read per token``. The bytes of a weight format
(:data:`FORMATS`) are its weights' own bytes plus its scales; the key/value cache, a few megabytes at these
lengths, is left out, so the limit is a little above what any implementation can reach.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time

import torch

#: The probe's array size (MB per array, three arrays): far above any last-level cache of these hosts.
ARRAY_MB = 512

#: Bytes per weight of each weight format, and bytes per output row or per block of its scales:
#: ``(bytes per weight, scale bytes, weights per scale; 0: one scale per output row)``.
#: int8 is attnkit's and CTranslate2's (one float32 scale per output row); Q8_0 is llama.cpp's (blocks of 32 int8
#: weights, one float16 scale each: 34 bytes per 32 weights).
FORMATS: dict[str, tuple[float, int, int]] = {
    "float32": (4, 0, 0), "bf16": (2, 0, 0), "f16": (2, 0, 0), "int8": (1, 4, 0), "q8_0": (1, 2, 32)}


def matrix_bytes(shapes: list[tuple[int, int]], vectors: int, weights: str) -> int:
    """The bytes read per token at batch 1: every matrix ``(out, in)`` of ``shapes`` in the format ``weights``
    (:data:`FORMATS`), and ``vectors`` other parameters (norms, biases) in float32."""
    per_weight, scale_bytes, block = FORMATS[weights]
    total = 4 * vectors
    for out, inp in shapes:
        scales = out if block == 0 else out * -(-inp // block)  # (out,) or one per block of each row
        total += int(per_weight * out * inp) + (scale_bytes * scales if scale_bytes else 0)
    return total


def probe(threads: int, megabytes: int = ARRAY_MB, repeats: int = 5) -> dict:
    """Best-of-``repeats`` bandwidth in GB/s (1e9 bytes/s) of read, copy and triad at ``threads`` threads."""
    torch.set_num_threads(threads)
    n = megabytes * 2**20 // 4
    a, b, c = torch.zeros(n), torch.ones(n), torch.full((n,), 2.0)  # touched: every page is mapped before timing
    kernels = {"read": (lambda: b.sum(), 1), "copy": (lambda: a.copy_(b), 2),
               "triad": (lambda: torch.add(b, c, alpha=3.0, out=a), 3)}
    out = {"threads": threads, "array_mb": megabytes, "repeats": repeats}
    for name, (kernel, words) in kernels.items():
        kernel()  # warm-up
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            kernel()
            best = min(best, time.perf_counter() - start)
        out[f"{name}_gb_s"] = words * n * 4 / best / 1e9
    return out


def measure(threads: list[int], megabytes: int = ARRAY_MB, repeats: int = 5) -> list[dict]:
    """:func:`probe` at each thread count, each in a fresh process (spawned: no thread pool inherited)."""
    results = []
    for t in threads:
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            results.append(pool.apply(probe, (t, megabytes, repeats)))
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--megabytes", type=int, default=ARRAY_MB, help=f"MB per array (default {ARRAY_MB})")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    print(json.dumps(measure(args.threads, args.megabytes, args.repeats), indent=1))


if __name__ == "__main__":
    main()
