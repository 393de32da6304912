"""The engine's one hand-written kernel: the int8 matrix-vector product of a one-row step, and the custom op that
compiled steps call it through.

A compiled one-row step computes each int8 linear layer as a loop the compiler generates
(:func:`~.aot.matvec_linear`), which keeps one accumulator per output and waits on each addition, while the product
should wait on memory only (``docs/engine.md``, int8 weights). ``int8_matvec.cpp`` (beside this module) computes
the same ``y_o = s_o sum_i x_i q_oi`` four outputs at a time with an accumulator each, and prefetches the weight
rows ahead of where it reads. It is built here, once per machine, with the C++ compiler that AOTInductor uses
(``-march=native``, as the compiled steps are), kept in :func:`~attnkit.common.files.cache_dir` ``("native")``
keyed by its source, the compiler's flags and the CPU, and loaded into this process.

Torch knows it as the custom op ``attnkit::int8_matvec(Tensor x, Tensor weight, Tensor scale) -> Tensor``
(:func:`int8_matvec`): eagerly it runs the kernel through ``ctypes``; under ``torch.export`` it is one node, which
AOTInductor compiles into a direct call of the kernel's C shim (``aoti_torch_cpu_int8_matvec``; the settings are
:func:`c_shims`). Where no compiler is found or the build fails, :func:`kernel` is None, with the reason in
:func:`kernel_failure`, and the step keeps the generated loop.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

from ..common.files import cache_dir

__all__ = ["SOURCE", "c_shims", "cpu_features", "int8_matvec", "kernel", "kernel_failure"]

#: The kernel's source.
SOURCE = Path(__file__).with_name("int8_matvec.cpp")
#: The C shim's declaration, as AOTInductor's generated code declares it.
SHIM = ("AOTITorchError aoti_torch_cpu_int8_matvec(AtenTensorHandle x, AtenTensorHandle weight, "
        "AtenTensorHandle scale, AtenTensorHandle* ret)")
_failure: list[str] = []


def cpu_features() -> str:
    """The CPU's model name and instruction-set flags, which ``-march=native`` compiles for (the first processor's
    entry of ``/proc/cpuinfo``; the platform's name where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            first = f.read().split("\n\n", 1)[0].splitlines()
    except OSError:
        return f"{platform.machine()} {platform.processor()} {torch.backends.cpu.get_cpu_capability()}"
    return "\n".join(line for line in first if line.startswith(("model name", "flags")))


def _build_command(source: Path, out: Path) -> list[str]:
    """The compiler's command line: AOTInductor's compiler, ``-march=native``, OpenMP, torch's headers and
    libraries (the shim's ``aoti_torch_*`` functions are libtorch_cpu's)."""
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch.utils.cpp_extension import include_paths, library_paths

    torch_lib = library_paths()[0]
    return [get_cpp_compiler(), str(source), "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17",
            *(f"-I{p}" for p in include_paths()), f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}", "-ltorch_cpu",
            "-lc10", "-o", str(out)]


@cache
def kernel() -> ctypes.CDLL | None:
    """The kernel's library, built once per machine (kept in the cache) and loaded with its symbols global (so that
    a compiled step's library finds the shim when it is loaded); None where it cannot be built
    (:func:`kernel_failure` says why)."""
    try:
        command = _build_command(SOURCE, Path("out.so"))
    except Exception as e:  # torch finds no C++ compiler
        _failure[:] = [f"no C++ compiler: {str(e).splitlines()[0] if str(e) else type(e).__name__}"]
        return None
    key = hashlib.sha256(b"\n".join([SOURCE.read_bytes(), " ".join(command).encode(), cpu_features().encode(),
                                     torch.__version__.encode()])).hexdigest()[:24]
    folder = cache_dir("native") or Path(tempfile.mkdtemp(prefix="attnkit-native-"))
    path = folder / f"int8_matvec-{key}.so"
    if not path.is_file():
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=folder) as temporary:
                built = Path(temporary) / path.name
                done = subprocess.run(_build_command(SOURCE, built), capture_output=True, text=True)
                if done.returncode != 0:
                    lines = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines()
                    _failure[:] = [f"building {SOURCE.name} failed: {lines[0] if lines else done.returncode}"]
                    return None
                os.replace(built, path)  # atomic: another process sees the whole library or none
        except OSError as e:  # the compiler missing, the cache not writable
            _failure[:] = [f"building {SOURCE.name} failed: {e}"]
            return None
    try:
        library = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:  # a damaged file, a library it needs not found
        _failure[:] = [f"loading {path.name} failed: {e}"]
        return None
    _failure.clear()
    library.attnkit_int8_matvec.restype = None
    library.attnkit_int8_matvec.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
    return library


def kernel_failure() -> str:
    """Why :func:`kernel` is None ('' when it is not, or before it is asked)."""
    return _failure[0] if _failure else ""


@torch.library.custom_op("attnkit::int8_matvec", mutates_args=())
def int8_matvec(x: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
    """``y_o = s_o sum_i x_i q_oi``: ``x`` float32 ``(..., K)``, ``weight`` int8 ``(N, K)``, ``scale`` float32
    ``(N,)`` -> float32 ``(..., N)``, by the hand-written kernel (``int8_matvec.cpp``), every row a matrix-vector
    product (it is meant for one row: it reads the weights once per row)."""
    library = kernel()
    if library is None:
        raise RuntimeError(f"attnkit::int8_matvec: {kernel_failure()}")
    if x.dtype != torch.float32 or weight.dtype != torch.int8 or scale.dtype != torch.float32:
        raise TypeError(f"attnkit::int8_matvec takes float32, int8, float32, got {x.dtype}, {weight.dtype}, "
                        f"{scale.dtype}")
    if weight.dim() != 2 or x.size(-1) != weight.size(1) or scale.shape != (weight.size(0),):
        raise ValueError(f"attnkit::int8_matvec: x (..., K), weight (N, K), scale (N,), got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(scale.shape)}")
    if {x.device.type, weight.device.type, scale.device.type} != {"cpu"}:
        raise ValueError("attnkit::int8_matvec runs on the CPU")
    x, weight, scale = x.contiguous(), weight.contiguous(), scale.contiguous()
    N, K = weight.shape
    y = x.new_empty(*x.shape[:-1], N)  # (..., N)
    library.attnkit_int8_matvec(x.data_ptr(), weight.data_ptr(), scale.data_ptr(), y.data_ptr(),
                                x.numel() // max(K, 1), N, K)
    return y


@int8_matvec.register_fake
def _(x: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
    return x.new_empty(*x.shape[:-1], weight.size(0))


def c_shims() -> dict[str, object]:
    """AOTInductor's settings for a program that calls :func:`int8_matvec`: call the kernel's C shim directly (not
    through torch's dispatcher)."""
    return {"aot_inductor.custom_ops_to_c_shims": {torch.ops.attnkit.int8_matvec.default: [SHIM]}}
