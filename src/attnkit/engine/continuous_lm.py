"""Continuous (iteration-level) sampling from a language model: prompts join and leave a running batch at every step.

:func:`attnkit.sampling.generate` continues a batch of prompts of one length until its last row ends. Here, as
Orca and vLLM serve: :meth:`ContinuousSampler.add` runs a new prompt through the textbook
:meth:`~attnkit.lm.LanguageModel.step` with its own cache (the prefill, exactly what ``generate`` computes first),
chooses its first token, and merges its cache into the running batch; :meth:`ContinuousSampler.step` feeds every
running row its last token at its own position and chooses each row's next one. The rows of one step are at
different positions ``pos`` ``(B,)``, so

* each row's key/value cache is right-aligned: a shorter one is padded on the left, and ``valid`` ``(B, t)``
  masks the padding (a row's query sees only its own keys; the padding gets exactly zero weight);
* a table of positions (learned, sinusoidal) is read at each row's own position, ``x = Embed(y) + PE[pos]``;
* RoPE rotates each row's query and key by its own position (the ``offset`` argument of
  :meth:`~attnkit.multihead.MultiHeadAttention.forward`), so ``q_t . k_s`` sees the row's ``t - s``;
* ALiBi's bias ``-m_h |t - s|`` and the sliding window ``t - s < window`` are functions of a key's distance from
  the query, and right alignment keeps distances: a row's key ``s`` is ``t - s`` columns left of its query.

Each row chooses its token with :func:`attnkit.sampling.choose_next` on its own logits, its own temperature,
top-k, top-p and ``torch.Generator``: a seeded row draws the same numbers whether it runs alone or among others,
so its tokens are ``generate``'s for that seed (``tests/test_continuous_lm.py`` checks greedy and seeded rows
against ``generate``, joining mid-way, for every kind of positions and a window). A row ends at ``</s>`` (which it
reports) or after ``max_new_tokens``, or when :meth:`ContinuousSampler.drop` takes it out (a stop string, a
client gone); its cache rows leave the batch, and the leading columns no row needs any more are cut.

:class:`CompiledContinuousSampler` runs the same rows through a compiled prompt pass and a compiled step
(:mod:`~attnkit.engine.compiled_decoding`), whose static buffers keep each row's keys left-aligned instead: there a
row's column is its position, and the mask is each row's ``s <= pos`` (and window).

A row whose choice fails (its sampling options refused by torch, non-finite logits) ends alone, with a
:class:`Token` that carries the error; the other rows go on. A failing model call fails the rows it computes:
a prefill only its prompts (the running batch is left as it was), a step every running row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from ..lm import LanguageModel, LMState
from ..multihead import KVCache
from ..sampling import choose_next
from ..vocab import EOS_ID, PAD_ID
from .compiled_decoding import CompiledDecoder, StaticKVCache, embed_at
from .continuous import RunningRows

__all__ = ["CompiledContinuousSampler", "ContinuousSampler", "Sampling", "Token"]

#: Why a row ended: it chose ``</s>``, it used its ``max_new_tokens``, or it could not choose (``Token.error``).
FinishReason = Literal["eos", "length", "error"]


@dataclass(frozen=True)
class Sampling:
    """How a row chooses its tokens (:func:`attnkit.sampling.choose_next`): temperature 0 is greedy."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0


#: Greedy decoding: the most probable token at every step.
GREEDY = Sampling(temperature=0.0)


@dataclass(frozen=True)
class Token:
    """A row's token of one step: its handle, the id, and why the row ended with it (None: it goes on); ``error``:
    why it could not choose (finish ``"error"``, the id meaningless)."""

    handle: int
    id: int
    finish: FinishReason | None = None
    error: Exception | None = None


@dataclass
class _Row:
    handle: int
    budget: int  # max_new_tokens
    sampling: Sampling
    generator: torch.Generator | None
    emitted: int = 0  # tokens chosen so far


