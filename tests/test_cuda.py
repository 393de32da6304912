"""The GPU path (issue 37, item 8): the language model's equality tests again on a CUDA device, and what runs there.

Skipped where torch sees no CUDA GPU (CI has none); run on one with ``pytest tests/test_cuda.py``. What they hold:

* the engine's fused attention equals the textbook ``attend`` there, values and gradients, for every model option
  (RoPE, ALiBi, grouped-query, sliding windows, Llama, Qwen2) and for the kernel alone;
* decoding with the key/value cache equals the full forward there, and the GPU's logits equal the CPU's;
* bfloat16 autocast (what ``precision: auto`` picks on a GPU that has it) stays close to float32;
* imported GPT-2 / Llama / Mistral / Qwen2 models give transformers' logits (1e-4) and greedy tokens on the GPU;
* ``attnkit train`` trains there in bfloat16, and its checkpoint loads on the CPU with the same logits;
* ``attnkit generate --device cuda`` is reproducible for a seed, and its greedy text is the CPU's;
* ``attnkit serve --device cuda`` (the app in process) answers with the text ``attnkit generate`` gives.

Tolerances: 1e-4 where the CPU tests hold 1e-5 (a GPU sums in other orders); TF32 stays off (torch's default).
"""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA GPU: these repeat the equality tests on a GPU (run them on one)")

from attnkit.attention import attend  # noqa: E402
from attnkit.engine import fast_attend  # noqa: E402
from attnkit.sampling import generate  # noqa: E402
from attnkit.tasks import load_run  # noqa: E402
from test_lm_model import (  # noqa: E402
    CONFIGS,
    _kernel_inputs,
    assert_cached_decoding_equals_full,
    both_engines,
    logits_and_grads,
    make_lm,
    random_tokens,
)
from test_lm_task import cli, corpus, lm_config, train_lm  # noqa: E402

GPU = torch.device("cuda")
ATOL = 1e-4


