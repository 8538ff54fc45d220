"""The prompt/target format shared by training and evaluation, and isomer file reading."""
from __future__ import annotations

import json

import pytest

from iga_ds.errors import DataError
from iga_ds.data.prompts import INSTRUCTION, format_prompt, format_target
from iga_ds.evaluation.records import isomer_items, read_isomer_records
from iga_ds.metrics import score_generation

REC = {"group_id": "g1", "seed_id": "s1", "domain": "legal", "problem": "  Is the clause valid? ", "cot": "Step 1.", "answer": "yes"}


def test_prompt_holds_problem_and_instruction_and_ends_a_line():
    prompt = format_prompt(REC)
    assert "Is the clause valid?" in prompt and INSTRUCTION in prompt
    assert prompt.endswith("\n")


def test_target_appends_answer_once():
    assert format_target(REC) == "Step 1.\nAnswer: yes"
    done = dict(REC, cot="Step 1.\nAnswer: yes")  # the synthetic data already ends so
    assert format_target(done) == "Step 1.\nAnswer: yes"
    assert format_target(dict(REC, cot="")) == "Answer: yes"


def test_a_model_that_reproduces_the_target_scores_correct():
    # training target and evaluation extraction agree for every answer kind
    for answer in ("yes", "42", "C"):
        rec = dict(REC, answer=answer)
        item = isomer_items([rec])[0]
        assert score_generation(format_target(rec), item.answer, item.kind).correct, answer


def test_read_isomer_records_errors(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(REC) + "\n" + json.dumps({k: v for k, v in REC.items() if k != "answer"}) + "\n")
    with pytest.raises(DataError, match=r"d.jsonl:2: missing field 'answer'"):
        read_isomer_records(path)
    path.write_text(json.dumps(REC) + "\n" + json.dumps(REC) + "\n")
    with pytest.raises(DataError, match=r"d.jsonl:2: group 'g1' already has a 'legal' instance \(line 1\)"):
        read_isomer_records(path)
    with pytest.raises(DataError, match="no such isomer file"):
        read_isomer_records(tmp_path / "missing.jsonl")


def test_isomer_items_kinds_and_ood_domains():
    recs = [dict(REC, domain="math", answer="12"), dict(REC, domain="legal", answer="no")]
    items = isomer_items(recs, name="synthetic", ood_domains=["legal"])
    assert [(i.kind, i.split, i.id) for i in items] == [("number", "id", "g1/math"), ("text", "ood", "g1/legal")]