class ContinuousSampler(RunningRows):
    """Sampling of a changing set of prompts (see the module docstring).

    ``add(prompt, ...)`` -> the prompt's first :class:`Token` (its ``handle`` names the row; ``add_many`` starts
    prompts of one length with one prefill, :meth:`_prefill`); ``step()`` -> a token for every running row
    (:meth:`_forward`); ``drop(handles)`` takes rows out. Not thread-safe: one thread drives it (the server's model
    worker). Runs under ``torch.inference_mode``. :class:`CompiledContinuousSampler` runs the same rows through
    compiled programs.
    """

    def __init__(self, model: LanguageModel) -> None:
        if not isinstance(model, LanguageModel):
            raise TypeError(f"continuous sampling needs a LanguageModel, got {type(model).__name__}")
        self.model = model
        self.cache_type = type(model.init_state().caches[0]) if len(model.layers) else KVCache
        self.window = model.cfg.window
        self._next_handle = 0
        self._reset()

    @property
    def width(self) -> int:
        """Cached positions of the running batch (the longest row's, padding included)."""
        return 0 if self.valid is None else self.valid.size(1)

    def add(self, prompt: list[int], max_new_tokens: int, sampling: Sampling = GREEDY,
            generator: torch.Generator | None = None) -> Token:
        """Start a row: run ``prompt`` (ids, at least one) through the model, choose its first token.

        The row joins the running batch unless that token ends it (``</s>``, or ``max_new_tokens == 1``). The
        caller checks that prompt and continuation fit the model's positions (``prompt_ids``).
        """
        return self.add_many([prompt], [max_new_tokens], [sampling], [generator])[0]

    @torch.inference_mode()
    def add_many(self, prompts: list[list[int]], max_new_tokens: list[int], samplings: list[Sampling],
                 generators: list[torch.Generator | None]) -> list[Token]:
        """:meth:`add` for several prompts of one length at once: one prefill of the batch ``(G, L)`` instead of
        ``G`` prefills (rows do not interact, so each row's logits are its own prefill's), one first token each. An
        exception of the prefill leaves the running batch as it was."""
        if len({len(p) for p in prompts}) != 1 or not prompts[0] or min(max_new_tokens) < 1:
            raise ValueError(f"rows need prompts of one length (at least one id) and max_new_tokens >= 1, got "
                             f"lengths {sorted({len(p) for p in prompts})} and {min(max_new_tokens)}")
        model = self.model
        if model.training:  # eval() walks every module: a tenth of a millisecond per join, on a first token's path
            model.eval()
        device = next(model.parameters()).device
        rows = []
        for budget, sampling, generator in zip(max_new_tokens, samplings, generators, strict=True):
            rows.append(_Row(self._next_handle, budget, sampling, generator))
            self._next_handle += 1
        tokens = torch.tensor(prompts, device=device)  # (G, L)
        logits, state = self._prefill(tokens)  # (G, V)
        tokens = self._choose(rows, logits)
        going = [i for i, token in enumerate(tokens) if token.finish is None]
        if going:
            self._merge(state, going, [rows[i] for i in going], [tokens[i].id for i in going])
        return tokens

    def _prefill(self, tokens: Tensor) -> tuple[Tensor, LMState]:
        """The prompts ``tokens`` ``(G, L)`` from an empty cache: the last position's logits ``(G, V)`` and the state
        (:meth:`~attnkit.lm.LanguageModel.step`)."""
        return self.model.step(tokens, self.model.init_state())

    def _merge(self, state: LMState, index: list[int], rows: list[_Row], tokens: list[int]) -> None:
        """Append fresh rows (rows ``index`` of a prefill's cache ``(G, H_kv, L, d_k)``) to the batch
        (:meth:`~attnkit.engine.continuous.RunningRows._join`: all or nothing)."""
        L, G = state.length, len(rows)
        device = state.caches[0].k.device
        caches = state.caches
        if len(index) < state.caches[0].k.size(0):
            keep = torch.tensor(index, device=device)
            caches = [KVCache(c.k.index_select(0, keep), c.v.index_select(0, keep)) for c in state.caches]
        self._join(caches, torch.ones(G, L, dtype=torch.bool, device=device), torch.tensor(tokens, device=device),
                   torch.full((G,), L, device=device), rows)  # the first new token sits at position L

    @torch.inference_mode()
    def step(self) -> list[Token]:
        """Feed every running row its last token; each row's next token (rows that ended leave the batch)."""
        if not self.rows:
            return []
        B = len(self.rows)
        logits = self._forward()  # (B, V)
        tokens = self._choose(self.rows, logits)
        self.prev = torch.tensor([tk.id for tk in tokens], device=logits.device)
        ended = {i for i, tk in enumerate(tokens) if tk.finish is not None}
        if ended:
            self._keep([i for i in range(B) if i not in ended])
        return tokens

    def _forward(self) -> Tensor:
        """Every running row's last token through the model at its own position: the logits ``(B, V)``; the caches
        and positions move one on."""
        model = self.model
        B, t = len(self.rows), self.width
        x = embed_at(model, self.prev[:, None], self.pos, int(self.pos.max()) + 1)  # (B, 1, d_model)
        keys = torch.cat([self.valid, torch.ones(B, 1, dtype=torch.bool, device=x.device)], dim=1)  # (B, t + 1)
        mask = keys
        if self.window:  # the query (column t) sees the keys less than `window` columns (= positions) back
            mask = mask & (torch.arange(t + 1, device=x.device) > t - self.window)
        mask = mask[:, None, None, :]  # (B, 1, 1, t + 1)
        hidden, _, caches = model.decode_layers(x, mask, self.caches, offset=self.pos)  # (B, 1, d_model)
        self.caches, self.valid, self.pos = caches, keys, self.pos + 1
        return model.out_proj(hidden[:, 0])  # (B, V)

    def _choose(self, rows: list[_Row], logits: Tensor) -> list[Token]:
        """Each row's next token from its logits ``(R, V)``, with its own sampling and generator; a row whose choice
        fails gets a token with the error (it ends; the others do not)."""
        ids = [0] * len(rows)
        errors: dict[int, Exception] = {}
        greedy = [i for i, row in enumerate(rows) if row.sampling.temperature == 0]
        if greedy:
            index = torch.tensor(greedy, device=logits.device)
            ids_greedy = choose_next(logits.index_select(0, index), 0.0).tolist()  # argmax, one call
            for i, token in zip(greedy, ids_greedy, strict=True):
                ids[i] = token
        for i, row in enumerate(rows):
            if row.sampling.temperature != 0:
                s = row.sampling
                try:
                    ids[i] = int(choose_next(logits[i: i + 1], s.temperature, s.top_k, s.top_p, row.generator)[0])
                except Exception as e:  # this row's options or logits: it alone ends
                    errors[i] = e
        tokens = []
        for i, (row, token) in enumerate(zip(rows, ids, strict=True)):
            row.emitted += 1
            if i in errors:
                tokens.append(Token(row.handle, PAD_ID, "error", errors[i]))
                continue
            finish = "eos" if token == EOS_ID else ("length" if row.emitted >= row.budget else None)
            tokens.append(Token(row.handle, token, finish))
        return tokens

    def drop(self, handles: list[int]) -> None:
        """Take the rows ``handles`` out of the batch (unknown handles are ignored: those rows ended already)."""
        gone = set(handles)
        keep = [i for i, row in enumerate(self.rows) if row.handle not in gone]
        if len(keep) < len(self.rows):
            self._keep(keep)

    def _keep(self, keep: list[int]) -> None:
        """Keep only the rows ``keep``; drop the leading key columns no kept row uses."""
        self._select(keep)


