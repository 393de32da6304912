"""Programs compiled ahead of time: ``torch.export``, AOTInductor, and a cache of the compiled code on disk.

:func:`compile_modules` turns modules of one structure (a model's layers) into :class:`CompiledProgram` s: the
first exported with some dimensions left free (their ranges recorded, :func:`dim_range`), optionally with
:func:`matvec_linear` for one-row linear layers, compiled once by AOTInductor with :data:`STEP_CONFIG` (or loaded
from :func:`step_cache`, keyed by :func:`step_key`), then loaded once per module and pointed at that module's own
parameters and buffers (:func:`step_constants`: nothing copied). Called with a list of tensors, a program runs with
no guards and no Python per operator. Compiling one layer and loading it once per layer (PyTorch's "regional
compilation" of a stack of identical blocks) keeps the compile time of a model independent of its depth.
:mod:`attnkit.engine.compiled_decoding` compiles a language model's decoding step and prompt pass with it.
When compiling fails, :func:`compile_failure` names the cause in one line.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch
import torch._inductor
from torch import Tensor, nn

from ..common.errors import UserError
from ..common.files import cache_dir
from .native import c_shims, cpu_features, kernel

__all__ = ["STEP_CONFIG", "CompiledProgram", "compile_failure", "compile_module", "compile_modules",
           "dim_range", "in_ranges", "load_or_compile", "matvec_linear", "step_cache", "step_config", "step_constants",
           "step_key", "structure"]

#: Inductor settings for a compiled program: realize every intermediate result on the CPU (why:
#: :mod:`attnkit.engine.compiled_decoding`, the matrix-vector products), and plan the intermediate buffers into one
#: allocation (so a call does not allocate and free each of them). The planner nests its plan one level deeper for
#: many of the buffers it places and walks it recursively: the one-row step of a dozen layers or more exceeded Python's
#: recursion limit (a ``RecursionError``), which is one reason a program holds one layer, not the whole stack.
#: An older torch lacks some of these (2.11 has no ``realize_cpu_*``): :func:`step_config` keeps the ones it knows.
STEP_CONFIG = {"realize_cpu_opcount_threshold": 1, "realize_cpu_acc_reads_threshold": 1, "memory_planning": True,
               "aot_inductor.package_constants_in_so": False}


def step_config() -> dict[str, object]:
    """:data:`STEP_CONFIG` less the settings this torch's Inductor does not have (it refuses an unknown key)."""
    from torch._inductor import config

    def known(key: str) -> bool:
        owner: object = config
        for part in key.split("."):
            if not hasattr(owner, part):
                return False
            owner = getattr(owner, part)
        return True
    return {key: value for key, value in STEP_CONFIG.items() if known(key)}


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
    """``module`` compiled ahead of time: :func:`compile_modules` of ``[module]``."""
    [program] = compile_modules([module], examples, dims, ranges, matvec=matvec)
    return program


def compile_modules(modules: list[nn.Module], examples: tuple, dims: tuple, ranges: dict[str, tuple[str, int]], *,
                    matvec: bool) -> list[CompiledProgram]:
    """A program for each of ``modules`` (each on inputs like ``examples``), compiled once for each
    :func:`structure` among them (for a model's layers: once) and loaded once per module.

    The first module of each structure, on copies of ``examples`` with the dimensions ``dims`` left free, is
    exported (``matvec``: with :func:`matvec_linear` for ``nn.Linear``) and compiled by AOTInductor with
    :data:`STEP_CONFIG`; the code is loaded for each module of that structure and pointed at its own parameters and
    buffers (in place: an update that writes into them shows; a tensor replaced by another does not). ``ranges``
    names the free dimensions whose range each program reports: ``{name: (input, dimension)}``."""
    groups: dict[str, list[int]] = {}
    for i, module in enumerate(modules):
        groups.setdefault(structure(module), []).append(i)
    programs: list[CompiledProgram | None] = [None] * len(modules)
    device = torch.utils._pytree.tree_leaves(examples)[0].device
    for indices in groups.values():
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*LeafSpec", category=FutureWarning)  # torch's own, not ours
            with torch.inference_mode(False), torch.no_grad():
                copies = torch.utils._pytree.tree_map(lambda t: t.clone(), examples)  # ordinary tensors, same shapes
                program = torch.export.export(modules[indices[0]], copies, dynamic_shapes=dims)
            if matvec:
                table = torch.export.default_decompositions()
                table[torch.ops.aten.linear.default] = matvec_linear
                program = program.run_decompositions(table)
            key = step_key(program, device)
            loaded = load_or_compile(program, device, copies=len(indices))
        found = {name: dim_range(program, *where) for name, where in ranges.items()}
        for i, compiled in zip(indices, loaded, strict=True):
            constants = step_constants(modules[i], program, compiled.get_constant_fqns())
            compiled.load_constants(constants, check_full_update=True, user_managed=True)  # pointers to these tensors
            programs[i] = CompiledProgram(compiled.loader.boxed_run, constants, found, key)
    return cast(list[CompiledProgram], programs)