def on_gpu(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model).to(GPU)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_engine_gives_the_textbook_logits_and_gradients_on_the_gpu(name: str) -> None:
    cpu = make_lm(**CONFIGS[name]).train()  # dropout 0: training mode is deterministic
    tokens = random_tokens(3, 10)
    (ref_logits, ref_grads), (fast_logits, fast_grads) = (logits_and_grads(on_gpu(m), tokens.to(GPU))
                                                          for m in both_engines(cpu))
    torch.testing.assert_close(fast_logits, ref_logits, atol=ATOL, rtol=ATOL)
    with torch.no_grad():
        torch.testing.assert_close(ref_logits.cpu(), cpu(tokens), atol=ATOL, rtol=ATOL)  # the GPU gives the CPU's
    for n, grad in ref_grads.items():
        assert grad is not None and grad.abs().sum() > 0, n
        torch.testing.assert_close(fast_grads[n], grad, atol=ATOL, rtol=1e-3, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("engine", ["textbook", "engine"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_cached_decoding_equals_the_full_forward_on_the_gpu(name: str, engine: str) -> None:
    textbook = on_gpu(make_lm(**CONFIGS[name]))
    model = textbook if engine == "textbook" else both_engines(textbook)[1]
    assert_cached_decoding_equals_full(textbook, model, random_tokens(2, 12).to(GPU), ATOL)


@pytest.mark.parametrize("T_q,T_k", [(6, 6), (3, 7), (1, 5)])
@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_fast_attend_equals_attend_on_the_gpu(causal: bool, with_bias: bool, with_mask: bool, n_kv_heads: int,
                                              T_q: int, T_k: int) -> None:
    inputs = [None if x is None else x.to(GPU) for x in _kernel_inputs(n_kv_heads, T_q, T_k, with_bias, with_mask)]
    outputs = []
    for kernel in (attend, fast_attend):
        q, k, v, bias, mask = (None if x is None else x.clone().requires_grad_(x.is_floating_point())
                               for x in inputs)
        context, _ = kernel(q, k, v, mask, bias=bias, causal=causal, need_weights=False)
        (context * torch.linspace(-1, 1, context.numel(), device=GPU).view_as(context)).sum().backward()
        outputs.append((context.detach(), [x.grad for x in (q, k, v, bias) if x is not None]))
    (ref, ref_grads), (fast, fast_grads) = outputs
    assert not torch.isnan(fast).any()
    torch.testing.assert_close(fast, ref, atol=ATOL, rtol=ATOL)
    for a, b in zip(fast_grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=ATOL)
    if with_mask:  # the row with nothing to attend to: zeros, not NaN
        assert torch.equal(fast[1, :, 0], torch.zeros_like(fast[1, :, 0]))


@pytest.mark.parametrize("name", ["rope", "alibi-window4-gqa2", "llama", "learned"])
def test_bf16_autocast_on_the_gpu_stays_close_to_float32(name: str) -> None:
    model = both_engines(on_gpu(make_lm(**CONFIGS[name])))[1]
    tokens = random_tokens(2, 16).to(GPU)
    with torch.no_grad():
        exact = model(tokens)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            low = model(tokens).float()
    assert (low - exact).abs().max() < 0.05 * exact.abs().max()
    assert (low.argmax(-1) == exact.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("spread", [0.3, 60.0])  # 60: logit gaps of hundreds, most targets' p_y underflows
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_fused_loss_on_the_gpu_equals_linear_then_cross_entropy(spread: float, eps: float) -> None:
    """One chunk and no wait for the GPU there (engine/loss.py), yet the same loss and gradients."""
    import torch.nn.functional as F

    from attnkit.engine.loss import linear_cross_entropy
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(300, 16, generator=g).to(GPU).requires_grad_()
    weight = (spread * torch.randn(50, 16, generator=g)).to(GPU).requires_grad_()
    targets = torch.randint(0, 50, (300,), generator=g).to(GPU)
    ours = linear_cross_entropy(hidden, weight, None, targets, label_smoothing=eps)
    ours.backward()
    got = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    ref = F.cross_entropy(F.linear(hidden, weight), targets, label_smoothing=eps, reduction="sum")
    ref.backward()
    if spread > 1:
        assert torch.softmax(F.linear(hidden, weight), -1).gather(1, targets[:, None]).min() == 0
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=ATOL)
    tol = ATOL if spread < 1 else 1e-3  # logits of +-1000: float32 rounding in the gradients is ~1e-4 of them
    for ours_grad, ref_grad in zip(got, (hidden.grad, weight.grad), strict=True):
        torch.testing.assert_close(ours_grad, ref_grad, rtol=tol, atol=tol * ref_grad.abs().max().item())


# -- Hugging Face models on the GPU -------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["gpt2", "llama", "mistral", "qwen2-window"])
def imported(request, tmp_path_factory) -> tuple[Path, Path]:
    pytest.importorskip("transformers")
    import hf_models
    from test_interop_lm import FAMILIES
    return hf_models.imported(tmp_path_factory.mktemp(request.param), FAMILIES[request.param])


def test_imported_models_give_transformers_logits_and_greedy_tokens_on_the_gpu(imported) -> None:
    from attnkit.vocab import BOS_ID, EOS_ID, PAD_ID, UNK_ID
    from test_interop_lm import PROMPTS, TEXTS, columns_of, hf_ids, hf_model
    hf, run_dir = imported
    run, reference = load_run(run_dir, GPU), hf_model(hf).to(GPU)
    to_hf = hf_ids(run)
    columns = columns_of(run)  # HF id -> attnkit column
    for text in TEXTS[:12]:
        ids = run.tok.encode_src([text])[0][:60]
        if not ids:
            continue
        with torch.no_grad():
            expected = reference(torch.tensor([[to_hf[i] for i in ids]], device=GPU)).logits  # (1, T, V_hf)
            got = run.model(torch.tensor([ids], device=GPU))[..., columns]
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=ATOL)
    never = [to_hf[i] for i in (PAD_ID, UNK_ID, BOS_ID) if to_hf[i] is not None]
    for prompt in PROMPTS:
        ids = run.tok.encode_src([prompt])[0]
        got = [to_hf[int(t[0])] for t in generate(run.model, [ids], 20, temperature=0)]
        x = torch.tensor([[to_hf[i] for i in ids]], device=GPU)
        out = reference.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=20,
                                 suppress_tokens=never or None, pad_token_id=to_hf[EOS_ID])
        assert got == out[0, x.size(1):].tolist(), prompt


# -- training, generating and serving on the GPU ------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory) -> Path:
    """A tiny character model trained on the GPU (the trainer takes it when it is there) in bf16 autocast."""
    tmp = tmp_path_factory.mktemp("gpu-lm")
    (tmp / "train.txt").write_text(corpus(200), encoding="utf-8")
    trainer = train_lm(lm_config(tmp / "train.txt", train_options={"max_updates": 60, "valid_every": 30, "lr": 1e-2,
                                                                    "precision": "auto"}), tmp / "play")
    assert trainer.device.type == "cuda" and trainer.bf16 == torch.cuda.is_bf16_supported()
    return tmp / "play"


def test_training_on_the_gpu_learns_and_its_checkpoint_loads_on_the_cpu(gpu_run: Path) -> None:
    metrics = [json.loads(line) for line in (gpu_run / "metrics.jsonl").read_text().splitlines()]
    losses = [m["valid_loss"] for m in metrics if "valid_loss" in m]
    assert len(losses) == 2 and losses[-1] < losses[0] < 4.2  # below log(65 characters) = 4.17: it learned
    cpu, gpu = load_run(gpu_run), load_run(gpu_run, GPU)
    tokens = torch.tensor(cpu.tok.encode_src(["ROMEO:\nthe king shall"]))
    with torch.no_grad():
        torch.testing.assert_close(gpu.model(tokens.to(GPU)).cpu(), cpu.model(tokens), atol=ATOL, rtol=ATOL)


def test_generate_on_the_gpu_is_seeded_and_greedy_equals_the_cpu(gpu_run: Path, capsys) -> None:
    sampled = [cli(capsys, "generate", gpu_run, "--prompt", "ROMEO:", "--seed", "3", "--max-new-tokens", "30",
                   "--device", "cuda") for _ in range(2)]
    assert sampled[0][0] == 0 and sampled[0] == sampled[1]
    greedy = [cli(capsys, "generate", gpu_run, "--prompt", "ROMEO:", "--temperature", "0", "--max-new-tokens", "30",
                  "--device", device) for device in ("cpu", "cuda")]
    assert greedy[0][0] == 0 and greedy[0][1] == greedy[1][1]


def test_serve_on_the_gpu_answers_as_generate_does(gpu_run: Path, capsys) -> None:
    from attnkit.serve.app import create_app
    from attnkit.serve.batching import Limits
    from attnkit.serve.servables import load_servable
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Using `httpx` with `starlette.testclient` is deprecated")
        from fastapi.testclient import TestClient
    code, expected, _ = cli(capsys, "generate", gpu_run, "--prompt", "ROMEO:", "--seed", "5", "--max-new-tokens",
                            "20", "--no-echo", "--device", "cuda")
    servable = load_servable(gpu_run, device=GPU)
    assert next(servable.run.model.parameters()).is_cuda
    body = {"prompt": "ROMEO:", "max_new_tokens": 20, "seed": 5}
    with TestClient(create_app([servable], Limits(max_wait_ms=0))) as client:
        answers = [client.post("/generate", json=body) for _ in range(3)]
        streamed = client.post("/generate", json={**body, "stream": True})
    assert code == 0 and all(a.status_code == 200 for a in answers)
    assert {a.json()["text"] for a in answers} == {expected[:-1]}
    events = [json.loads(c[5:]) for c in streamed.text.split("\n\n") if c.startswith("data:")]
    assert "".join(e["token"] for e in events if "token" in e) == expected[:-1]