class CompiledContinuousSampler(ContinuousSampler):
    """:class:`ContinuousSampler` through a :class:`~attnkit.engine.compiled_decoding.CompiledDecoder`: prompts go
    through its compiled prompt pass, steps through its compiled one-token step (``attnkit serve --engine
    compiled``; with ``--quantize int8`` the decoder's model holds int8 weights).

    The compiled step reads static buffers, so the running rows keep theirs differently: each row's keys sit
    **left-aligned** in buffers ``(B, H_kv, capacity, d)`` (row ``b``'s key of position ``s`` in column ``s``), and
    :func:`~attnkit.engine.compiled_decoding.static_mask` at each row's own ``pos`` hides the columns it has not
    written (beyond its position, or left there by a row that held its slot before), so a row computes what it
    would alone. A joining row's prompt cache is copied into a fresh buffer row; a row that ends is taken out with
    ``index_select``; the capacity doubles when the furthest row reaches it. The step is compiled once for one row
    and once for any number of rows from two (the batch size is a dimension of that program), so rows joining and
    leaving compile nothing new."""

    def __init__(self, decoder: CompiledDecoder) -> None:
        super().__init__(decoder.model)
        self.decoder = decoder

    @property
    def width(self) -> int:
        """Cached positions of the running batch (the furthest row's)."""
        return 0 if self.pos is None else int(self.pos.max())

    def _prefill(self, tokens: Tensor) -> tuple[Tensor, LMState]:
        return self.decoder.prefill(tokens)

    def _merge(self, state: LMState, index: list[int], rows: list[_Row], tokens: list[int]) -> None:
        """Copy rows ``index`` of a prefill's cache ``(G, H_kv, L, d)`` into buffer rows of the running capacity
        (grown to fit, all made before any is kept), appended to the batch."""
        L = state.length
        device = state.caches[0].k.device
        keep = torch.tensor(index, device=device)
        capacity = self.decoder.capacity_for(max(L, self.width) + 1)
        if self.caches:
            capacity = max(capacity, self.caches[0].k.size(2))
        caches = []
        for i, new in enumerate(state.caches):
            fresh = StaticKVCache.of(KVCache(new.k.index_select(0, keep), new.v.index_select(0, keep)), capacity)
            if self.caches:
                own = self.caches[i]
                if own.k.size(2) < capacity:  # the running rows' buffers, widened to the new capacity
                    own = StaticKVCache.of(own, capacity)
                fresh = KVCache(torch.cat([own.k, fresh.k]), torch.cat([own.v, fresh.v]))
            caches.append(KVCache(fresh.k, fresh.v))
        prev = torch.tensor(tokens, device=device)
        pos = torch.full((len(rows),), L, device=device)  # the first new token sits at position L
        if self.rows:
            prev, pos = torch.cat([self.prev, prev]), torch.cat([self.pos, pos])
        self.caches, self.prev, self.pos = caches, prev, pos
        self.rows.extend(rows)

    def _forward(self) -> Tensor:
        caches = [StaticKVCache(c.k, c.v, self.pos) for c in self.caches]
        logits, state = self.decoder.step(self.prev[:, None], LMState(caches, self.width))  # (B, V)
        self.caches = [KVCache(c.k, c.v) for c in state.caches]  # the same buffers, or grown ones
        self.pos = self.pos + 1
        return logits

    def _select(self, keep: list[int]) -> Tensor | None:
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self._reset()
            return None
        index = torch.tensor(keep, dtype=torch.long, device=self.prev.device)
        self.caches = [KVCache(c.k.index_select(0, index), c.v.index_select(0, index)) for c in self.caches]
        self.prev, self.pos = self.prev.index_select(0, index), self.pos.index_select(0, index)
        return index