def structure(module: nn.Module) -> str:
    """What a compiled program of ``module`` depends on besides its inputs: its modules and their settings (as
    printed) and the name, shape and dtype of each parameter and buffer. Modules of one structure (a model's
    layers) share one compiled program, each with its own tensors. A module with hooks is a structure of its own
    (a hook may hold tensors the program reads)."""
    tensors = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    hooked = any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())
    return "\n".join([repr(module), *(f"{name} {tuple(t.shape)} {t.dtype}" for name, t in tensors),
                      f"hooks of module {id(module)}" if hooked else ""])


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
    tables) stays alive for it, ``ranges``, the least and the most size of each of its free dimensions, and ``key``,
    its compiled code's :func:`step_key` (programs loaded from one compiled package share it)."""

    def __init__(self, run: Callable[[list[Tensor]], list[Tensor]], constants: dict[str, Tensor],
                 ranges: dict[str, tuple[int, float]], key: str = "") -> None:
        self.run = run
        self.constants = constants
        self.ranges = ranges
        self.key = key

    def holds(self, **sizes: int) -> bool:
        """Whether each of ``sizes`` is in its dimension's range."""
        return in_ranges(self.ranges, sizes)


def in_ranges(ranges: dict[str, tuple[int, float]], sizes: dict[str, int]) -> bool:
    """Whether each of ``sizes`` is in its dimension's range, ``ranges[name]`` ``(least, most)``."""
    return all(ranges[name][0] <= size <= ranges[name][1] for name, size in sizes.items())


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
    text = "\n".join([torch.__version__, repr(sorted(step_config().items())), str(device), machine,
                      f"threads {torch.get_num_threads()}", str(program)])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def load_or_compile(program: torch.export.ExportedProgram, device: torch.device, copies: int = 1) -> list:
    """The AOTInductor package of ``program``, loaded ``copies`` times (each copy can point at tensors of its own):
    from :func:`step_cache` when it holds one for :func:`step_key`, else compiled (seconds) and kept there, written
    whole or not at all. The package holds no weights, only code.

    :raises UserError: when compiling fails, with :func:`compile_failure`'s line."""
    folder = step_cache()
    path = None if folder is None else folder / f"{step_key(program, device)}.pt2"
    configs = step_config()
    if any(node.target is torch.ops.attnkit.int8_matvec.default for node in program.graph.nodes):
        configs |= c_shims()  # a direct call of the kernel's C shim
        kernel()  # loaded, its symbols global, before the program that calls them
    if path is not None and path.is_file():
        try:
            return [torch._inductor.aoti_load_package(str(path)) for _ in range(copies)]  # type: ignore[attr-defined]
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
                program, package_path=str(Path(temporary) / "step.pt2"), inductor_configs=configs)
        except Exception as e:  # a one-line message instead of inductor's traceback
            raise UserError(f"compiling ahead of time failed: {compile_failure(e)}; decode without compiling "
                            "(--engine eager)") from None
        if path is not None:
            os.replace(package, path)  # atomic: a reader sees the whole package or none
            package = str(path)
        return [torch._inductor.aoti_load_package(package) for _ in range(copies)]  # type: ignore[attr-defined]


def compile_failure(error: BaseException) -> str:
    """Why compiling failed, in one line, from the exception AOTInductor raised (or one it wraps: inductor reports
    an error of its own as ``InductorError``, the original in its ``inner_exception``).

    A graph too deep for Python's recursion limit, a missing compiler, memory or disk running out and the C++
    compiler's own error are named as such; another error by its type and first line."""
    chain: list[BaseException] = []
    seen: BaseException | None = error
    while seen is not None and seen not in chain:
        chain.append(seen)
        seen = getattr(seen, "inner_exception", None) or seen.__cause__  # what it wraps, not what it handled
    text = "\n".join(str(e) for e in chain)
    lowered = text.lower()
    kinds = {type(e).__name__ for e in chain}
    if "RecursionError" in kinds or "maximum recursion depth" in text:
        return "the compiler exceeded Python's recursion limit (RecursionError): the graph is too deep for it"
    compilers = ("g++", "c++", "gcc", "cc", "clang++", "clang", "icpx")
    if "InvalidCxxCompiler" in kinds or re.search(r"(find|found|no working)[^\n]*c\+\+ compiler", lowered) or any(
            isinstance(e, FileNotFoundError) and Path(str(e.filename)).name in compilers for e in chain):
        return "no working C++ compiler was found (AOTInductor needs one: install g++, or name one in $CXX)"
    if any(isinstance(e, MemoryError) or isinstance(e, OSError) and e.errno == errno.ENOMEM for e in chain) or any(
            phrase in lowered for phrase in ("out of memory", "cannot allocate memory", "memory exhausted",
                                             "killed signal", "std::bad_alloc")):
        return "out of memory while compiling (the C++ compiler or inductor)"
    if any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in chain) or "no space left" in lowered:
        where = step_cache() or tempfile.gettempdir()
        return f"no space left on the disk (the compiled code goes to {where} and {tempfile.gettempdir()})"
    if "CppCompileError" in kinds:
        lines = [line.strip() for line in text.splitlines() if "error" in line.lower()]
        detail = next((line for line in lines if line.lower() != "c++ compile error"), "")
        return f"the C++ compiler failed ({detail[:200]})" if detail else "the C++ compiler failed"
    innermost = chain[-1]
    first = str(innermost).strip().splitlines()[0] if str(innermost).strip() else ""
    return f"{type(innermost).__name__}: {first[:200]}"


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
