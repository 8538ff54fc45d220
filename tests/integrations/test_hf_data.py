"""iga_ds.integrations.hf_data: TRL's conversational and prompt-completion rows with a group and a
domain column, tokenized with the loss on the completion only, and the refusals."""
from __future__ import annotations

import json

import pytest

from iga_ds.errors import DataError
from iga_ds.integrations.hf_data import isomer_dataset

# ChatML's shape with the tiny vocabulary's own special tokens (as tests/data/test_chat_format.py's)
TURNS = ("{% for m in messages %}<s>{{ 'Q' if m['role'] == 'user' else 'A' }}\n{{ m['content'] }}</s>\n"
         "{% endfor %}{% if add_generation_prompt %}<s>A\n{% endif %}")
DOMAINS = ["math", "legal"]


@pytest.fixture(scope="module")
def tokenizer():
    from iga_ds.train.model import build_vocab, build_word_tokenizer

    tok = build_word_tokenizer(build_vocab(["what is two plus two", "the answer is four", "a contract", "four"]))
    tok.chat_template = TURNS
    return tok


def chat_row(group, domain, question, answer):
    return {"group_id": group, "domain": domain,
            "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def labelled_text(tokenizer, row) -> str:
    return tokenizer.decode([t for t, label in zip(row["input_ids"], row["labels"]) if label != -100])


def test_conversational_rows_train_the_assistant_message_only(tokenizer):
    rows = [chat_row("g1", "legal", "a contract", "four"), chat_row("g1", "math", "what is two plus two", "four")]
    data = isomer_dataset(rows, tokenizer, DOMAINS)
    assert data["domain_ids"] == [0, 1] and data["group_index"] == [0, 0]  # in the domains' order
    math = data[0]
    # the template writes "<s>Q\n...</s>\n<s>A\n" before the model's turn, "four</s>\n" after it
    assert labelled_text(tokenizer, math) == "four</s>\n"
    assert tokenizer.decode(math["input_ids"]) == "<s>Q\nwhat is two plus two</s>\n<s>A\nfour</s>\n"


def test_prompt_completion_rows_as_text_and_as_messages(tokenizer):
    text = {"group_id": 1, "domain": "math", "prompt": "what is two plus two", "completion": " four"}
    chat = {"group_id": 1, "domain": "legal", "prompt": [{"role": "user", "content": "a contract"}],
            "completion": [{"role": "assistant", "content": "the answer"}]}
    data = isomer_dataset([text, chat], tokenizer, DOMAINS)
    # plain text: BOS, prompt, completion, EOS; the loss on the completion and the EOS
    assert tokenizer.decode(data[0]["input_ids"]) == "<s>what is two plus two four</s>"
    assert labelled_text(tokenizer, data[0]) == " four</s>"
    assert labelled_text(tokenizer, data[1]) == "the answer</s>\n"


def test_a_jsonl_file_with_its_own_column_names(tokenizer, tmp_path):
    rows = [{"problem": p, "source": d, "prompt": "two", "completion": " four"}
            for p in ("x", "y") for d in reversed(DOMAINS)]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = isomer_dataset(str(path), tokenizer, DOMAINS, group_column="problem", domain_column="source")
    assert data["group_index"] == [0, 0, 1, 1] and data["domain_ids"] == [0, 1, 0, 1]


@pytest.mark.parametrize("rows, message", [
    ([{"domain": "math", "prompt": "a", "completion": "b"}], "row 1 has no 'group_id' column"),
    ([{"group_id": 1, "domain": "art", "prompt": "a", "completion": "b"}], "domain 'art' is not one of"),
    ([{"group_id": 1, "domain": "math", "prompt": "a", "completion": "b"}], r"group '1' lacks domain\(s\) \['legal'\]"),
    ([{"group_id": 1, "domain": "math", "prompt": "a", "completion": "b"}] * 2, "group 1 has two 'math' rows"),
    ([{"group_id": 1, "domain": d, "text": "a"} for d in DOMAINS], "expected 'messages' .* or 'prompt' and"),
    ([{**chat_row(1, d, "a", "b"), "messages": [{"role": "user", "content": "a"}]} for d in DOMAINS],
     "last one has role 'assistant'"),
])
def test_rows_that_do_not_fit_are_refused_in_one_line(tokenizer, rows, message):
    with pytest.raises(DataError, match=message) as err:
        isomer_dataset(rows, tokenizer, DOMAINS)
    assert "\n" not in str(err.value)


def test_a_conversation_needs_a_chat_template(tokenizer):
    from iga_ds.train.model import build_vocab, build_word_tokenizer

    plain = build_word_tokenizer(build_vocab(["a"]))
    with pytest.raises(DataError, match="no chat template"):
        isomer_dataset([chat_row(1, d, "a", "b") for d in DOMAINS], plain, DOMAINS)
