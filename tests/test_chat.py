"""Chat templates and ``attnkit chat`` (issue 57), checked against transformers itself.

Templates are written out below as instruct checkpoints ship them (nothing is downloaded): each renders to exactly
the string transformers' ``apply_chat_template`` builds, or fails with the same reason. A tiny Qwen2 directory
(tests/hf_models.py) with a ChatML template, ``<|im_end|>`` listed beside ``<|endoftext|>`` in
``generation_config.json`` and an output row that makes greedy decoding end its turn, is imported: the run keeps
the template and the end of turn, exports them back, and ``attnkit chat`` answers with exactly the greedy
continuation transformers' ``generate`` gives, one question or a conversation read from standard input.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from attnkit.cli import main
from attnkit.common.errors import UserError
from attnkit.config.loader import dump_config, load_config
from attnkit.config.schema import RunConfig
from attnkit.data.chat_template import ChatTemplate, end_of_turn, special_tokens
from attnkit.inference.chat import Chat, encode_rendered, run_template
from attnkit.sampling import generate
from attnkit.tasks import load_run, spec
from attnkit.vocab import EOS_ID

transformers = pytest.importorskip("transformers")
import hf_models  # noqa: E402  (after the skip: it builds models with transformers)
from test_lm_task import assert_one_line_error, cli, corpus, lm_config, train_lm  # noqa: E402

# -- templates as checkpoints ship them ------------------------------------------------------------------------

#: ChatML with a default system message (SmolLM2-Instruct).
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
          "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
#: Qwen2.5-Instruct's layout: whitespace control on every tag, attribute access, tools written with tojson.
QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""  # noqa: E501  (a template's lines as shipped)
#: Llama-2-chat: the system message inside the first [INST], roles that must alternate.
LLAMA2 = ("{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
          "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
          "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
          "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
          "{% if loop.index0 == 0 and system_message != false %}"
          "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
          "{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}"
          "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
          "{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")
#: Llama-3-Instruct: header pieces, trimmed contents, the start token before the first message.
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}"
          "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
          "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
          "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
#: Zephyr: a template over several lines, which trim_blocks and lstrip_blocks lay out.
ZEPHYR = ("{% for message in messages %}\n{% if message['role'] == 'user' %}\n"
          "{{ '<|user|>\n' + message['content'] + eos_token }}\n{% elif message['role'] == 'system' %}\n"
          "{{ '<|system|>\n' + message['content'] + eos_token }}\n{% elif message['role'] == 'assistant' %}\n"
          "{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n{% endif %}\n"
          "{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}")
#: Mistral-7B-Instruct-v0.1: [INST] without a system message (one is an error).
MISTRAL = ("{{ bos_token }}{% for message in messages %}"
           "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
           "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
           "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
           "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token + ' ' }}"
           "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")
#: Gemma-it: <start_of_turn>, the assistant called "model", no system role.
GEMMA = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
         "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
         "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
         "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
         "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
         "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")
#: The helpers templates use: namespace, loop controls, tojson, {% generation %} blocks.
HELPERS = ("{%- set ns = namespace(system='') -%}{%- for m in messages -%}"
           "{%- if m.role == 'system' -%}{%- set ns.system = m.content -%}{%- continue -%}{%- endif -%}"
           "{{- '### ' ~ m.role | capitalize ~ '\n' -}}"
           "{%- if m.role == 'assistant' -%}{% generation %}{{ m.content }}{% endgeneration %}"
           "{%- else -%}{{ m.content | tojson }}{%- endif %}\n\n{% endfor -%}"
           "{%- if ns.system %}{{ 'system: ' ~ (ns.system | tojson) ~ '\n' }}{% endif -%}"
           "{%- if add_generation_prompt %}{{ '### Assistant\n' }}{% endif -%}")
TEMPLATES = {"chatml": CHATML, "qwen2.5": QWEN25, "llama-2": LLAMA2, "llama-3": LLAMA3, "zephyr": ZEPHYR,
             "mistral": MISTRAL, "gemma": GEMMA, "helpers": HELPERS}

SYSTEM = {"role": "system", "content": "You are terse.\nAnswer in one line."}
TURNS = [{"role": "user", "content": "  Hello there!  \n"},
         {"role": "assistant", "content": "Hi — how can I help? {{ not jinja }}"},
         {"role": "user", "content": 'Größe 🙂, "quotes" and <|im_end|> as text'}]
CONVERSATIONS = {"question": TURNS[:1], "turns": TURNS, "system": [SYSTEM, *TURNS]}


@pytest.fixture(scope="module")
def reference_tokenizer(tmp_path_factory):
    """A transformers tokenizer like Llama's (``<s>``, ``</s>``, ``<unk>``), built here."""
    out = tmp_path_factory.mktemp("tokenizer")
    hf_models.llama_tokenizer(out, hf_models.causal_texts(60))
    return transformers.AutoTokenizer.from_pretrained(str(out))


