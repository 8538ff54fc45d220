"""What a run leaves behind: a loadable PEFT adapter, metrics.jsonl, TensorBoard events, the
resolved config; and the CLI's one-line errors."""
from __future__ import annotations

import json

import pytest
import yaml

from test_train_support import DOMAINS, run_config_dict, tiny_base, write_isomer_jsonl


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from iga_ds.config.run import config_from_dict
    from iga_ds.train.trainer import Trainer

    tmp = tmp_path_factory.mktemp("outputs")
    data = write_isomer_jsonl(tmp / "train.jsonl", groups=4, seed=4)
    base = tiny_base(tmp, data)
    cfg = config_from_dict(run_config_dict(tmp, data, output_dir=str(tmp / "out"), **{"schedule.max_steps": 3}))
    trainer = Trainer(cfg, base_model_dir=str(base), quiet=True)
    return tmp, data, base, cfg, trainer, trainer.run()


def _batch(cfg, data, tokenizer, step):
    from iga_ds.data.groups import complete_groups
    from iga_ds.train.batching import GroupSampler, collate, read_records

    groups = complete_groups(read_records(data), DOMAINS)
    sampler = GroupSampler(len(groups), cfg.data.groups_per_step, cfg.seed)
    return collate(tokenizer, [groups[g] for g in sampler.step_groups(step)], DOMAINS, cfg.data.max_length)


def test_adapter_loads_with_peft_and_reproduces_the_trained_model(run):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp, data, base, cfg, trainer, result = run
    assert result.status == "completed"
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(result.adapter_dir))
    tokenizer = AutoTokenizer.from_pretrained(result.adapter_dir)
    mb = _batch(cfg, data, tokenizer, 0)
    model.eval()
    trained = trainer.engine.module.eval()
    with torch.no_grad():
        got = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
        want = trained(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
        plain = AutoModelForCausalLM.from_pretrained(base)(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, plain)  # the adapter changes the model


def test_logged_first_loss_matches_a_recomputation_with_the_base(run):
    """LoRA B starts at zero, so step 1's logged losses are the base model's on step 1's batch."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from iga_ds.train.batching import sequence_losses

    tmp, data, base, cfg, trainer, result = run
    tokenizer = AutoTokenizer.from_pretrained(base)
    mb = _batch(cfg, data, tokenizer, 0)
    with torch.no_grad():
        seq = sequence_losses(AutoModelForCausalLM.from_pretrained(base)(input_ids=mb.input_ids,
                              attention_mask=mb.attention_mask).logits, mb.labels).double()
    rec = json.loads((tmp / "out" / "metrics.jsonl").read_text().splitlines()[0])
    assert rec["step"] == 1 and rec["loss"] == pytest.approx(float(seq.mean()), rel=1e-5)
    for i, d in enumerate(DOMAINS):
        assert rec[f"loss.{d}"] == pytest.approx(float(seq[mb.domain_ids == i].mean()), rel=1e-5)
    assert rec["target_tokens"] == mb.num_target_tokens
    for key in ("lr", "grad_norm", "step_time_s", "step_interval_s", "tokens_per_s"):
        assert isinstance(rec[key], float) and rec[key] > 0, key
    # end to end holds each step's own time, and the intervals tile part of the run's wall time
    recs = [json.loads(line) for line in (tmp / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) > 1 and all(r["step_interval_s"] >= r["step_time_s"] for r in recs)
    assert sum(r["step_interval_s"] for r in recs) < result.wall_seconds


def test_metrics_tensorboard_and_resolved_config(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tmp, data, base, cfg, trainer, result = run
    out = tmp / "out"
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3]
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    events = acc.Scalars("loss")
    assert [e.step for e in events] == [1, 2, 3]
    assert [e.value for e in events] == pytest.approx([x["loss"] for x in lines], rel=1e-6)
    resolved = yaml.safe_load((out / "config.resolved.yaml").read_text())
    assert resolved["resolved"]["world_size"] == 1
    assert resolved["resolved"]["deepspeed_config"]["train_batch_size"] == 2 * len(DOMAINS)
    assert resolved["resolved"]["trainable_parameters"] > 0


def test_iga_method_logs_mask_statistics(run, tmp_path):
    from iga_ds.config.run import config_from_dict
    from iga_ds.train.trainer import Trainer

    _, data, base, _, _, _ = run
    cfg = config_from_dict(run_config_dict(tmp_path, data, **{"schedule.max_steps": 2, "method.name": "iga"}))
    result = Trainer(cfg, base_model_dir=str(base), quiet=True).run()
    assert result.status == "completed"
    hook_keys = [k for k in result.history[-1] if k.startswith("hook.")]
    assert any("mask" in k for k in hook_keys), hook_keys


def test_cli_reports_bad_input_in_one_line(tmp_path, capsys):
    from iga_ds.cli import main

    assert main(["train", "--config", str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("iga-ds: error:") and "missing.yaml" in err and "\n" not in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  groups_per_step: many\n")
    assert main(["train", "--config", str(bad)]) == 2
    assert "data.groups_per_step: expected an integer" in capsys.readouterr().err


def test_update_norms_match_a_float64_recomputation_from_the_parameters(run, tmp_path):
    """update_norms.json and each step's update_norm against parameters read around every step
    (in float64, found by name, not through the tracker) and the saved adapter's factors."""
    import math

    from safetensors.torch import load_file

    from iga_ds.config.run import config_from_dict
    from iga_ds.train.trainer import Trainer

    _, data, base, _, _, _ = run
    step_squares: list[dict[str, float]] = []

    class Recording(Trainer):
        def train_step(self, s, step):
            lora = {n: p for n, p in s.engine.module.named_parameters() if "lora_" in n}
            before = {n: p.detach().double().clone() for n, p in lora.items()}
            record = super().train_step(s, step)
            squares: dict[str, float] = {}
            for n, p in lora.items():
                module = n.split(".lora_")[0].removeprefix("base_model.model.")
                squares[module] = squares.get(module, 0.0) + float((p.detach().double() - before[n]).square().sum())
            step_squares.append(squares)
            return record

    # IGA (its mask shrinks the update) over 2 micro-batches per step
    cfg = config_from_dict(run_config_dict(tmp_path, data, **{"schedule.max_steps": 3, "method.name": "iga"}))
    result = Recording(cfg, base_model_dir=str(base), quiet=True).run()
    norms = json.loads((tmp_path / "run" / "update_norms.json").read_text())
    assert norms["steps"] == 3 and set(norms["modules"]) == set(step_squares[0]) and len(step_squares) == 3
    for record, squares in zip(result.history, step_squares):
        assert record["update_norm"] == pytest.approx(math.sqrt(sum(squares.values())), rel=1e-6)
        assert record["update_norm"] > 0
    for module, got in norms["modules"].items():
        assert got["path"] == pytest.approx(sum(math.sqrt(sq[module]) for sq in step_squares), rel=1e-6)
    weights = load_file(str(result.adapter_dir / "adapter_model.safetensors"))
    config = json.loads((result.adapter_dir / "adapter_config.json").read_text())
    scaling = config["lora_alpha"] / config["r"]
    for module, got in norms["modules"].items():
        a = weights[f"base_model.model.{module}.lora_A.weight"].double()
        b = weights[f"base_model.model.{module}.lora_B.weight"].double()
        assert got["displacement"] == pytest.approx(float((scaling * b @ a).norm()), rel=1e-9)
        assert got["displacement"] > 0
