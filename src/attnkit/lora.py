"""LoRA: low-rank adapters beside a frozen model (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language
Models").

    h = W x + (alpha / r) B A x          W (d_out, d_in) frozen;  A (r, d_in), B (d_out, r) trained;  r << d

Fine-tuning changes each weight matrix by some ``Delta W``; the paper's observation is that for adapting a
pretrained model ``Delta W`` can be of low rank, so it is written ``B A`` with rank ``r`` (4 to 64 for models of
any size) and only ``A`` and ``B`` learn. In this module:

* **B starts at zero** (A at random, as ``nn.Linear`` initialises a weight: Kaiming-uniform), so ``B A = 0`` and the
  adapted model starts as exactly the base model; the first updates move ``B`` away from zero along directions
  that ``A`` projects onto. (Both at zero would leave every gradient zero; both random would start elsewhere.)
* **alpha / r** scales the update, so that changing ``r`` does not change how far a step of Adam moves the output:
  Adam's step in ``B`` is about the learning rate whatever ``r``, and ``B A x`` sums ``r`` terms.
* **What it costs**: ``r (d_in + d_out)`` parameters per adapted matrix instead of ``d_in d_out`` (rank 8 on a
  576 x 576 matrix: 9,216 of 331,776, under 3%), and optimiser state only for those. The forward pass costs
  two thin products more per matrix; the base's gradients are never formed, only the activations' (the backward
  pass through the frozen ``W`` remains). Once trained, :func:`merge_lora` adds ``(alpha / r) B A`` into ``W``:
  no extra cost at inference.
* **Dropout** (``dropout``) acts on the adapter's input only: ``(alpha / r) B A Drop(x)``, as PEFT does (the ``q``,
  ``k``, ``v`` adapters of one fused layer share a mask, where PEFT draws one per module: the same distribution for
  each adapter).

Targets (``LoRAConfig.targets``) are the projections of :class:`attnkit.lm.Block`:

==========  =====================================================  ===========================================
target      matrix                                                 Hugging Face (Llama / GPT-2)
==========  =====================================================  ===========================================
``q``       ``W^Q``: rows ``[0, H d_k)`` of ``self_attn.in_proj``     ``q_proj`` / part of ``c_attn``
``k``       ``W^K``: the next ``H_kv d_k`` rows of ``in_proj``        ``k_proj`` / part of ``c_attn``
``v``       ``W^V``: the last ``H_kv d_v`` rows of ``in_proj``        ``v_proj`` / part of ``c_attn``
``o``       ``W^O``: ``self_attn.out_proj``                          ``o_proj`` / ``attn.c_proj``
``w1``      the FFN's first matrix (SwiGLU's gate): ``ff.w1``        ``gate_proj`` / ``mlp.c_fc``
``w3``      SwiGLU's up projection: ``ff.w3``                        ``up_proj`` / none
``w2``      the FFN's last matrix: ``ff.w2``                         ``down_proj`` / ``mlp.c_proj``
==========  =====================================================  ===========================================

``attention`` stands for ``q, k, v, o`` and ``feed_forward`` for ``w1, w2`` (and ``w3`` where there is one);
the default ``[q, v]`` is the paper's choice. ``W^Q``, ``W^K`` and ``W^V`` are one fused matrix here
(:class:`attnkit.multihead.MultiHeadAttention`'s ``in_proj``), so :class:`LoRALinear` keeps one adapter per row
block (``q``, ``k``, ``v``): each is exactly the adapter Hugging Face's PEFT puts on ``q_proj``, ``k_proj`` or
``v_proj``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .lm import Block

__all__ = ["TARGETS", "LoRAConfig", "LoRALinear", "apply_lora", "is_adapted", "lora_state_dict", "merge_lora",
           "place_rows"]

#: Every target, in the order the projections are met in a block.
TARGETS = ("q", "k", "v", "o", "w1", "w3", "w2")
#: Names for groups of targets.
GROUPS = {"attention": ("q", "k", "v", "o"), "feed_forward": ("w1", "w3", "w2")}


@dataclass
class LoRAConfig:
    """A run's ``model.lora``: which projections get adapters, and their rank, scale and dropout (module doc)."""

    rank: int = 8  # r
    alpha: float = 16.0  # the update is scaled by alpha / r
    dropout: float = 0.0  # on the adapters' input
    targets: list[str] = field(default_factory=lambda: ["q", "v"])  # of TARGETS, or attention / feed_forward

    def validate(self) -> None:
        """:raises ValueError: a rank below 1, an alpha that is not positive, a dropout outside [0, 1), or a target
        that is not a projection (the config loader reports it with the key)."""
        if self.rank < 1:
            raise ValueError(f"rank must be at least 1, got {self.rank}")
        if not 0.0 < self.alpha < float("inf"):
            raise ValueError(f"alpha must be a positive number, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        unknown = [t for t in self.targets if t not in TARGETS and t not in GROUPS]
        if unknown or not self.targets:
            raise ValueError(f"targets {unknown or '[]'}: name projections of {', '.join(TARGETS)}, or "
                             f"{' / '.join(GROUPS)}")

    @property
    def scale(self) -> float:
        """``alpha / r``."""
        return self.alpha / self.rank

    def expanded(self, gated: bool = True) -> list[str]:
        """The targets with the groups spelled out, in :data:`TARGETS`' order; ``feed_forward`` covers ``w3`` only
        in a ``gated`` FFN (SwiGLU's)."""
        wanted: set[str] = set()
        for t in self.targets:
            wanted |= {g for g in GROUPS[t] if gated or g != "w3"} if t in GROUPS else {t}
        return [t for t in TARGETS if t in wanted]


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` with low-rank adapters on blocks of its output rows: ``h = W x + b + s B A Drop(x)``,
    ``s = alpha / r``, where ``B A`` is one adapter's update on its rows and zero elsewhere.

    :param base: the layer adapted; its weight and bias are frozen (``requires_grad`` false) and used as they are.
    :param parts: ``{target: (first row, end row)}`` of the adapted output rows: one block covering every row for a
        plain projection, or ``q``, ``k``, ``v`` of a fused ``[W^Q; W^K; W^V]`` (some of them).
    :param rank: ``r``; ``alpha``: the scale's numerator; ``dropout``: on the adapters' input.

    Its parameters are ``lora_A[target]`` ``(r, d_in)`` and ``lora_B[target]`` ``(rows, r)``, PEFT's ``lora_A.weight``
    and ``lora_B.weight``.
    """

    def __init__(self, base: nn.Linear, parts: dict[str, tuple[int, int]], rank: int, alpha: float,
                 dropout: float = 0.0) -> None:
        super().__init__()
        if not parts or any(not 0 <= a < b <= base.out_features for a, b in parts.values()):
            raise ValueError(f"LoRALinear parts {parts} must be row blocks of the {base.out_features} output rows")
        self.base = base.requires_grad_(False)
        self.parts = dict(sorted(parts.items(), key=lambda kv: kv[1]))  # in row order
        self.rank, self.scale = rank, alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        for name, (a, b) in self.parts.items():
            A = torch.empty(rank, base.in_features, device=base.weight.device, dtype=base.weight.dtype)
            nn.init.kaiming_uniform_(A, a=math.sqrt(5))  # nn.Linear's initialisation of a weight, as PEFT's
            self.lora_A[name] = nn.Parameter(A)  # (r, d_in)
            self.lora_B[name] = nn.Parameter(torch.zeros(b - a, rank, device=A.device, dtype=A.dtype))  # (rows, r)

    def extra_repr(self) -> str:
        return f"parts={list(self.parts)}, rank={self.rank}, scale={self.scale:g}"

    def forward(self, x: Tensor) -> Tensor:
        """``x`` ``(..., d_in)`` -> ``(..., d_out)``: ``W x + b + s B A Drop(x)``, every part's adapter at once (the
        ``A`` stacked, the ``B`` placed block-diagonally on their rows)."""
        y = self.base(x)  # (..., d_out): W x + b
        z = F.linear(self.dropout(x), self.stacked_A()) * self.scale  # (..., n r): s A Drop(x), every part's
        return y + F.linear(z, self.placed_B())  # (..., d_out)

    def stacked_A(self) -> Tensor:
        """The parts' ``A`` one above the other: ``(n r, d_in)``."""
        names = list(self.parts)
        return torch.cat([self.lora_A[n] for n in names]) if len(names) > 1 else self.lora_A[names[0]]

    def placed_B(self) -> Tensor:
        """The parts' ``B`` on their rows, block-diagonally (zero rows where no part is): ``(d_out, n r)``."""
        out = self.base.out_features
        if len(self.parts) == 1 and next(iter(self.parts.values())) == (0, out):
            return next(iter(self.lora_B.values()))  # one adapter on every row
        return place_rows([self.lora_B[n] for n in self.parts], list(self.parts.values()), out)

    def delta_weight(self) -> Tensor:
        """``(alpha / r) B A`` on each part's rows, zero elsewhere: ``(d_out, d_in)``."""
        return (self.placed_B() @ self.stacked_A()) * self.scale  # (d_out, n r) @ (n r, d_in)

    def merged(self) -> nn.Linear:
        """The base layer with ``W + (alpha / r) B A`` as its weight (in place: this module's base is changed)."""
        with torch.no_grad():
            self.base.weight += self.delta_weight().to(self.base.weight.dtype)
        return self.base


def place_rows(blocks: list[Tensor], rows: list[tuple[int, int]], d_out: int) -> Tensor:
    """Matrices ``blocks`` ``(b - a, c_i)`` on the row blocks ``rows`` ``[a, b)`` (in order, apart) of a
    ``(d_out, sum c_i)`` matrix, block-diagonally, zero elsewhere: ``B`` of several adapters side by side."""
    placed, row = [], 0
    for block, (a, b) in zip(blocks, rows, strict=True):
        if a > row:
            placed.append(block.new_zeros(a - row, 0))  # rows no block is on
        placed.append(block)
        row = b
    if row < d_out:
        placed.append(blocks[-1].new_zeros(d_out - row, 0))
    return torch.block_diag(*placed)


def _adapted_layers(block: Block, targets: list[str]) -> dict[str, tuple[nn.Linear, dict[str, tuple[int, int]]]]:
    """``{attribute path in the block: (its linear layer, {target: rows})}`` for ``targets``.

    :raises ValueError: ``w3`` on a block without a gated FFN.
    """
    attn, ff = block.self_attn, block.ff
    H, Hkv, dk, dv = attn.n_heads, attn.n_kv_heads, attn.d_k, attn.d_v
    qkv = {"q": (0, H * dk), "k": (H * dk, (H + Hkv) * dk), "v": ((H + Hkv) * dk, (H + Hkv) * dk + Hkv * dv)}
    layers: dict[str, tuple[nn.Linear, dict[str, tuple[int, int]]]] = {}
    fused = {t: rows for t, rows in qkv.items() if t in targets}
    if fused:
        layers["self_attn.in_proj"] = (attn.in_proj, fused)
    plain = {"o": ("self_attn.out_proj", attn.out_proj), "w1": ("ff.w1", ff.w1), "w3": ("ff.w3", ff.w3),
             "w2": ("ff.w2", ff.w2)}
    for target in targets:
        if target in plain:
            path, layer = plain[target]
            if layer is None:
                raise ValueError(f"target {target} is the gated FFN's up projection (activation: swiglu); this model "
                                 f"has none: adapt w1 and w2")
            layers[path] = (layer, {target: (0, layer.out_features)})
    return layers


def apply_lora(model: nn.Module, cfg: LoRAConfig) -> nn.Module:
    """Freeze every parameter of ``model`` and put a :class:`LoRALinear` in place of each targeted projection of its
    :class:`~attnkit.lm.Block` s, in place -> ``model``. Its output is unchanged until the adapters train (B = 0).

    :raises ValueError: ``model`` has no blocks, or already has adapters, or a target it lacks (``w3``).
    """
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    if not blocks:
        raise ValueError(f"apply_lora adapts the blocks of a language model; {type(model).__name__} has none")
    if is_adapted(model):
        raise ValueError("the model already has LoRA adapters: merge them (merge_lora) before adding others")
    model.requires_grad_(False)
    for block in blocks:
        targets = cfg.expanded(gated=block.ff.w3 is not None)
        for path, (layer, parts) in _adapted_layers(block, targets).items():
            parent_path, _, name = path.rpartition(".")
            setattr(block.get_submodule(parent_path), name, LoRALinear(layer, parts, cfg.rank, cfg.alpha, cfg.dropout))
    return model


def is_adapted(model: nn.Module) -> bool:
    """Whether ``model`` holds LoRA adapters (:class:`LoRALinear` layers)."""
    return any(isinstance(m, LoRALinear) for m in model.modules())


def lora_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The adapters of ``model`` alone, under their names in ``model.state_dict()``
    (``layers.0.self_attn.in_proj.lora_A.q``): what an adapted run's checkpoint holds."""
    return {k: v for k, v in model.state_dict().items() if ".lora_A." in k or ".lora_B." in k}


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its layer, ``W <- W + (alpha / r) B A``, and put the plain ``nn.Linear`` back, in place
    -> ``model``, which then computes what the adapted model computed (without dropout) at no extra cost. Its
    parameter names are the base model's again, and every parameter trains again (:func:`apply_lora` froze them)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, LoRALinear):
                setattr(parent, name, child.merged())
    return model.requires_grad_(True)