@pytest.mark.parametrize("generation_prompt", [True, False], ids=["generation-prompt", "no-generation-prompt"])
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("name", list(TEMPLATES))
def test_rendering_is_apply_chat_template(reference_tokenizer, name, conversation, generation_prompt):
    template, messages = TEMPLATES[name], CONVERSATIONS[conversation]
    reference_tokenizer.chat_template = template
    ours = ChatTemplate(template, name, reference_tokenizer.special_tokens_map)
    try:
        expected = reference_tokenizer.apply_chat_template(messages, tokenize=False,
                                                           add_generation_prompt=generation_prompt)
    except Exception as e:  # the template's own raise_exception: ours fails with the same reason, in one line
        with pytest.raises(UserError, match="cannot render this conversation") as error:
            ours.render(messages, generation_prompt)
        assert str(e) in str(error.value) and "\n" not in str(error.value)
        assert name in ("mistral", "gemma") and conversation == "system"  # the two that take no system message
        return
    assert ours.render(messages, generation_prompt) == expected


def test_templates_that_cannot_render_are_one_line_errors():
    with pytest.raises(UserError, match=r"^t: the chat template is not valid Jinja: .*line 1") as error:
        ChatTemplate("{% for m in messages %}{{ m.content }}", "t")
    assert "\n" not in str(error.value)
    with pytest.raises(UserError, match="cannot render this conversation: 'str object' has no attribute 'nope'"):
        ChatTemplate("{{ messages[0].content.nope() }}", "t").render(TURNS)
    with pytest.raises(UserError, match="cannot render this conversation: TypeError"):
        ChatTemplate("{{ messages[0].content + 1 }}", "t").render(TURNS)
    with pytest.raises(UserError, match="access to attribute"):  # the sandbox: no way to Python's internals
        ChatTemplate("{{ messages.__class__.__mro__ }}", "t").render(TURNS)
    with pytest.raises(UserError, match="namespace attribute '_x'"):
        ChatTemplate("{% set ns = namespace() %}{% set ns._x = 1 %}", "t").render(TURNS)


# -- an imported instruct model ----------------------------------------------------------------------------------

QUESTION = "12 May"
ANSWER_TOKENS = 24


def instruct_dir(out: Path) -> Path:
    """A tiny Qwen2 directory shaped like an instruct checkpoint: a ChatML template, ``<|im_end|>`` listed beside
    ``<|endoftext|>`` (``config.json``'s end of text) in ``generation_config.json``, and an output row for
    ``<|im_end|>`` a little above that of a token greedy decoding writes a few tokens into its answer to
    :data:`QUESTION`, so that it ends its turn there (and wherever else that token would come first)."""
    hf_models.qwen2_dir(out, tie=False, seed=1)
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    end, eot = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    hf_models.set_chat_template(out, CHATML.replace("You are a helpful AI assistant named SmolLM, trained by "
                                                    "Hugging Face", "Be brief."))
    hf_models.set_end_ids(out, [eot, end])
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    ids = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                  return_dict=True, return_tensors="pt")["input_ids"]

    def answer() -> list[int]:
        return model.generate(ids, do_sample=False, max_new_tokens=ANSWER_TOKENS)[0, ids.size(1):].tolist()

    with torch.no_grad():
        greedy, weight = answer(), model.lm_head.weight
        for step in range(3, 8):  # the first row scaled so that its token turns into the end of turn there, not before
            for scale in (1.001, 1.01, 1.05):
                weight[end] = weight[greedy[step]] * scale
                if answer() == greedy[:step] + [end]:
                    model.save_pretrained(out)
                    return out
    raise AssertionError("no output row makes greedy decoding end its turn a few tokens in")


