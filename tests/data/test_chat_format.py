"""Instruction models are prompted as instruction models: a tokenizer with a chat template gets
the problem as the user turn and the chain of thought as the assistant turn, the same prompt
text and tokens in training and evaluation, and the loss on the assistant turn only; a
tokenizer without one keeps the plain format. The tokenizers here are the tiny base's
word-level one with chat templates written for it (nothing is downloaded)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from test_train_support import DOMAINS, run_config_dict, tiny_base, write_isomer_jsonl

from iga_ds.data.groups import complete_groups
from iga_ds.data.prompts import INSTRUCTION, PROMPT_FORMAT_FILE, PromptFormat, prompt_format, saved_prompt_format
from iga_ds.errors import ConfigError, UserError
from iga_ds.evaluation.records import isomer_items
from iga_ds.evaluation.runner import evaluate
from iga_ds.train.batching import IGNORE_INDEX, collate, encode_example, read_records, tokenize_groups

# ChatML's shape with the tiny vocabulary's own special tokens: <s> opens a turn, </s> ends it
TURNS = ("{% for m in messages %}<s>{{ 'Q' if m['role'] == 'user' else 'A' }}\n{{ m['content'] }}</s>\n"
         "{% endfor %}{% if add_generation_prompt %}<s>A\n{% endif %}")
# a template that writes the BOS token itself, as Llama 3's does: nothing may add a second one
WITH_BOS = "{{ bos_token }}" + TURNS.replace("<s>", "[").replace("</s>", "]")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(isomer file, records, the tiny base folder, a copy of it whose tokenizer has TURNS)."""
    from transformers import AutoTokenizer

    tmp = tmp_path_factory.mktemp("chat")
    data = write_isomer_jsonl(tmp / "train.jsonl", groups=4, seed=6)
    base = tiny_base(tmp, data)
    chat_base = tmp / "chat-base"
    shutil.copytree(base, chat_base)
    tokenizer = AutoTokenizer.from_pretrained(chat_base)
    tokenizer.chat_template = TURNS
    tokenizer.save_pretrained(chat_base)
    return data, read_records(data), base, chat_base


def _tokenizer(folder, template=None, adds_bos=False):
    """The folder's tokenizer; ``adds_bos``: it puts a BOS before every text it is asked to
    tokenize with special tokens, as Llama's tokenizers do."""
    from tokenizers import processors

    from iga_ds.train.model import load_tokenizer

    tokenizer = load_tokenizer(str(folder))
    if template is not None:
        tokenizer.chat_template = template
    if adds_bos:
        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tokenizer.bos_token_id)])
    return tokenizer


def test_the_chat_format_is_the_template_around_the_plain_texts(setup):
    _, records, _, chat_base = setup
    tokenizer = _tokenizer(chat_base)
    fmt = prompt_format(tokenizer)
    assert fmt.name == "chat" and not fmt.add_special_tokens
    for rec in records[:8]:
        user = f"Problem: {rec['problem'].strip()}\n{INSTRUCTION}"
        assistant = f"{rec['cot']}\nAnswer: {rec['answer']}"
        prompt, target = fmt.example(rec)
        assert prompt == f"<s>Q\n{user}</s>\n<s>A\n" == fmt.prompt(rec)
        assert prompt == tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                                       add_generation_prompt=True)
        assert target == f"{assistant}</s>"  # the turn and its end marker; not the newline between turns
        # the training row is the whole conversation as the template tokenizes it, less that newline
        whole = tokenizer.apply_chat_template([{"role": "user", "content": user},
                                               {"role": "assistant", "content": assistant}], tokenize=True)
        ids, _ = encode_example(tokenizer, prompt, target, 512, fmt.add_special_tokens)
        assert ids == whole["input_ids"][:-1] and tokenizer.decode(whole["input_ids"][-1:]) == "\n"


def test_a_tokenizer_without_a_template_keeps_the_plain_format(setup):
    _, records, base, chat_base = setup
    plain = prompt_format(_tokenizer(base))
    assert (plain.name, plain.add_special_tokens) == ("plain", True)
    rec = records[0]
    assert plain.example(rec) == (f"Problem: {rec['problem'].strip()}\n{INSTRUCTION}\nSolution:\n",
                                  f"{rec['cot']}\nAnswer: {rec['answer']}")
    forced = prompt_format(_tokenizer(chat_base), "plain")  # the config switch
    assert forced.example(rec) == plain.example(rec)
    with pytest.raises(ConfigError, match=r"^data.prompt_format: chat needs a tokenizer with a chat template"):
        prompt_format(_tokenizer(base), "chat")
    with pytest.raises(ConfigError, match=r"^data.prompt_format: expected one of auto, plain, chat, got 'chatml'$"):
        prompt_format(_tokenizer(base), "chatml")


def test_a_template_that_does_not_continue_its_prompt_is_refused(setup):
    _, records, _, chat_base = setup
    # drops the system-like preamble once an assistant turn exists: the prompt is no prefix
    odd = "{% if messages|length == 1 %}<s>S\n{% endif %}" + TURNS
    with pytest.raises(ConfigError, match="does not render a conversation as its prompt.*set data.prompt_format: plain"):
        prompt_format(_tokenizer(chat_base, odd)).example(records[0])


