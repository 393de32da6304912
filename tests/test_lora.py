"""LoRA fine-tuning (attnkit.lora, model.lora): adapters beside a frozen base, trained, resumed, loaded merged,
served, and exported to PEFT; conversations as data, with the loss on the assistant's tokens only.

* The textbook: an adapter starts as its base (B = 0) and computes ``W x + (alpha / r) B A x`` on its rows (the
  fused ``[W^Q; W^K; W^V]`` one block per target), merged or not; only the adapters get gradients; the engine's
  eager classes and fused loss train an adapted model as the reference does.
* Conversations: the scored tokens spell exactly the assistant's text; changing a masked position's target or
  logit changes neither the loss nor any gradient.
* Runs: checkpoints hold the adapters only; resume is exact; ``generate`` (reference, eager, compiled), ``chat``,
  ``evaluate`` and ``serve`` run the base with the adapters merged; a moved or changed base, and bad configs, are
  one-line errors.
* PEFT: on tiny Llama and GPT-2 checkpoints (tests/hf_models.py), ``peft.PeftModel.from_pretrained(original,
  export)`` computes the adapted run's logits, and so does the merged export in transformers.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from attnkit.cli import main
from attnkit.common.errors import UserError
from attnkit.config.loader import load_config
from attnkit.config.schema import RunConfig
from attnkit.data.chat_template import ChatTemplate
from attnkit.engine import Engine, FusedLMLoss, to_eager
from attnkit.engine.lora import EagerLoRALinear
from attnkit.engine.quantize import quantize_int8
from attnkit.inference.conversations import conversation_messages, encode_conversation
from attnkit.lm import LanguageModel, LMConfig
from attnkit.lora import LoRAConfig, LoRALinear, apply_lora, lora_state_dict, merge_lora
from attnkit.runs.checkpoint import load_weights
from attnkit.sampling import generate
from attnkit.tasks import build_model, load_run
from attnkit.tasks.objectives import LanguageModelLoss
from test_lm_task import assert_one_line_error, cli, corpus, lm_config, prepared, train_lm
from test_train import assert_same_checkpoint
from tiny_runs import write_yaml

#: A play's layout as a chat template (tests/test_chat.py's): the user is ROMEO, the assistant JULIET.
PLAY = ("{% for m in messages %}{{ 'ROMEO' if m['role'] == 'user' else 'JULIET' }}:\n{{ m['content'] }}\n"
        "{% endfor %}{% if add_generation_prompt %}JULIET:\n{% endif %}")
LORA = {"rank": 4, "alpha": 8.0, "targets": ["attention", "feed_forward"]}


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def tiny_lm(**options) -> LanguageModel:
    torch.manual_seed(0)
    cfg = LMConfig(d_model=32, n_heads=4, d_ff=48, decoder_layers=2, dropout=0.0, max_len=32, **options)
    return LanguageModel(cfg, 40)


def random_adapters(model: nn.Module, scale: float = 0.1) -> None:
    """Every adapter's B away from zero, so that the adapters change the output."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)


# -- the textbook --------------------------------------------------------------------------------------------


LLAMA_LIKE = {"positions": "rope", "norm": "rmsnorm", "activation": "swiglu", "bias": False, "n_kv_heads": 2}


@pytest.mark.parametrize("options", [{}, LLAMA_LIKE], ids=["gpt", "llama-gqa"])
@pytest.mark.parametrize("targets", [["q", "v"], ["k"], ["attention", "feed_forward"]])
def test_an_adapted_model_starts_as_its_base_and_merges_to_w_plus_scaled_b_a(options, targets):
    model = tiny_lm(**options)
    x = torch.randint(4, 40, (2, 9))
    with torch.no_grad():
        before = model(x)
        reference = {k: v.clone() for k, v in model.state_dict().items()}
        apply_lora(model, LoRAConfig(rank=3, alpha=6.0, targets=targets))
        torch.testing.assert_close(model(x), before, atol=0, rtol=0)  # B = 0: exactly the base
        random_adapters(model, scale=1.0)
        adapted = model(x)
        assert (adapted - before).abs().max() > 1e-3
        # W + (alpha / r) B A on each target's rows, by hand
        H, Hkv, dk = 4, options.get("n_kv_heads", 4), 8
        rows = {"q": (0, H * dk), "k": (H * dk, (H + Hkv) * dk), "v": ((H + Hkv) * dk, (H + 2 * Hkv) * dk)}
        expected = dict(reference)
        for name, m in model.named_modules():
            if isinstance(m, LoRALinear):
                key = f"{name}.weight"
                w = expected[key].clone()
                for t in m.parts:
                    a, b = rows.get(t, (0, w.size(0)))
                    w[a:b] += 2.0 * m.lora_B[t] @ m.lora_A[t]
                expected[key] = w
        merge_lora(model)
        assert model.state_dict().keys() == reference.keys()
        for key, value in model.state_dict().items():
            torch.testing.assert_close(value, expected[key], atol=1e-6, rtol=0)
        torch.testing.assert_close(model(x), adapted, atol=1e-4, rtol=1e-5)
    assert all(p.requires_grad for p in model.parameters())