@pytest.fixture(scope="module")
def instruct(tmp_path_factory) -> tuple[Path, Path]:
    """``(Hugging Face directory, imported run)``."""
    return hf_models.imported(tmp_path_factory.mktemp("instruct"), instruct_dir)


def transformers_chat(hf: Path, questions: list[str], max_new_tokens: int, system: str | None = None) -> list[str]:
    """Each answer of a conversation by transformers: greedy ``generate`` on ``apply_chat_template``'s ids (at most
    ``max_new_tokens``, stopping at ``generation_config.json``'s end ids), decoded without special pieces; the
    oldest turns dropped while the prompt and ``max_new_tokens`` exceed the model's positions."""
    tok = transformers.AutoTokenizer.from_pretrained(str(hf))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    turns: list[dict] = []
    answers = []
    for question in questions:
        if question == "/reset":
            turns = []
            continue
        while True:
            messages = ([{"role": "system", "content": system}] if system else []) + turns + \
                [{"role": "user", "content": question}]
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True,
                                          return_tensors="pt")["input_ids"]
            if ids.size(1) + max_new_tokens <= model.config.max_position_embeddings:
                break
            turns = turns[2:]
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens)
        answers.append(tok.decode(out[0, ids.size(1):], skip_special_tokens=True))
        turns += [{"role": "user", "content": question}, {"role": "assistant", "content": answers[-1]}]
    return answers


def test_import_keeps_the_template_and_the_end_of_turn(instruct):
    hf, run_dir = instruct
    run = load_run(run_dir)
    reference = transformers.AutoTokenizer.from_pretrained(str(hf))
    assert run.cfg.data.chat_template == reference.chat_template
    assert run.cfg.data.end_of_turn == ["<|im_end|>"]
    assert run.tok.src_pieces_from_ids([EOS_ID]) == ["<|endoftext|>"]  # config.json's end of text stays </s>
    ids, text = end_of_turn(run.tok, run.cfg.data.end_of_turn)
    assert [run.tok._src.to_hf[i] for i in ids] == [reference.convert_tokens_to_ids("<|im_end|>")] and text == []
    assert special_tokens(run.tok, run_dir) == reference.special_tokens_map
    assert "|-" in (run_dir / "config.yaml").read_text(encoding="utf-8")  # the template as a readable block


@pytest.mark.parametrize("where", ["tokenizer_config", "named", "jinja"])
def test_import_and_export_keep_where_the_template_was(instruct, tmp_path, where):
    hf, _ = instruct
    shutil.copytree(hf, tmp_path / "hf")
    settings = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text(encoding="utf-8"))
    template = settings.pop("chat_template").replace("Be brief.", f"Kept in {where}.")
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps(settings), encoding="utf-8")
    hf_models.set_chat_template(tmp_path / "hf", template, where)
    assert main(["import", str(tmp_path / "hf"), "-o", str(tmp_path / "run")]) == 0
    assert load_run(tmp_path / "run").cfg.data.chat_template == template
    assert main(["export", str(tmp_path / "run"), "--to", "huggingface", "-o", str(tmp_path / "out")]) == 0
    for name in ("tokenizer_config.json", "chat_template.jinja"):  # each file as it came
        assert (tmp_path / "out" / name).is_file() == (tmp_path / "hf" / name).is_file(), name
        if (tmp_path / "hf" / name).is_file():
            assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes(), name
    again = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert again.get_chat_template() == template
    generation = transformers.GenerationConfig.from_pretrained(str(tmp_path / "out"))
    assert sorted(generation.eos_token_id) == sorted(again.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))


def test_chat_once_is_transformers_greedy_answer_ending_at_the_end_of_turn(instruct, capsys):
    hf, run_dir = instruct
    tok = transformers.AutoTokenizer.from_pretrained(str(hf))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                  return_dict=True, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        new = model.generate(ids, do_sample=False, max_new_tokens=ANSWER_TOKENS)[0, ids.size(1):].tolist()
    assert new[-1] == tok.convert_tokens_to_ids("<|im_end|>") and 3 < len(new) < ANSWER_TOKENS  # the turn ends
    run = load_run(run_dir)
    assert [run.tok._src.to_hf[i] for i in encode_rendered(run.tok, tok.apply_chat_template(
        [{"role": "user", "content": QUESTION}], tokenize=False, add_generation_prompt=True))] == ids[0].tolist()
    code, out, err = cli(capsys, "chat", run_dir, "--once", QUESTION, "--temperature", "0",
                         "--max-new-tokens", ANSWER_TOKENS)
    assert code == 0, err
    assert out == tok.decode(new, skip_special_tokens=True) + "\n"
    assert out.strip() and "<|im_end|>" not in out


