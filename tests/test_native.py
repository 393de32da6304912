"""The hand-written int8 matrix-vector kernel (:mod:`attnkit.engine.native`): equal to the widened product for
every tail of rows and columns, the custom op a one-row int8 layer exports as (and the direct call of its C shim in
the compiled program), and the generated loop kept where the kernel cannot be built, with the reason named."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

from attnkit.engine import native
from attnkit.engine.aot import compile_module, matvec_linear
from attnkit.engine.quantize import Int8Linear, int8_linear

pytestmark = pytest.mark.skipif(native.kernel() is None,
                                reason=f"the kernel cannot be built: {native.kernel_failure()}")


def widened(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``s_o sum_i x_i q_oi`` in float64: the reference."""
    return (x.double() @ q.double().T * scale.double()).float()


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("out_features", [1, 3, 4, 9, 64])
@pytest.mark.parametrize("in_features", [1, 15, 16, 17, 100, 576])
def test_the_kernel_is_the_widened_product_for_every_tail(rows: int, out_features: int, in_features: int) -> None:
    """Blocks of four outputs and the outputs left over; vectors of 16 (or 8) inputs and the inputs left over; one
    row and several, the input a strided view."""
    g = torch.Generator().manual_seed(out_features * 1000 + in_features)
    q = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8, generator=g)
    scale = torch.rand(out_features, generator=g) + 0.5
    x = torch.randn(in_features, rows, generator=g).t()[:, None]  # (rows, 1, in), not contiguous
    ours = native.int8_matvec(x, q, scale)
    assert ours.shape == (rows, 1, out_features) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, widened(x, q, scale), atol=1e-4 * in_features ** 0.5, rtol=1e-5)


def test_the_kernel_refuses_what_it_does_not_compute() -> None:
    q, scale = torch.zeros(4, 16, dtype=torch.int8), torch.ones(4)
    with pytest.raises(TypeError, match="float32, int8, float32"):
        native.int8_matvec(torch.zeros(1, 16, dtype=torch.bfloat16), q, scale)
    with pytest.raises(TypeError, match="float32, int8, float32"):
        native.int8_matvec(torch.zeros(1, 16), q.float(), scale)
    with pytest.raises(ValueError, match=r"got \(1, 15\), \(4, 16\), \(4,\)"):  # it would read past the row
        native.int8_matvec(torch.zeros(1, 15), q, scale)
    with pytest.raises(ValueError, match=r"\(4, 16\), \(3,\)"):
        native.int8_matvec(torch.zeros(1, 16), q, scale[:3])


def test_a_row_whose_gradient_is_asked_for_keeps_the_differentiable_product() -> None:
    """The kernel has no backward: a row that needs its gradient goes through the widened product, whose gradient
    is ``sum_o s_o q_oi``."""
    layer = Int8Linear(nn.Linear(40, 12, bias=False))
    x = torch.randn(1, 1, 40, generator=torch.Generator().manual_seed(0), requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, layer.dequantized().sum(0).expand_as(x), atol=1e-5, rtol=1e-5)


def exported_targets(layer: nn.Module, x: torch.Tensor) -> set:
    """The operators of ``layer``'s program on ``x``, exported as a compiled step exports it."""
    program = torch.export.export(layer, (x,))
    table = torch.export.default_decompositions()
    table[torch.ops.aten.linear.default] = matvec_linear
    return {node.target for node in program.run_decompositions(table).graph.nodes}


def test_a_one_row_int8_layer_compiles_to_a_direct_call_of_the_kernel(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-row float32 int8 layer exports as ``attnkit::int8_matvec``; AOTInductor's program calls the kernel's C
    shim (not through the dispatcher) and gives the widened product. More rows keep the matrix product."""
    monkeypatch.setenv("ATTNKIT_CACHE", str(tmp_path))
    layer = Int8Linear(nn.Linear(40, 12)).eval()
    x = torch.randn(1, 1, 40, generator=torch.Generator().manual_seed(0))
    assert torch.ops.attnkit.int8_matvec.default in exported_targets(layer, x)
    assert torch.ops.attnkit.int8_matvec.default not in exported_targets(layer, torch.randn(2, 1, 40))
    program = compile_module(layer, (x,), ({},), {}, matvec=True)
    [package] = (tmp_path / "compiled-steps").glob("*.pt2")
    with zipfile.ZipFile(package) as z:
        code = "".join(z.read(name).decode() for name in z.namelist() if name.endswith("wrapper.cpp"))
    assert "aoti_torch_cpu_int8_matvec(" in code and "proxy_executor" not in code.split("int8_matvec", 1)[1][:200]
    [y] = program.run([x])
    torch.testing.assert_close(y, widened(x, layer.weight, layer.scale) + layer.bias, atol=1e-4, rtol=1e-5)


def test_without_the_kernel_a_step_keeps_the_generated_loop_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """No C++ compiler: no kernel, the reason named, and a one-row layer exports as the generated loop (a product
    and a row sum), computing the same."""
    def no_compiler(*args: object) -> list[str]:
        raise RuntimeError("Could not find a C++ compiler")

    monkeypatch.setattr(native, "_build_command", no_compiler)
    native.kernel.cache_clear()
    try:
        assert native.kernel() is None and native.kernel_failure() == "no C++ compiler: Could not find a C++ compiler"
        layer = Int8Linear(nn.Linear(40, 12)).eval()
        x = torch.randn(1, 1, 40, generator=torch.Generator().manual_seed(0))
        targets = exported_targets(layer, x)
        assert torch.ops.attnkit.int8_matvec.default not in targets and torch.ops.aten.sum.dim_IntList in targets
        torch.testing.assert_close(int8_linear(x, layer.weight, layer.scale), widened(x, layer.weight, layer.scale),
                                   atol=1e-4, rtol=1e-5)
    finally:
        monkeypatch.undo()
        native.kernel.cache_clear()
        native._failure.clear()
    assert native.kernel() is not None


def test_a_source_that_does_not_build_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = tmp_path / "broken.cpp"
    bad.write_text("this is not C++\n")
    monkeypatch.setenv("ATTNKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "SOURCE", bad)
    native.kernel.cache_clear()
    try:
        assert native.kernel() is None
        assert native.kernel_failure().startswith("building broken.cpp failed: ")
        assert "error" in native.kernel_failure() and not list((tmp_path / "cache" / "native").glob("*.so"))
    finally:
        monkeypatch.undo()
        native.kernel.cache_clear()
        native._failure.clear()
    assert native.kernel() is not None
