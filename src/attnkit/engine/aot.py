"""Programs compiled ahead of time: ``torch.export``, AOTInductor, and a cache of the compiled code on disk.

:func:`compile_module` turns a module into a :class:`CompiledProgram`: exported with some dimensions left free
(their ranges recorded, :func:`dim_range`), optionally with :func:`matvec_linear` for one-row linear layers,
compiled by AOTInductor with :data:`STEP_CONFIG` (or loaded from :func:`step_cache`, keyed by :func:`step_key`),
and pointed at the module's own parameters and buffers (:func:`step_constants`: nothing copied). Called with a
list of tensors, a program runs with no guards and no Python per operator.
:mod:`attnkit.engine.compiled_decoding` compiles a language model's decoding step and prompt pass with it.
"""

from __future__ import annotations

import hashlib
import os
import platform
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch._inductor
from torch import Tensor, nn

from ..common.errors import UserError
from ..common.files import cache_dir

__all__ = ["STEP_CONFIG", "CompiledProgram", "compile_module", "cpu_features", "dim_range", "load_or_compile",
           "matvec_linear", "step_cache", "step_constants", "step_key"]

#: Inductor settings for a compiled program: realize every intermediate result on the CPU (why:
#: :mod:`attnkit.engine.compiled_decoding`, the matrix-vector products), and plan the intermediate buffers into one
#: allocation (so a call does not allocate and free each of them).
STEP_CONFIG = {"realize_cpu_opcount_threshold": 1, "realize_cpu_acc_reads_threshold": 1, "memory_planning": True,
               "aot_inductor.package_constants_in_so": False}