def test_a_conversation_from_standard_input(instruct, capsys, monkeypatch):
    """Each answer is transformers' for the conversation so far, ``/reset`` forgets it, the oldest turns go when
    the model's 128 positions are full (the system message stays), and the end of input leaves with status 0."""
    hf, run_dir = instruct
    questions = [QUESTION, "The quick", "Größe und Übermaß", "/reset", "The quick", "a b c", "emoji 🙂 and 12 May",
                 "numbers 0123456789", "x"]
    expected = transformers_chat(hf, questions, 16, system="Be brief.")
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(q + "\n" for q in questions) + "\n"))
    code, out, err = cli(capsys, "chat", run_dir, "--temperature", "0", "--max-new-tokens", "16",
                         "--system", "Be brief.")
    assert code == 0, err
    assert out == "".join(a + "\n" for a in expected)
    assert "no longer fit" in err  # the conversation outgrew the positions, and went on


def test_the_next_prompt_holds_the_conversation(instruct):
    hf, run_dir = instruct
    run, reference = load_run(run_dir), transformers.AutoTokenizer.from_pretrained(str(hf))
    chat = Chat(run, run_template(run, "run"), system="Be brief.", max_new_tokens=8, temperature=0)
    first = "".join(chat.answer(QUESTION))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION},
                {"role": "assistant", "content": first}, {"role": "user", "content": "and then?"}]
    expected = reference.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert [run.tok._src.to_hf[i] for i in chat.prompt("and then?")] == expected
    chat.reset()
    assert [run.tok._src.to_hf[i] for i in chat.prompt("and then?")] == reference.apply_chat_template(
        [messages[0], messages[-1]], add_generation_prompt=True, return_dict=True)["input_ids"]


def test_history_keeps_the_newest_turns_that_fit(instruct):
    hf, run_dir = instruct
    run = load_run(run_dir)
    chat = Chat(run, run_template(run, "run"), system="Be brief.", max_new_tokens=20)
    chat.turns = [(f"question {i}", f"answer number {i}") for i in range(12)]
    ids = chat.prompt("last one")
    kept = len(chat.turns)
    assert chat.dropped + kept == 12 and 0 < kept < 12 and chat.turns[-1] == ("question 11", "answer number 11")
    assert len(ids) + 20 <= chat.positions  # it fits; one more turn would not
    one_more = encode_rendered(run.tok, chat.template.render(chat.messages(
        [("question 0", "answer number 0"), *chat.turns], "last one")))
    assert len(one_more) + 20 > chat.positions
    assert chat.template.render(chat.messages(chat.turns, "last one")).startswith("<|im_start|>system\nBe brief.")
    with pytest.raises(UserError, match="exceed the model's 128 positions"):
        chat.prompt("long " * 200)


def test_the_default_budget_never_asks_for_more_than_fits(instruct):
    """Without max_new_tokens an answer gets 256 tokens, or what the model's 128 positions leave after the question
    (old turns are dropped first, as for a budget asked for); a question that fills them is still an error."""
    hf, run_dir = instruct
    run = load_run(run_dir)
    chat = Chat(run, run_template(run, "run"), system="Be brief.")
    ids = chat.prompt("what is it")
    assert chat.max_new_tokens == chat.positions - len(ids) < 256
    chat.turns = [("an old question " * 10, "an old answer " * 10)]
    assert chat.prompt("what is it") == ids and chat.dropped == 1 and chat.turns == []
    with pytest.raises(UserError, match="exceed the model's 128 positions"):
        chat.prompt("long " * 200)