class _Recorder:
    """Stands in for a model in evaluation's generate: keeps the token rows it is fed (padding
    dropped) and answers each with its row number, so that eval.json says which row was whose."""

    def __init__(self, tokenizer):
        self.rows: list[list[int]] = []
        self.tokenizer = tokenizer

    def parameters(self):
        yield torch.zeros(1)

    def generate(self, input_ids, attention_mask, **_):
        numbers = []
        for ids, mask in zip(input_ids, attention_mask):
            numbers.append(self.tokenizer(f" {len(self.rows)}", add_special_tokens=False)["input_ids"])
            self.rows.append(ids[mask.bool()].tolist())
        width = max(map(len, numbers))
        pad = self.tokenizer.pad_token_id
        return torch.cat([input_ids, torch.tensor([n + [pad] * (width - len(n)) for n in numbers])], dim=1)


@pytest.mark.parametrize("template, adds_bos", [(TURNS, False), (WITH_BOS, True)],
                         ids=["turns", "bos-in-template"])
def test_training_and_evaluation_feed_the_same_prompt_tokens(setup, tmp_path, template, adds_bos):
    """The prompt part of each training row (its masked labels) is, token for token, what
    evaluation feeds the model for the same record; labels cover exactly the assistant turn."""
    _, records, _, chat_base = setup
    tokenizer = _tokenizer(chat_base, template, adds_bos)
    fmt = prompt_format(tokenizer)
    groups = complete_groups(records, DOMAINS)
    rows = tokenize_groups(tokenizer, groups, 512, tmp_path / "tok", prompt_format=fmt).rows
    recorder = _Recorder(tokenizer)
    items = isomer_items([rec for group in groups for rec in group])
    result = evaluate(items, recorder, tokenizer, tmp_path / "eval.json", {}, fmt.prompt, max_new_tokens=2,
                      stop_after_answer=False, progress=False, add_special_tokens=fmt.add_special_tokens)
    fed = {row["id"]: recorder.rows[int(row["output"])] for row in result["items"]}
    assert len(fed) == len(recorder.rows) == len(rows)
    bos = tokenizer.bos_token_id
    for index, rec in enumerate(rec for group in groups for rec in group):
        ids, labels = rows[index]["input_ids"], rows[index]["labels"]
        prompt_len = next(i for i, label in enumerate(labels) if label != IGNORE_INDEX)
        assert ids[:prompt_len] == fed[f"{rec['group_id']}/{rec['domain']}"]
        assert ids[:2].count(bos) <= 1  # one BOS at most, whoever writes it
        assert all(lab == IGNORE_INDEX for lab in labels[:prompt_len]) and labels[prompt_len:] == ids[prompt_len:]
        prompt, target = fmt.example(rec)
        assert tokenizer.decode(ids[:prompt_len]) == prompt and tokenizer.decode(ids[prompt_len:]) == target


def test_a_long_chat_example_loses_prompt_tokens_from_its_start_never_the_assistant_turn(setup):
    _, records, _, chat_base = setup
    tokenizer = _tokenizer(chat_base)
    fmt = prompt_format(tokenizer)
    batch = collate(tokenizer, [records[:4]], DOMAINS, 40, fmt)
    for rec, ids, labels in zip(records[:4], batch.input_ids.tolist(), batch.labels.tolist()):
        prompt, target = (tokenizer(text, add_special_tokens=False)["input_ids"] for text in fmt.example(rec))
        assert len(prompt) + len(target) > 40  # the case under test: too long
        assert ids == prompt[len(prompt) + len(target) - 40:] + target
        assert labels == [IGNORE_INDEX] * (40 - len(target)) + target


def test_the_trainer_records_the_format_and_evaluation_follows_it(setup, tmp_path):
    """A run on a chat-template base trains on chat text and says so in its adapter; ``iga-ds
    eval`` then prompts with the template. Forced plain, both sides stay plain."""
    from iga_ds.cli import main
    from iga_ds.config.run import config_from_dict
    from iga_ds.train.trainer import Trainer

    data, _, _, chat_base = setup
    evals = {}
    for wanted in ("auto", "plain"):
        over = {"model.name_or_path": str(chat_base), "schedule.max_steps": 1, "data.prompt_format": wanted,
                "output_dir": str(tmp_path / wanted)}
        result = Trainer(config_from_dict(run_config_dict(tmp_path, data, **over)), quiet=True).run()
        assert saved_prompt_format(result.adapter_dir) == {"auto": "chat", "plain": "plain"}[wanted]
        out = tmp_path / f"{wanted}.json"
        assert main(["eval", "--base", str(chat_base), "--adapter", str(result.adapter_dir), "--data", str(data),
                     "--out", str(out), "--max-new-tokens", "2", "--limit", "2", "--no-lcs", "--no-progress",
                     "--device", "cpu"]) == 0
        evals[wanted] = json.loads(out.read_text())["generation"]
    assert evals["auto"]["prompt_format"] == "chat" and evals["auto"]["chat_template"] == TURNS
    assert evals["plain"]["prompt_format"] == "plain" and "chat_template" not in evals["plain"]
    (tmp_path / "plain" / "adapter" / PROMPT_FORMAT_FILE).write_text('{"prompt_format": "chatml"}')
    with pytest.raises(UserError, match=r"prompt_format.json: field 'prompt_format': expected plain or chat"):
        saved_prompt_format(tmp_path / "plain" / "adapter")


def test_a_plain_format_needs_no_tokenizer():
    assert PromptFormat("plain").prompt({"problem": " x "}) == f"Problem: x\n{INSTRUCTION}\nSolution:\n"
