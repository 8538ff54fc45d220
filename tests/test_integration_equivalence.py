"""The Hugging Face Trainer and TRL's SFTTrainer, given iga_ds.integrations.recipe's run of a run
YAML, train what `iga-ds train` of that YAML trains; and `iga.max_skipped_steps` stops them as it
stops `iga-ds train`.

One real process (DeepSpeed ZeRO-2 in float32 on the CPU, gloo), this file run as its worker:
`iga-ds train --config RUN.yaml` (IGA, 2 accumulation steps, 4 steps over an epoch boundary,
warm-up, cosine decay and weight decay), then IGATrainer and IGASFTTrainer of
`run_recipe(RUN.yaml)`: the same LoRA weights, learning rates and per-domain losses step by step.
IGATrainer with the Trainer's own optimizer and schedule (the recipe's model and data, no
`schedule=`) ends elsewhere: what `schedule=` selects is what makes them equal. A model whose
logits turn NaN at chosen steps stops at the third skipped step in a row, naming the loss, and
runs on when the skipped steps are not in a row. The same process runs bench/bench_train.py's
`sft_trainer_iga` variant at `--small`'s settings (its imports paid here once, not by the
benchmark's smoke run): it trains the benchmark's batches."""
from __future__ import annotations

import importlib.util
import math
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STEPS = 4
NAN_IN_A_ROW = [2, 3, 4]  # three skipped steps in a row: iga.max_skipped_steps' default limit
NAN_APART = [1, 2, 4, 5]  # never three in a row


def run_yaml(tmp: Path) -> Path:
    """IGA on 8 groups of 4 domains, 4 groups a step in micro-batches of 2 (2 accumulation steps)."""
    import yaml

    from test_train_support import run_config_dict, tiny_base, write_isomer_jsonl

    data = write_isomer_jsonl(tmp / "train.jsonl", groups=8, seed=5)
    config = run_config_dict(tmp, data, output_dir=str(tmp / "iga_ds"), **{
        "model.name_or_path": str(tiny_base(tmp, data)), "method": {"name": "iga", "params": {"tau": 0.5}},
        "data.groups_per_step": 4, "data.groups_per_micro_batch": 2, "lora.alpha": 16, "seed": 5,
        # 2 warm-up steps of 4 (lr / 2, lr), then the cosine to lr x 0.1; AdamW's default weight
        # decay 0.01, and betas and eps of neither trainer's defaults
        "schedule": {"lr": 2e-2, "warmup_ratio": 0.5, "min_lr_ratio": 0.1, "max_steps": STEPS,
                     "betas": [0.8, 0.95], "eps": 1e-6}})
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def lora_weights(model) -> dict:
    from peft import get_peft_model_state_dict

    return {k: v.detach().float().cpu().clone() for k, v in get_peft_model_state_dict(model).items()}


def trainer_run(config: Path, out: Path, sft: bool = False, own_schedule: bool = False, nan_at=(), **over) -> dict:
    """IGATrainer (or IGASFTTrainer) of run_recipe(config); ``nan_at``: the steps whose logits are NaN."""
    from iga_ds.errors import UserError
    from iga_ds.integrations.hf import IGATrainer
    from iga_ds.integrations.recipe import run_recipe

    recipe = run_recipe(config)
    kwargs = recipe.trainer_kwargs()
    if own_schedule:  # the Trainer's AdamW groups and its cosine schedule, over as many warm-up steps
        del kwargs["schedule"]
        over = {"lr_scheduler_type": "cosine", "warmup_steps": 2, **over}
    arguments = None
    trainer_class = IGATrainer
    if sft:
        from trl import SFTConfig

        from iga_ds.integrations.sft import IGASFTTrainer
        arguments, trainer_class = SFTConfig, IGASFTTrainer
    trainer = trainer_class(args=recipe.training_arguments(str(out), arguments, **over), **kwargs)
    if nan_at:
        head = recipe.model.get_output_embeddings()
        head.register_forward_hook(lambda module, args, output: output * float("nan")
                                   if trainer.state.global_step + 1 in nan_at else None)
    try:
        trainer.train()
    except UserError as exc:
        return {"error": str(exc), "error_class": type(exc).__name__, "logs": trainer.state.log_history,
                "hook_detached": trainer.iga_hook is None}
    return {"params": lora_weights(trainer.model), "logs": trainer.state.log_history}


def iga_ds_train(config: Path) -> dict:
    """`iga-ds train --config RUN.yaml`, through the command line's own entry point."""
    from safetensors.torch import load_file

    from iga_ds.cli import main
    from iga_ds.files import read_jsonl

    assert main(["train", "--config", str(config)]) == 0
    out = config.parent / "iga_ds"
    return {"params": load_file(str(out / "adapter" / "adapter_model.safetensors")),
            "records": read_jsonl(out / "metrics.jsonl")}