def test_only_the_adapters_get_gradients():
    model = apply_lora(tiny_lm(), LoRAConfig(rank=2, targets=["q", "v", "o", "w2"]))
    random_adapters(model)
    x = torch.randint(4, 40, (2, 9))
    LanguageModelLoss(model)(x[:, :-1], x[:, 1:]).backward()
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained == set(lora_state_dict(model)) and len(trained) == 2 * 2 * 4  # A and B, 4 targets, 2 layers
    assert all(p.grad is None for n, p in model.named_parameters() if n not in trained)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if n in trained)


@pytest.mark.parametrize("scored", [False, True], ids=["every-position", "scored"])
def test_the_engine_trains_an_adapted_model_as_the_reference_does(scored):
    x = torch.randint(4, 40, (3, 12))
    mask = torch.rand(3, 11, generator=torch.Generator().manual_seed(2)) < 0.5 if scored else None
    results = []
    for engine in ("reference", "eager"):
        model = apply_lora(tiny_lm(**LLAMA_LIKE), LoRAConfig(rank=2, targets=["attention", "feed_forward"]))
        random_adapters(model)
        objective = LanguageModelLoss(model) if engine == "reference" else FusedLMLoss(to_eager(model))
        loss = objective(x[:, :-1], x[:, 1:], 0.1, mask)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    (ref_loss, ref_grads), (loss, grads) = results
    torch.testing.assert_close(loss, ref_loss, atol=1e-4, rtol=1e-5)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dropout", [0.0, 0.25])
@pytest.mark.parametrize("targets", [["q", "v"], ["attention", "feed_forward"]])
def test_the_engine_lora_layer_equals_the_modules_it_replaces(dropout, targets):
    """EagerLoRALinear (one autograd node) against LoRALinear's modules with the engine's ByteDropout: with one seed
    they drop the same inputs, so loss and every adapter's gradient agree; the frozen base gets no gradient."""
    x = torch.randint(4, 40, (3, 12))
    results = []
    for fused in (False, True):
        model = to_eager(apply_lora(tiny_lm(**LLAMA_LIKE), LoRAConfig(rank=2, dropout=dropout, targets=targets)))
        random_adapters(model)
        layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
        assert all(type(m) is EagerLoRALinear for m in layers)
        if not fused:  # the reference's modules, the engine's dropout
            for m in layers:
                m.__class__ = LoRALinear
        model.train()
        torch.manual_seed(3)
        loss = FusedLMLoss(model)(x[:, :-1], x[:, 1:], 0.1)
        loss.backward()
        assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    (ref_loss, ref_grads), (loss, grads) = results
    torch.testing.assert_close(loss, ref_loss, atol=1e-4, rtol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-4)


def test_the_engine_lora_layer_keeps_the_gradient_of_a_base_that_trains():
    layer = LoRALinear(nn.Linear(6, 5), {"all": (0, 5)}, rank=2, alpha=4.0)
    random_adapters(layer)
    layer.base.requires_grad_(True)
    x = torch.randn(4, 6)
    layer(x).square().sum().backward()
    expected = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    layer.__class__ = EagerLoRALinear
    layer(x).square().sum().backward()
    for name, p in layer.named_parameters():
        torch.testing.assert_close(p.grad, expected[name])