def test_chat_errors_are_one_line(instruct, tmp_path, capsys):
    hf, run_dir = instruct
    shutil.copytree(run_dir, tmp_path / "run")
    config = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text(encoding="utf-8"))

    def with_template(template: str) -> Path:
        config["data"]["chat_template"] = template
        (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
        return tmp_path / "run"

    code, _, err = cli(capsys, "chat", with_template(""), "--once", "hi")
    assert_one_line_error(code, err, "has no chat template", "data.chat_template")
    code, _, err = cli(capsys, "chat", with_template("{% if messages %}unclosed"), "--once", "hi")
    assert_one_line_error(code, err, "data.chat_template", "not valid Jinja")
    code, _, err = cli(capsys, "chat", with_template(MISTRAL), "--once", "hi", "--system", "Be brief.")
    assert_one_line_error(code, err, "data.chat_template", "Conversation roles must alternate")
    code, _, err = cli(capsys, "chat", run_dir, "--once", "hi", "--max-new-tokens", "0")
    assert_one_line_error(code, err, "--max-new-tokens must be in 1..")
    code, _, err = cli(capsys, "chat", run_dir, "--once", "hi", "--top-p", "0")
    assert_one_line_error(code, err, "--top-p")


# -- a run trained here ------------------------------------------------------------------------------------------

#: A play's layout: the user speaks as ROMEO, the model answers as JULIET, a turn ends at the end of its line.
PLAY = ("{% for m in messages %}{{ 'ROMEO' if m['role'] == 'user' else 'JULIET' }}:\n{{ m['content'] }}\n"
        "{% endfor %}{% if add_generation_prompt %}JULIET:\n{% endif %}")


def test_config_template_inline_or_from_a_file(tmp_path):
    (tmp_path / "play.jinja").write_text(PLAY, encoding="utf-8")
    for value in (PLAY, str(tmp_path / "play.jinja")):
        cfg = load_config(RunConfig, lm_config(tmp_path / "train.txt", chat_template=value, end_of_turn=["\n"]))
        assert cfg.data.chat_template == PLAY
        dump_config(cfg, tmp_path / "config.yaml")
        assert load_config(RunConfig, tmp_path / "config.yaml") == cfg
    (tmp_path / "plain.txt").write_text("no tags here", encoding="utf-8")
    for value, needle in [(str(tmp_path / "none.jinja"), "not found"), (str(tmp_path / "plain.txt"), "no Jinja tag"),
                          ("{{ messages", "not valid Jinja"), ("{% if x %}", "not valid Jinja")]:
        with pytest.raises(UserError, match=needle) as error:
            spec("lm").check(load_config(RunConfig, lm_config(tmp_path / "train.txt", chat_template=value)))
        assert "data.chat_template" in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(UserError, match="data.end_of_turn"):
        load_config(RunConfig, lm_config(tmp_path / "train.txt", end_of_turn=[""]))


def test_a_run_trained_here_chats_with_its_config_template(tmp_path, capsys):
    (tmp_path / "train.txt").write_text(corpus(300), encoding="utf-8")
    gpt2_like = {"activation": "gelu_tanh", "scale_embeddings": False}  # what a GPT2LMHeadModel export holds
    train_lm(lm_config(tmp_path / "train.txt", model=gpt2_like, chat_template=PLAY, end_of_turn=["\n"]),
             tmp_path / "run")
    run = load_run(tmp_path / "run")
    prompt = "ROMEO:\nmy lord\nJULIET:\n"
    ids = run.tok.encode_src([prompt])[0]
    tokens = [int(t[0]) for t in generate(run.model, [ids], 20, temperature=0)]
    newline = run.tok.encode_src(["\n"])[0][0]
    ends = [i for i, t in enumerate(tokens) if t in (newline, EOS_ID)]
    expected = run.tok.decode_src([tokens[:ends[0]] if ends else tokens])[0]
    code, out, err = cli(capsys, "chat", tmp_path / "run", "--once", "my lord", "--temperature", "0",
                         "--max-new-tokens", "20")
    assert code == 0, err
    assert out == expected + "\n"
    # exported, transformers renders the same prompt and reads the same ids
    assert main(["export", str(tmp_path / "run"), "--to", "huggingface", "-o", str(tmp_path / "hf")]) == 0
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    rendered = reference.apply_chat_template([{"role": "user", "content": "my lord"}], tokenize=False,
                                             add_generation_prompt=True)
    assert rendered == prompt and reference(rendered)["input_ids"] == ids