def bench_variant(work: Path) -> dict:
    """bench/bench_train.py's ``sft_trainer_iga`` at ``--small``'s settings, and the token counts
    of the benchmark's plan, which every variant's steps are held to."""
    import torch

    import bench_train

    args, cpu = bench_train.resolve_args(["--small"]), torch.device("cpu")
    work.mkdir()
    spec = bench_train.prepare(args, bench_train.plan_spec(args, work, cpu), cpu)
    plan_tokens, _ = bench_train.step_sizes(*bench_train.load_plan(spec))
    return {"plan_tokens": plan_tokens, **bench_train.run_sft_trainer_iga(spec)}


def worker(tmp: Path) -> None:
    import torch

    config = run_yaml(tmp)
    results = {"iga_ds": iga_ds_train(config), "hf": trainer_run(config, tmp / "hf"),
               "own_schedule": trainer_run(config, tmp / "own", own_schedule=True),
               "nan_in_a_row": trainer_run(config, tmp / "nan1", nan_at=NAN_IN_A_ROW, max_steps=5),
               "nan_apart": trainer_run(config, tmp / "nan2", nan_at=NAN_APART, max_steps=5)}
    if importlib.util.find_spec("trl") is not None:  # the tests skip them otherwise
        results["sft"] = trainer_run(config, tmp / "sft", sft=True)
        results["bench"] = bench_variant(tmp / "bench")
    torch.save(results, tmp / "results.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import torch

    from dist_helpers import launch

    tmp = tmp_path_factory.mktemp("equivalence")
    path = os.pathsep.join(str(REPO / folder) for folder in ("", "tests", "bench"))
    [(rc, output)] = launch(Path(__file__), 1, [str(tmp)], timeout=300, extra_env={"PYTHONPATH": path})
    assert rc == 0, output[-4000:]
    return torch.load(tmp / "results.pt", weights_only=False)


def step_logs(result: dict) -> list[dict]:
    return [entry for entry in result["logs"] if "loss" in entry]


def max_difference(got: dict, want: dict) -> float:
    assert got.keys() == want.keys() and want
    return max(float((got[k] - want[k]).abs().max()) for k in want)


@pytest.mark.parametrize("name", ["hf", "sft"])
def test_the_recipe_trains_what_iga_ds_train_trains(runs, name):
    if name == "sft" and "sft" not in runs:
        pytest.skip("IGASFTTrainer needs trl (pip install 'iga-ds[trl]')")
    want, got = runs["iga_ds"], runs[name]
    assert max_difference(got["params"], want["params"]) < 1e-6
    records, logs = want["records"], step_logs(got)
    assert [entry["step"] for entry in logs] == [r["step"] for r in records] == list(range(1, STEPS + 1))
    for record, entry in zip(records, logs):
        assert entry["learning_rate"] == pytest.approx(record["lr"], rel=1e-9)  # iga-ds train's schedule
        for key in ("loss.math", "loss.medical", "loss.legal", "loss.science", "hook.mask_mean"):
            assert entry[key] == pytest.approx(record[key], rel=1e-5), key


def test_the_trainers_own_optimizer_and_schedule_train_something_else(runs):
    # what schedule= selects is what makes the runs equal: without it they part
    assert max_difference(runs["own_schedule"]["params"], runs["iga_ds"]["params"]) > 1e-4
    lrs = [entry["learning_rate"] for entry in step_logs(runs["own_schedule"])]
    assert lrs[0] == 0.0 != runs["iga_ds"]["records"][0]["lr"]  # the Trainer's warm-up starts at 0


def test_skipped_steps_in_a_row_stop_the_run_in_one_line_naming_the_loss(runs):
    result = runs["nan_in_a_row"]
    assert result.get("error_class") == "DivergedRun", result
    first = NAN_IN_A_ROW[0]
    assert result["error"].startswith(f"IGATrainer: step {NAN_IN_A_ROW[-1]}: 3 optimizer steps in a row skipped")
    assert f"the first at step {first} (the loss was nan)" in result["error"]
    assert "\n" not in result["error"] and result["hook_detached"]
    skipped = [entry["step"] for entry in step_logs(result) if entry["hook.skipped"]]
    assert skipped == NAN_IN_A_ROW[:-1]  # the last step's log never came: the run stopped in it


def test_skipped_steps_apart_do_not_stop_the_run(runs):
    result = runs["nan_apart"]
    assert "error" not in result, result.get("error")
    assert [entry["step"] for entry in step_logs(result) if entry["hook.skipped"]] == NAN_APART


def test_the_benchmarks_sft_trainer_variant_trains_the_plans_batches(runs):
    import bench_train

    if "bench" not in runs:
        pytest.skip("bench_train.py's sft_trainer_iga needs trl (pip install 'iga-ds[trl]')")
    bench, steps = runs["bench"], bench_train.SMALL["steps"]
    # the batches every other variant takes (tests/test_bench_train.py's smoke run holds them to it)
    assert bench["step_tokens"] == bench["plan_tokens"] and len(bench["plan_tokens"]) == steps
    assert len(bench["step_times_s"]) == steps and all(t > 0 for t in bench["step_times_s"])
    assert len(bench["losses"]) == steps and all(math.isfinite(x) for x in bench["losses"])


if __name__ == "__main__":  # the worker, started by the fixture (tests/ and bench/ on its path)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    worker(Path(sys.argv[1]))