@pytest.mark.parametrize("lora, needle", [
    ({"rank": 0}, "rank must be at least 1"), ({"targets": ["q", "gate"]}, "targets ['gate']"),
    ({"alpha": 0}, "alpha must be a positive"), ({"dropout": 1.0}, "dropout must be in [0, 1)"),
    ({"targets": []}, "targets []")])
def test_bad_lora_settings_are_one_line_errors(tmp_path, lora, needle):
    raw = lm_config(tmp_path / "train.txt")
    raw["model"]["lora"] = lora
    with pytest.raises(UserError) as error:
        load_config(RunConfig, raw)
    assert "model.lora" in str(error.value) and needle in str(error.value) and "\n" not in str(error.value)


# -- conversations ------------------------------------------------------------------------------------------


class Perturbed(nn.Module):
    """``model`` whose logits (and, for the fused loss, hidden states) are moved at the positions ``where`` marks."""

    def __init__(self, model: LanguageModel, where: torch.Tensor) -> None:
        super().__init__()
        self.model, self.where = model, where

    def _moved(self, t: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(t.shape, generator=torch.Generator().manual_seed(5)) * 10
        return t + noise * self.where[..., None]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._moved(self.model(tokens))

    def features(self, tokens: torch.Tensor):
        hidden, weights, state = self.model.features(tokens)
        return self._moved(hidden), weights, state

    @property
    def output_layer(self) -> nn.Linear:
        return self.model.output_layer


@pytest.mark.parametrize("loss_of", [LanguageModelLoss, FusedLMLoss], ids=["reference", "fused"])
def test_masked_positions_contribute_nothing(loss_of):
    """The loss over the scored positions, and every gradient, stay the same when the targets and the logits of
    the other positions change."""
    model = apply_lora(tiny_lm(), LoRAConfig(rank=2, targets=["attention"]))
    random_adapters(model)
    x = torch.randint(4, 40, (3, 12))
    inputs, targets = x[:, :-1], x[:, 1:]
    scored = torch.rand(3, 11, generator=torch.Generator().manual_seed(3)) < 0.4
    other_targets = torch.where(scored, targets, (targets + 7) % 40)

    def loss_and_grads(objective: nn.Module, t: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        loss = objective(inputs, t, 0.0, scored)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]

    loss, grads = loss_and_grads(loss_of(model), targets)
    with torch.no_grad():
        by_hand = F.cross_entropy(model(inputs).flatten(0, 1), torch.where(scored, targets, -100).flatten(),
                                  ignore_index=-100, reduction="sum")
    torch.testing.assert_close(loss, by_hand, atol=1e-4, rtol=1e-5)
    for changed in (loss_and_grads(loss_of(model), other_targets),
                    loss_and_grads(loss_of(Perturbed(model, ~scored)), targets)):
        torch.testing.assert_close(changed[0], loss, atol=1e-5, rtol=0)
        for a, b in zip(changed[1], grads, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    moved, _ = loss_and_grads(loss_of(Perturbed(model, scored)), targets)  # the scored positions do count
    assert abs(moved - loss) > 1.0


def conversation(i: int, turns: int = 2) -> dict:
    words = corpus(4 * turns, seed=i).split("\n")
    messages = []
    for k in range(turns):
        messages += [{"role": "user", "content": words[2 * k + 1] or "come away"},
                     {"role": "assistant", "content": words[2 * k + 2] or "good night"}]
    return {"messages": messages}


def test_the_scored_tokens_are_the_assistant_text(base_run):
    run = load_run(base_run)
    template = ChatTemplate(PLAY, "test")
    chat = conversation(3, turns=3)
    c = encode_conversation(template, run.tok, conversation_messages(json.dumps(chat), "x:1"), "x:1", 10_000)
    assert len(c.ids) == len(c.scored) and sum(c.scored) < len(c.ids)
    spans, current = [], []
    for i, scored in zip(c.ids, c.scored, strict=True):
        if scored:
            current.append(i)
        elif current:
            spans.append(current)
            current = []
    spans += [current] if current else []
    assert run.tok.decode_src(spans) == [m["content"] + "\n" for m in chat["messages"] if m["role"] == "assistant"]
    assert run.tok.decode_src([c.ids])[0] == template.render(chat["messages"], add_generation_prompt=False)
    assert encode_conversation(template, run.tok, chat["messages"], "x:1", 12).ids == c.ids[:12]


def test_a_template_that_writes_earlier_turns_otherwise_is_an_error(base_run):
    run = load_run(base_run)
    last_only = "{% for m in messages %}{% if loop.last %}{{ m['content'] }}{% endif %}{% endfor %}"
    with pytest.raises(UserError, match="x:7: the chat template writes the conversation up to message 2"):
        encode_conversation(ChatTemplate(last_only, "t"), run.tok, conversation(1)["messages"], "x:7", 100)


@pytest.mark.parametrize("line, needle", [
    ("{not json", "not a JSON object"), ('{"text": "hello"}', 'expected {"messages": [...]}'),
    ('{"messages": [{"role": "user"}]}', "message 1 is"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant message")])
def test_a_bad_conversation_line_is_a_one_line_error_naming_file_and_line(base_run, tmp_path, capsys, line, needle):
    lines = [json.dumps(conversation(i)) for i in range(6)]
    lines.insert(3, line)
    (tmp_path / "chats.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    config = write_yaml(tmp_path / "chat.yaml", chat_config(tmp_path / "chats.jsonl", base_run))
    code, _, err = cli(capsys, "train", config, "--run-dir", tmp_path / "run")
    assert_one_line_error(code, err, f"{tmp_path / 'chats.jsonl'}:4:", needle)


# -- adapted runs -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    """A tiny character model with a chat template (the play's), trained a little."""
    tmp = tmp_path_factory.mktemp("lora-base")
    (tmp / "train.txt").write_text(corpus(200), encoding="utf-8")
    train_lm(lm_config(tmp / "train.txt", chat_template=PLAY, end_of_turn=["\n"],
                       train_options={"max_updates": 30, "valid_every": 30, "lr": 1e-2}), tmp / "base")
    return tmp / "base"


def lora_config(train: Path, base: Path, **lora) -> dict:
    raw = lm_config(train, train_options={"max_updates": 6, "valid_every": 3, "lr": 1e-2})
    raw["model"].update(init_from=str(base), lora={**LORA, **lora})
    return raw


def chat_config(chats: Path, base: Path, **lora) -> dict:
    raw = lora_config(chats, base, **lora)
    raw["data"].update(documents="chat", valid_fraction=0.25, block_size=40)
    raw["model"]["transformer"]["max_len"] = 48
    return raw


@pytest.fixture(scope="module")
def lora_run(base_run, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("lora")
    (tmp / "train.txt").write_text(corpus(150, seed=9), encoding="utf-8")
    train_lm(lora_config(tmp / "train.txt", base_run, dropout=0.1), tmp / "run")
    return tmp / "run"


def unmerged(run_dir: Path) -> nn.Module:
    """The adapted run by hand: its base's weights, adapters applied and loaded, not merged."""
    cfg = load_config(RunConfig, run_dir / "config.yaml")
    base = load_run(cfg.model.init_from)
    model = build_model(cfg, base.tok)
    model.load_state_dict(base.model.state_dict())
    apply_lora(model, cfg.model.lora)
    state, _ = load_weights(run_dir / "checkpoints" / "step-00000006" / "model.safetensors")
    model.load_state_dict(state, strict=False)
    return model.eval()


def test_checkpoints_hold_the_adapters_only_and_the_base_stays_as_it_was(lora_run, base_run):
    base_before = load_file(str(base_run / "best.safetensors"))
    for step in (3, 6):
        saved = load_file(str(lora_run / "checkpoints" / f"step-{step:08d}" / "model.safetensors"))
        assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved)
        assert len(saved) == 2 * 2 * (3 + 1 + 2)  # A and B; 2 layers; q, k, v, o, w1, w2
    assert set(load_file(str(lora_run / "best.safetensors"))) == set(saved)
    record = json.loads((lora_run / "lora-base.json").read_text())
    assert Path(record["weights"]) == (base_run / "best.safetensors").resolve()
    base, adapted = load_run(base_run), load_run(lora_run)
    assert all(torch.equal(v, base_before[k]) for k, v in base.model.state_dict().items() if k in base_before)
    changed = {k for k, v in adapted.model.state_dict().items() if not torch.equal(v, base.model.state_dict()[k])}
    assert changed == {f"layers.{i}.{m}.weight" for i in range(2)
                       for m in ("self_attn.in_proj", "self_attn.out_proj", "ff.w1", "ff.w2")}
    assert adapted.cfg.data.chat_template == PLAY and adapted.cfg.data.end_of_turn == ["\n"]  # speaks as its base


@pytest.mark.parametrize("mode", ["reference", "eager"])
def test_the_loaded_run_is_its_base_with_the_adapters_merged(lora_run, mode):
    x = torch.tensor([load_run(lora_run).tok.encode_src(["ROMEO:\nmy lord and sweet night"])[0]])
    with torch.no_grad():
        expected = unmerged(lora_run)(x)
        got = load_run(lora_run, engine=Engine(mode)).model(x)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_resume_is_bitwise_identical(base_run, tmp_path, capsys):
    (tmp_path / "train.txt").write_text(corpus(150, seed=9), encoding="utf-8")
    config = write_yaml(tmp_path / "lora.yaml", lora_config(tmp_path / "train.txt", base_run, dropout=0.1))
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(["train", str(config), "--run-dir", str(straight)]) == 0
    assert main(["train", str(config), "--run-dir", str(resumed), "train.max_updates=3"]) == 0
    assert main(["train", str(config), "--run-dir", str(resumed), "--resume", "train.max_updates=6"]) == 0
    capsys.readouterr()
    assert_same_checkpoint(straight, resumed, 6)


def greedy(run_dir: Path, prompt: str, n: int, int8: bool = False) -> str:
    """The adapted run's greedy continuation, by the reference path (or its int8 copy)."""
    run = load_run(run_dir, engine=Engine("reference"))
    ids = run.tok.encode_src([prompt])[0]
    model = quantize_int8(run.model) if int8 else run.model
    tokens = [int(t[0]) for t in generate(model, [ids], n, temperature=0)]
    return run.tok.decode_src([tokens])[0]


@pytest.mark.parametrize("mode", ["reference", "eager", "compiled", "int8"])
def test_generate_decodes_the_adapted_model_in_every_engine_mode(lora_run, capsys, mode):
    """The merged model's greedy text, computed by hand (int8: by the merged model's int8 copy)."""
    torch._dynamo.reset()
    prompt = "ROMEO:\n"
    engine = ["--engine", "eager", "--quantize", "int8"] if mode == "int8" else ["--engine", mode]
    code, out, err = cli(capsys, "generate", lora_run, "--prompt", prompt, "--max-new-tokens", "20", "--temperature",
                         "0", "--no-echo", *engine)
    assert code == 0, err
    assert out == greedy(lora_run, prompt, 20, int8=mode == "int8") + "\n"


def test_chat_evaluate_and_serve_an_adapted_run(lora_run, base_run, tmp_path, capsys):
    code, out, err = cli(capsys, "chat", lora_run, "--once", "my lord", "--temperature", "0", "--max-new-tokens",
                         "15")
    assert code == 0, err
    expected = greedy(lora_run, "ROMEO:\nmy lord\nJULIET:\n", 15).split("\n")[0]
    assert out == expected + "\n"
    (tmp_path / "held.txt").write_text(corpus(20, seed=4), encoding="utf-8")
    scores = {}
    for run in (lora_run, base_run):
        code, out, err = cli(capsys, "evaluate", run, "--data", tmp_path / "held.txt")
        assert code == 0 and out.startswith("loss "), err
        scores[run] = out
    assert scores[lora_run] != scores[base_run]

    from attnkit.serve.app import create_app
    from attnkit.serve.batching import Limits
    from attnkit.serve.servables import RunServable
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Using `httpx` with `starlette.testclient` is deprecated")
        from fastapi.testclient import TestClient
    servable = RunServable(load_run(lora_run), "lora")
    with TestClient(create_app([servable], Limits(max_wait_ms=0, max_new_tokens=20, max_chars=100))) as client:
        answer = client.post("/generate", json={"prompt": "ROMEO:\n", "max_new_tokens": 20, "temperature": 0.0})
    assert answer.status_code == 200, answer.text
    assert answer.json()["text"] == greedy(lora_run, "ROMEO:\n", 20)


def test_a_moved_or_changed_base_is_a_one_line_error(lora_run, tmp_path, capsys):
    adapted = tmp_path / "adapted"
    shutil.copytree(lora_run, adapted)
    record = json.loads((adapted / "lora-base.json").read_text())
    base = Path(record["weights"])
    moved = tmp_path / "moved"
    shutil.copytree(base.parent, moved, copy_function=shutil.copyfile)  # new modification times
    record["weights"] = str(moved / base.name)
    (adapted / "lora-base.json").write_text(json.dumps(record))
    code, out, err = cli(capsys, "generate", adapted, "--prompt", "ROMEO:", "--max-new-tokens", "3")
    assert code == 0, err  # a copy with the same content, though its time differs: the sha256 says it is the base
    shutil.rmtree(moved)
    code, _, err = cli(capsys, "generate", adapted, "--prompt", "ROMEO:")
    assert_one_line_error(code, err, str(moved / base.name), "is gone")
    shutil.copytree(base.parent, moved)
    weights = load_file(str(moved / base.name))
    from safetensors.torch import save_file
    save_file({k: v + 0.01 if k == "final_norm.weight" else v for k, v in weights.items()}, str(moved / base.name))
    code, _, err = cli(capsys, "generate", adapted, "--prompt", "ROMEO:")
    assert_one_line_error(code, err, str(moved / base.name), "has changed since the adapters were trained")


@pytest.mark.parametrize("change, needle", [
    ({"model.init_from": None}, "model.lora adapts the weights of another run: set model.init_from"),
    ({"model.lora.targets": ["w3"]}, "w3 is the gated FFN's up projection"),
    ({"task": "classify", "data.max_len": 30}, "model.lora adapts a language model"),
    ({"model.init_from": "nowhere"}, "model.init_from: nowhere does not exist")])
def test_bad_lora_runs_are_one_line_errors(base_run, tmp_path, capsys, change, needle):
    (tmp_path / "train.txt").write_text(corpus(50), encoding="utf-8")
    raw = lora_config(tmp_path / "train.txt", base_run)
    for key, value in change.items():
        *path, last = key.split(".")
        node = raw
        for part in path:
            node = node[part]
        node[last] = value
    code, _, err = cli(capsys, "train", write_yaml(tmp_path / "bad.yaml", raw), "--run-dir", tmp_path / "run")
    assert_one_line_error(code, err, needle)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_conversations_train_on_the_assistant_tokens(base_run, tmp_path, capsys):
    lines = [json.dumps(conversation(i, turns=1 + i % 3)) for i in range(24)]
    (tmp_path / "chats.jsonl").write_text("\n".join(lines) + "\n\n", encoding="utf-8")
    raw = chat_config(tmp_path / "chats.jsonl", base_run, targets=["q", "v"])
    task = prepared(raw, tmp_path / "scratch")
    batch = task.collate(task.batches(0)[0], torch.device("cpu"))
    assert batch.n_targets == int(batch.scored.sum()) and 0 < batch.n_targets < batch.targets.numel()
    spoken = task.tok.decode_src([batch.targets[r][batch.scored[r]].tolist() for r in range(len(batch.targets))])
    assistant = {m["content"] + "\n" for line in lines for m in json.loads(line)["messages"]
                 if m["role"] == "assistant"}
    for text in spoken:  # each row's scored targets: its assistant turns, one after another (the last maybe cut)
        rest = text
        while rest:
            match = next((a for a in assistant if rest.startswith(a) or a.startswith(rest)), None)
            assert match is not None, (text, rest)
            rest = rest[len(match):]
    config = write_yaml(tmp_path / "chat.yaml", raw)
    assert main(["train", str(config), "--run-dir", str(tmp_path / "run")]) == 0
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert metrics and all(set(m) >= {"valid_loss", "valid_ppl"} for m in metrics)
    capsys.readouterr()
    code, out, err = cli(capsys, "evaluate", tmp_path / "run", "--data", tmp_path / "chats.jsonl")
    assert code == 0 and out.startswith("loss "), err


# -- PEFT ---------------------------------------------------------------------------------------------------

#: A chat layout for the GPT-2 checkpoint, which ships none: its one special piece ends each turn.
TURNS = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|endoftext|>{% endfor %}"
         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
PEFT_PROMPT = "The quick brown fox, 12 May"


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def peft_export(request, tmp_path_factory) -> tuple[Path, Path, Path]:
    """``(Hugging Face directory, adapted run, its exports)``: a tiny checkpoint imported, adapted with LoRA on every
    projection (Llama on text, GPT-2 on conversations), exported as PEFT adapters (``adapters/``) and merged
    (``merged/``)."""
    pytest.importorskip("peft")
    pytest.importorskip("transformers")
    import hf_models

    tmp = tmp_path_factory.mktemp(f"peft-{request.param}")
    hf, base = hf_models.imported(tmp, hf_models.llama_dir if request.param == "llama" else hf_models.gpt2_dir)
    texts = hf_models.causal_texts()
    if request.param == "llama":
        (tmp / "train.txt").write_text(" ".join(texts), encoding="utf-8")
        data = {"train": str(tmp / "train.txt"), "documents": "text", "valid_fraction": 0.1, "block_size": 16}
    else:
        chats = [{"messages": [{"role": "user", "content": texts[2 * i]},
                               {"role": "assistant", "content": texts[2 * i + 1]}]} for i in range(60)]
        (tmp / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats), encoding="utf-8")
        data = {"train": str(tmp / "chats.jsonl"), "documents": "chat", "valid_fraction": 0.1, "block_size": 48,
                "chat_template": TURNS}
    raw = {"task": "lm", "data": data,
           "model": {"init_from": str(base), "transformer": load_run(base).cfg.model.transformer.__dict__,
                     "lora": {"rank": 4, "alpha": 8.0, "dropout": 0.05, "targets": ["attention", "feed_forward"]}},
           "train": {"max_updates": 4, "valid_every": 4, "lr": 1e-2, "warmup": 1, "max_tokens": 128, "threads": 1,
                     "precision": "fp32", "average_last": 0, "progress": False}}
    run = tmp / "adapted"
    assert main(["train", str(write_yaml(tmp / "lora.yaml", raw)), "--run-dir", str(run)]) == 0
    for flags, out in ((["--adapters"], "adapters"), ([], "merged")):
        assert main(["export", str(run), "--to", "huggingface", *flags, "-o", str(tmp / out)]) == 0
    return hf, run, tmp


def adapted_logits(run_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """``(the adapted run's logits of PEFT_PROMPT, in Hugging Face's vocabulary order; its Hugging Face ids)``."""
    from test_interop_lm import columns_of, hf_ids

    run = load_run(run_dir)
    ids = run.tok.encode_src([PEFT_PROMPT])[0]
    with torch.no_grad():
        logits = run.model(torch.tensor([ids]))[..., columns_of(run)]
    return logits, torch.tensor([[hf_ids(run)[i] for i in ids]])


def test_peft_puts_the_exported_adapters_on_the_original_model_with_the_adapted_logits(peft_export):
    import peft
    import transformers

    hf, run, exports = peft_export
    expected, ids = adapted_logits(run)
    original = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    with torch.no_grad():
        before = original(ids).logits
        got = peft.PeftModel.from_pretrained(original, str(exports / "adapters")).eval()(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert (got - before).abs().max() > 1e-3  # the adapters learned something: the test can fail
    config = json.loads((exports / "adapters" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    assert config["base_model_name_or_path"] == str(hf.resolve())


def test_the_merged_export_is_the_adapted_model_in_transformers(peft_export, tmp_path, capsys):
    import transformers

    hf, run, exports = peft_export
    expected, ids = adapted_logits(run)
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(exports / "merged"), dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, expected, atol=1e-4, rtol=1e-4)
    base = load_config(RunConfig, run / "config.yaml").model.init_from
    code, _, err = cli(capsys, "export", base, "--to", "huggingface", "--adapters", "-o", tmp_path / "a")
    assert_one_line_error(code, err, "has no LoRA adapters (model.lora)")
    code, _, err = cli(capsys, "export", run, "--to", "ctranslate2", "--adapters", "-o", tmp_path / "b")
    assert_one_line_error(code, err, "--adapters", "--to huggingface")