def matvec_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` for one row, ``y_o = sum_i x_i W_oi (+ b_o)``, written as an elementwise product and a row sum.

    ``x`` ``(..., in)`` with one row in all, ``weight`` ``(out, in)`` -> ``(..., out)``. Eager, the product would be
    materialised; compiled, it is one loop over each weight row. Inputs with more rows keep ``F.linear`` (the
    decomposition declines), where a matrix-matrix routine is the better way."""
    if x.numel() != x.size(-1):
        return NotImplemented  # type: ignore[no-any-return]
    y = (x.unsqueeze(-2) * weight).sum(-1)  # (..., 1, in) * (out, in) -> (..., out)
    return y if bias is None else y + bias


def compile_module(module: nn.Module, examples: tuple, dims: tuple, ranges: dict[str, tuple[str, int]], *,
                   matvec: bool) -> CompiledProgram:
    """``module`` on inputs like ``examples`` (copied), with the dimensions ``dims`` left free, compiled ahead of
    time: ``torch.export`` (``matvec``: with :func:`matvec_linear` for ``nn.Linear``), AOTInductor with
    :data:`STEP_CONFIG`, loaded, and pointed at the module's own parameters and buffers (in place: an update that
    writes into them shows; a tensor replaced by another does not). ``ranges`` names the free dimensions whose
    range the result reports: ``{name: (input, dimension)}``."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LeafSpec", category=FutureWarning)  # torch's own, not ours
        with torch.inference_mode(False), torch.no_grad():
            copies = torch.utils._pytree.tree_map(lambda t: t.clone(), examples)  # ordinary tensors, same shapes
            program = torch.export.export(module, copies, dynamic_shapes=dims)
        if matvec:
            table = torch.export.default_decompositions()
            table[torch.ops.aten.linear.default] = matvec_linear
            program = program.run_decompositions(table)
        compiled = load_or_compile(program, torch.utils._pytree.tree_leaves(examples)[0].device)
    constants = step_constants(module, program, compiled.get_constant_fqns())
    compiled.load_constants(constants, check_full_update=True, user_managed=True)  # pointers to these tensors
    return CompiledProgram(compiled.loader.boxed_run, constants,
                           {name: dim_range(program, *where) for name, where in ranges.items()})


def dim_range(program: torch.export.ExportedProgram, name: str, dim: int) -> tuple[int, float]:
    """The sizes of dimension ``dim`` of input ``name`` that an exported program holds for: the traced code may
    branch on a size (a kernel chosen by the number of keys), and export records the range where it took the
    branches it took."""
    [node] = [n for n in program.graph.nodes if n.op == "placeholder" and n.name == name]
    size = node.meta["val"].shape[dim]
    if not isinstance(size, torch.SymInt):
        return int(size), int(size)
    bounds = program.range_constraints.get(size.node.expr)
    if bounds is None:  # a size derived from others: only the traced one is known to hold
        return int(size.node.hint), int(size.node.hint)
    return int(bounds.lower), float(bounds.upper) if bounds.upper.is_finite else float("inf")


class CompiledProgram:
    """A loaded program: ``run`` takes a list of tensors and returns a list (no pytree, no guards). It holds the
    tensors the package points at (``constants``), so that a buffer the model later replaces (RoPE's growing
    tables) stays alive for it, and ``ranges``, the least and the most size of each of its free dimensions."""

    def __init__(self, run: Callable[[list[Tensor]], list[Tensor]], constants: dict[str, Tensor],
                 ranges: dict[str, tuple[int, float]]) -> None:
        self.run = run
        self.constants = constants
        self.ranges = ranges

    def holds(self, **sizes: int) -> bool:
        """Whether each of ``sizes`` is in its dimension's range."""
        return all(self.ranges[name][0] <= size <= self.ranges[name][1] for name, size in sizes.items())


def step_cache() -> Path | None:
    """Where compiled steps are kept between processes: ``$ATTNKIT_CACHE/compiled-steps`` (``ATTNKIT_CACHE=off``:
    nowhere), else ``$XDG_CACHE_HOME/attnkit/compiled-steps``, else ``~/.cache/attnkit/compiled-steps``
    (:func:`~attnkit.common.files.cache_dir`)."""
    return cache_dir("compiled-steps")


def step_key(program: torch.export.ExportedProgram, device: torch.device) -> str:
    """What a compiled step depends on, hashed: the exported graph with every tensor's shape and dtype (printed),
    the compiler's settings, torch's version, the machine it was compiled for (``-march=native``) and the thread
    count (the compiler decides which loops to run in parallel by it)."""
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_features()
    text = "\n".join([torch.__version__, repr(sorted(STEP_CONFIG.items())), str(device), machine,
                      f"threads {torch.get_num_threads()}", str(program)])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def cpu_features() -> str:
    """The CPU's model name and instruction-set flags, which ``-march=native`` compiles for (the first processor's
    entry of ``/proc/cpuinfo``; the platform's name where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            first = f.read().split("\n\n", 1)[0].splitlines()
    except OSError:
        return f"{platform.machine()} {platform.processor()} {torch.backends.cpu.get_cpu_capability()}"
    return "\n".join(line for line in first if line.startswith(("model name", "flags")))


def load_or_compile(program: torch.export.ExportedProgram, device: torch.device):
    """The AOTInductor package of ``program``: from :func:`step_cache` when it holds one for :func:`step_key`, else
    compiled (seconds) and kept there, written whole or not at all. The package holds no weights, only code."""
    folder = step_cache()
    path = None if folder is None else folder / f"{step_key(program, device)}.pt2"
    if path is not None and path.is_file():
        try:
            return torch._inductor.aoti_load_package(str(path))  # type: ignore[attr-defined]
        except Exception:  # unreadable (another torch build, a damaged file): compiled again, replaced below
            pass
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError:  # no cache where it cannot be written: compiled for this process only
            path = None
    with tempfile.TemporaryDirectory(prefix="attnkit-step-", dir=None if path is None else path.parent) as temporary:
        try:
            package = torch._inductor.aoti_compile_and_package(  # type: ignore[attr-defined]
                program, package_path=str(Path(temporary) / "step.pt2"), inductor_configs=dict(STEP_CONFIG))
        except Exception as e:  # no C++ compiler, most often: a one-line message instead of inductor's traceback
            why = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise UserError(f"compiling ahead of time failed ({type(e).__name__}: {why[:200]}); AOTInductor needs "
                            "a C++ compiler (g++); decode without compiling (--engine eager)") from None
        if path is not None:
            os.replace(package, path)  # atomic: a reader sees the whole package or none
            package = str(path)
        return torch._inductor.aoti_load_package(package)  # type: ignore[attr-defined]


def step_constants(module: nn.Module, program: torch.export.ExportedProgram, names: list[str]) -> dict[str, Tensor]:
    """The tensors a compiled step reads, by the ``names`` AOTInductor gives them: the module's parameters and buffers
    under their own names (tied weights under each), and the tensors that export lifted out of the step (made in
    it, or held by a hook) under ``_tensor_constant0, 1, ...``, in the order export lifted them."""
    tensors = dict(module.named_parameters(remove_duplicate=False))
    tensors.update(module.named_buffers(remove_duplicate=False))
    lifted = [program.constants[name] for name in program.graph_signature.lifted_tensor_constants]
    prefix = "_tensor_constant"
    unknown = [name for name in names if name not in tensors]
    if len(unknown) != len(lifted) or not all(n.startswith(prefix) and n[len(prefix):].isdigit() for n in unknown):
        raise RuntimeError(f"the compiled step reads tensors it cannot find in the model: {', '.join(unknown)}")
    unknown.sort(key=lambda name: int(name[len(prefix):]))
    tensors.update(zip(unknown, lifted, strict=True))  # type: ignore[arg-type]
    return {name: tensors[name] for name in names}
