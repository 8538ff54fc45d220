"""`iga-ds eval` on a tiny random LLaMA with a word-level tokenizer and a PEFT adapter.

Everything is built here and saved under tmp_path; nothing is downloaded.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from iga_ds.cli import main
from iga_ds.data.prompts import format_prompt

DOMAINS = ("math", "medical", "legal", "science")
WORDS = "Problem Solution Answer yes no if then is a the value of x plus equals Think step by final answer on last line as".split()


def _records(groups: int = 3) -> list[dict]:
    recs = []
    for g in range(groups):
        for d in DOMAINS:
            recs.append({
                "group_id": f"g{g}", "seed_id": f"s{g}", "domain": d,
                "problem": f"if {d} {g} then is the value of x {g} plus {g + 1} ?",
                "cot": f"the value of x equals {2 * g + 1}", "answer": str(2 * g + 1) if d != "legal" else "yes",
            })
    return recs


def _tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(33, 127)]
    vocab = ["[PAD]", "[UNK]", "<s>", "</s>", "\n", " "] + chars + [" " + c for c in chars]
    corpus = " ".join(WORDS + list(DOMAINS)) + " " + format_prompt({"problem": "x"})
    for word in sorted(set(corpus.split())):
        for tok in (word, " " + word):
            if tok not in vocab:
                vocab.append(tok)
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r" ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]|\n| "), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", bos_token="<s>", eos_token="</s>",
        clean_up_tokenization_spaces=False,
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(base dir, adapter dir, data file) of a tiny random LLaMA, its LoRA adapter, isomer data."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("tiny")
    tokenizer = _tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # PEFT starts B at zero; make the adapter change outputs
    peft_model.save_pretrained(root / "adapter")
    data = root / "isomers.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _records()))
    return root / "base", root / "adapter", data


def _slow_greedy(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """Reference: one prompt, no padding, argmax of a full forward pass per new token, from the
    ids a training row starts with: the BOS token, then the prompt's own tokens."""
    ids = torch.tensor([[tokenizer.bos_token_id] + tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    new = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            nxt = int(model(ids).logits[0, -1].argmax())
            if nxt == tokenizer.eos_token_id:
                break
            new.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return tokenizer.decode(new, skip_special_tokens=True)


def test_batched_generation_matches_unbatched_reference(tiny):
    from iga_ds.evaluation.generation import generate, load_model

    base, adapter, _ = tiny
    model, tokenizer = load_model(base, adapter, device="cpu")
    side = tokenizer.padding_side
    prompts = [format_prompt(r) for r in _records()[:5]]
    prompts[1] = "if then"  # a short prompt: the batch needs left padding
    fast = generate(model, tokenizer, prompts, max_new_tokens=6, batch_size=3, stop_after_answer=False, progress=False)
    slow = [_slow_greedy(model, tokenizer, p, 6) for p in prompts]
    assert fast == slow
    assert tokenizer.padding_side == side  # generate pads left only while it runs
    assert any(fast)


def test_evaluation_prompts_are_the_start_of_training_rows(tiny):
    """A plain-format prompt is fed with the BOS token training put first, even though this
    tokenizer's own post-processor adds none; chat text gets no extra token on either side."""
    from iga_ds.data.prompts import prompt_token_ids
    from iga_ds.evaluation.generation import load_model
    from iga_ds.train.batching import encode_example

    base, adapter, _ = tiny
    _, tokenizer = load_model(base, adapter, device="cpu")
    record = _records()[0]
    prompt = format_prompt(record)
    assert tokenizer(prompt)["input_ids"][:1] != [tokenizer.bos_token_id]  # the case this guards
    for special in (True, False):
        ids, labels = encode_example(tokenizer, prompt, " yes", max_length=512, add_special_tokens=special)
        first_target = next(i for i, label in enumerate(labels) if label != -100)
        assert ids[:first_target] == prompt_token_ids(tokenizer, prompt, special)
        assert (ids[0] == tokenizer.bos_token_id) == special


def test_adapter_is_applied(tiny):
    from iga_ds.evaluation.generation import load_model

    base, adapter, _ = tiny
    plain, tok = load_model(base, device="cpu")
    tuned, _ = load_model(base, adapter, device="cpu")
    ids = tok(format_prompt(_records()[0]), return_tensors="pt")["input_ids"]
    with torch.no_grad():
        diff = (plain(ids).logits - tuned(ids).logits).abs().max()
    assert diff > 1e-3
    # the merged adapter gives the same logits as PEFT's unmerged forward
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    unmerged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(adapter)).eval()
    with torch.no_grad():
        assert torch.allclose(unmerged(ids).logits, tuned(ids).logits, atol=1e-5)


def test_eval_cli_writes_eval_json_with_domains_and_lcs(tiny, tmp_path):
    base, adapter, data = tiny
    out = tmp_path / "eval.json"
    rc = main([
        "eval", "--base", str(base), "--adapter", str(adapter), "--data", str(data), "--name", "synthetic",
        "--ood-domains", "legal", "--max-new-tokens", "8", "--batch-size", "5", "--lcs-layers", "1,-2",
        "--no-progress", "--out", str(out),
    ])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "synthetic" and result["n"] == 12
    assert set(result["per_domain"]) == set(DOMAINS)
    rows = result["items"]
    for domain in DOMAINS:  # per-domain accuracy is recomputed from the item rows
        mine = [r["correct"] for r in rows if r["domain"] == domain]
        assert result["per_domain"][domain]["accuracy"] == pytest.approx(100.0 * sum(mine) / len(mine))
    assert result["ood_accuracy"] is not None and result["delta_gap"] == pytest.approx(
        result["id_accuracy"] - result["ood_accuracy"]
    )
    lcs = result["lcs"]
    assert lcs["groups"] == 3 and lcs["domains"] == sorted(DOMAINS)
    assert set(lcs["layers"]) == {"1", "2"}  # 3 layers: -2 is hidden_states[2], the penultimate layer
    assert all(v > 0 for v in lcs["layers"].values())
    assert lcs["layers_x1e-2"]["2"] == pytest.approx(lcs["layers"]["2"] * 100)
    assert not (tmp_path / "eval.json.partial.jsonl").exists()


def test_lcs_of_model_batched_equals_one_by_one(tiny):
    from iga_ds.evaluation.generation import load_model
    from iga_ds.evaluation.consistency import lcs_of_model
    from iga_ds.metrics import lcs

    base, _, _ = tiny
    model, tok = load_model(base, device="cpu")
    recs = _records()
    batched = lcs_of_model(model, tok, recs, layers=[1, -2], batch_size=5)
    # reference: each text alone (no padding) after the BOS token training rows start with, mean
    # over its tokens, then the float64 LCS
    groups = [[r for r in recs if r["group_id"] == g] for g in ("g0", "g1", "g2")]
    for layer in (1, 2):
        hidden = []
        for group in groups:
            states = []
            for rec in sorted(group, key=lambda r: r["domain"]):
                text = tok(format_prompt(rec), add_special_tokens=False)["input_ids"]
                ids = torch.tensor([[tok.bos_token_id] + text])
                with torch.no_grad():
                    states.append(model(ids, output_hidden_states=True).hidden_states[layer][0].double().mean(0))
            hidden.append(torch.stack(states))
        assert batched[layer] == pytest.approx(lcs(torch.stack(hidden)), rel=1e-5)


def test_lcs_reads_hidden_states_without_the_logits_of_every_position(tiny):
    # a batch's logits over the vocabulary are the forward's largest tensor; LCS reads none of them
    from iga_ds.evaluation.consistency import lcs_of_model
    from iga_ds.evaluation.generation import load_model

    base, adapter, _ = tiny
    model, tok = load_model(base, adapter, device="cpu")
    positions = []
    head = model.get_output_embeddings().register_forward_hook(lambda m, args, out: positions.append(args[0].shape[1]))
    try:
        lcs_of_model(model, tok, _records(), layers=[1], batch_size=5)
    finally:
        head.remove()
    assert positions and set(positions) == {1}


def test_eval_resumes_without_regenerating(tiny, tmp_path, monkeypatch):
    import iga_ds.evaluation.generation as generation

    base, _, data = tiny
    out = tmp_path / "eval.json"
    args = ["eval", "--base", str(base), "--data", str(data), "--max-new-tokens", "4", "--batch-size", "4",
            "--no-lcs", "--no-progress", "--out", str(out)]
    real = generation.generate
    calls: list[int] = []

    def killed_after_first_batch(model, tokenizer, prompts, **kw):
        on_batch = kw.pop("on_batch")

        def once(idx, texts):
            on_batch(idx, texts)
            raise KeyboardInterrupt  # the job is killed after one saved batch

        calls.append(len(prompts))
        return real(model, tokenizer, prompts, on_batch=once, **kw)

    monkeypatch.setattr(generation, "generate", killed_after_first_batch)
    assert main(args) == 130
    partial = tmp_path / "eval.json.partial.jsonl"
    assert len(partial.read_text().splitlines()) == 1 + 4  # header + one batch
    # a half-written last line (killed mid-write) is dropped and that item regenerated
    with partial.open("a") as fh:
        fh.write('{"id": "g2/sci')

    def counting(model, tokenizer, prompts, **kw):
        calls.append(len(prompts))
        return real(model, tokenizer, prompts, **kw)

    monkeypatch.setattr(generation, "generate", counting)
    assert main(args) == 0
    assert calls == [12, 8]
    result = json.loads(out.read_text())
    assert result["resumed_items"] == 4 and len({r["id"] for r in result["items"]}) == 12

    # other settings with a leftover partial file are refused, not mixed
    partial.write_text(json.dumps({"settings": {"other": 1}}) + "\n")
    assert main(args) == 2
    assert main(args + ["--restart"]) == 0


def test_eval_cli_user_errors(tiny, tmp_path, capsys):
    base, _, _ = tiny
    rc = main(["eval", "--base", str(base), "--benchmark", "reclor", "--benchmark-dir", str(tmp_path / "none"),
               "--out", str(tmp_path / "e.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "whyu.me/reclor" in err and err.count("\n") == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"group_id": "g", "domain": "math", "problem": "p"}\n')
    rc = main(["eval", "--base", str(base), "--data", str(bad), "--out", str(tmp_path / "e.json")])
    assert rc == 2 and "bad.jsonl:1: missing field 'answer'" in capsys.readouterr().err
    rc = main(["eval", "--base", str(tmp_path), "--data", str(tiny[2]), "--out", str(tmp_path / "e.json")])
    assert rc == 2 and "not a local Hugging Face model directory" in capsys.readouterr().err


def test_eval_on_benchmark_fixture(tiny, tmp_path):
    base, _, _ = tiny
    fixtures = Path(__file__).resolve().parents[1] / "fixtures" / "benchmarks"
    out = tmp_path / "math.json"
    rc = main(["eval", "--base", str(base), "--benchmark", "math", "--benchmark-dir", str(fixtures / "MATH"),
               "--benchmark-option", "ood_subjects=geometry", "--benchmark-option", "id_subjects=algebra",
               "--max-new-tokens", "3", "--no-progress", "--out", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["benchmark_options"]["ood_subjects"] == ["geometry"]
    assert set(result["per_split"]) == {"id", "ood"} and result["n"] == 4
    assert "accuracy_symbolic" in result
