"""The Hugging Face Trainer and TRL's SFTTrainer, given iga_ds.integrations.recipe's run of a run
YAML, train what `iga-ds train` of that YAML trains; and `iga.max_skipped_steps` stops them as it
stops `iga-ds train`.

Real processes (DeepSpeed ZeRO-2 in float32 on the CPU, gloo), this file run as their worker. One
rank: `iga-ds train --config RUN.yaml` (IGA and ERM, 2 accumulation steps, 4 steps over an epoch
boundary, warm-up, cosine decay and weight decay), then IGATrainer (and IGASFTTrainer, IGA) of
`run_recipe(RUN.yaml)`: the same LoRA weights, learning rates, per-domain losses and method
statistics step by step. Two ranks, the same records and base at 1 group a micro-batch (2
accumulation steps a rank, so each rank's micro-batches interleave in the sampler's order): the
same again for IGA (IGATrainer and IGASFTTrainer) and ERM (IGATrainer). IGATrainer with the
Trainer's own optimizer and schedule (the recipe's model and data, no `schedule=`) ends
elsewhere: what `schedule=` selects is what makes them equal. A model whose logits turn NaN at
chosen steps stops at the third skipped step in a row, naming the loss, and runs on when the
skipped steps are not in a row. The one-rank process also runs bench/bench_train.py's
`sft_trainer_iga` variant at `--small`'s settings (its imports paid here once, not by the
benchmark's smoke run): it trains the benchmark's batches."""
from __future__ import annotations

import importlib.util
import math
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STEPS = 4
NAN_IN_A_ROW = [2, 3, 4]  # three skipped steps in a row: iga.max_skipped_steps' default limit
NAN_APART = [1, 2, 4, 5]  # never three in a row
METHODS = {"iga": {"name": "iga", "params": {"tau": 0.5}}, "erm": {"name": "erm"}}
GROUPS_PER_STEP = 4
# groups a micro-batch at each world size: 2 accumulation steps at both
GROUPS_PER_MICRO_BATCH = {1: 2, 2: 1}
# what each run compares, (method, world size, trainer): IGASFTTrainer on IGA
CASES = [("iga", 1, "hf"), ("iga", 1, "sft"), ("erm", 1, "hf"), ("iga", 2, "hf"), ("iga", 2, "sft"),
         ("erm", 2, "hf")]


def write_run_yamls(tmp: Path) -> None:
    """A run YAML for each method and world size (``tmp/<method>-w<world>/run.yaml``): 8 groups of
    4 domains (2 steps an epoch), one tiny base for all of them."""
    import yaml

    from test_train_support import run_config_dict, tiny_base, write_isomer_jsonl

    data = write_isomer_jsonl(tmp / "train.jsonl", groups=8, seed=5)
    base = str(tiny_base(tmp, data))
    for method, world in {(m, w) for m, w, _ in CASES}:
        folder = tmp / f"{method}-w{world}"
        folder.mkdir()
        config = run_config_dict(folder, data, output_dir=str(folder / "iga_ds"), **{
            "model.name_or_path": base, "method": METHODS[method], "seed": 5, "lora.alpha": 16,
            "data.groups_per_step": GROUPS_PER_STEP, "data.groups_per_micro_batch": GROUPS_PER_MICRO_BATCH[world],
            # 2 warm-up steps of 4 (lr / 2, lr), then the cosine to lr x 0.1; AdamW's default weight
            # decay 0.01, and betas and eps of neither trainer's defaults
            "schedule": {"lr": 2e-2, "warmup_ratio": 0.5, "min_lr_ratio": 0.1, "max_steps": STEPS,
                         "betas": [0.8, 0.95], "eps": 1e-6}})
        (folder / "run.yaml").write_text(yaml.safe_dump(config))


def run_yaml(tmp: Path, method: str, world: int) -> Path:
    return tmp / f"{method}-w{world}" / "run.yaml"


def lora_weights(model) -> dict:
    from peft import get_peft_model_state_dict

    return {k: v.detach().float().cpu().clone() for k, v in get_peft_model_state_dict(model).items()}


def trainer_run(config: Path, name: str, sft: bool = False, own_schedule: bool = False, nan_at=(), **over) -> dict:
    """IGATrainer (or IGASFTTrainer) of run_recipe(config), in the folder ``name`` beside it;
    ``nan_at``: the steps whose logits are NaN."""
    from iga_ds.errors import UserError
    from iga_ds.integrations.hf import IGATrainer
    from iga_ds.integrations.recipe import run_recipe

    recipe = run_recipe(config)
    kwargs = recipe.trainer_kwargs()
    if own_schedule:  # the Trainer's AdamW groups and its cosine schedule, over as many warm-up steps
        del kwargs["schedule"]
        over = {"lr_scheduler_type": "cosine", "warmup_steps": 2, **over}
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # accelerate's state with gloo, kept by the Trainer
        from hf_trainer_worker import gloo_state_for_deepspeed

        gloo_state_for_deepspeed()
        over = {"accelerator_config": {"use_configured_state": True}, **over}
    arguments = None
    trainer_class = IGATrainer
    if sft:
        from trl import SFTConfig

        from iga_ds.integrations.sft import IGASFTTrainer
        arguments, trainer_class = SFTConfig, IGASFTTrainer
    args = recipe.training_arguments(str(config.parent / name), arguments, disable_tqdm=True, **over)
    trainer = trainer_class(args=args, **kwargs)
    groups = record_micro_batch_groups(trainer)
    if nan_at:
        head = recipe.model.get_output_embeddings()
        head.register_forward_hook(lambda module, args, output: output * float("nan")
                                   if trainer.state.global_step + 1 in nan_at else None)
    try:
        trainer.train()
    except UserError as exc:
        return {"error": str(exc), "error_class": type(exc).__name__, "logs": trainer.state.log_history,
                "hook_detached": trainer.iga_hook is None}
    return {"params": lora_weights(trainer.model), "logs": trainer.state.log_history, "micro_batches": groups}


def record_micro_batch_groups(trainer) -> list[list[int]]:
    """The groups of each micro-batch this rank's ``training_step`` takes, in its order."""
    seen: list[list[int]] = []
    step = trainer.training_step

    def recording(model, inputs, *args, **kwargs):
        seen.append(list(dict.fromkeys(inputs["group_index"].tolist())))
        return step(model, inputs, *args, **kwargs)

    trainer.training_step = recording
    return seen


def iga_ds_train(config: Path) -> dict:
    """`iga-ds train --config RUN.yaml`, through the command line's own entry point, and the
    groups of each micro-batch it built on this rank (read where its batching builds them)."""
    from safetensors.torch import load_file

    from iga_ds.cli import main
    from iga_ds.files import read_jsonl
    from iga_ds.train.batching import TokenizedGroups

    seen: list[list[int]] = []
    build = TokenizedGroups.micro_batch

    def recording(self, groups, *args, **kwargs):
        seen.append([int(g) for g in groups])
        return build(self, groups, *args, **kwargs)

    TokenizedGroups.micro_batch = recording
    try:
        assert main(["train", "--config", str(config)]) == 0
    finally:
        TokenizedGroups.micro_batch = build
    out = config.parent / "iga_ds"
    return {"params": load_file(str(out / "adapter" / "adapter_model.safetensors")),
            "records": read_jsonl(out / "metrics.jsonl"), "micro_batches": seen}


def equivalence_runs(tmp: Path, world: int) -> dict:
    """Each case of this world size: ``iga-ds train`` of its YAML, then the trainer of its recipe."""
    results = {}
    for method, w, name in CASES:
        if w != world or (name == "sft" and importlib.util.find_spec("trl") is None):  # the test skips it
            continue
        config = run_yaml(tmp, method, world)
        if (method, "iga_ds") not in results:
            results[method, "iga_ds"] = iga_ds_train(config)
        results[method, name] = trainer_run(config, name, sft=name == "sft")
    return results


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


def one_rank_worker(tmp: Path) -> dict:
    write_run_yamls(tmp)
    results = equivalence_runs(tmp, 1)
    iga = run_yaml(tmp, "iga", 1)
    results.update(own_schedule=trainer_run(iga, "own", own_schedule=True),
                   nan_in_a_row=trainer_run(iga, "nan1", nan_at=NAN_IN_A_ROW, max_steps=5),
                   nan_apart=trainer_run(iga, "nan2", nan_at=NAN_APART, max_steps=5))
    if importlib.util.find_spec("trl") is not None:  # the test skips it otherwise
        results["bench"] = bench_variant(tmp / "bench")
    return results


def worker(tmp: Path) -> None:
    import torch

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    results = one_rank_worker(tmp) if world == 1 else equivalence_runs(tmp, world)
    if rank > 0:  # the other ranks' own: the groups of their micro-batches
        results = {key: {"micro_batches": r.get("micro_batches")} for key, r in results.items()}
    torch.save(results, tmp / f"results-w{world}-rank{rank}.pt")


def launch_worker(tmp: Path, world: int) -> dict:
    import torch

    from dist_helpers import launch

    path = os.pathsep.join(str(REPO / folder) for folder in ("", "tests", "bench"))
    results = launch(Path(__file__), world, [str(tmp)], timeout=300, extra_env={"PYTHONPATH": path})
    failed = "".join(f"--- rank {r} exit {rc}:\n{text[-4000:]}" for r, (rc, text) in enumerate(results) if rc)
    assert not failed, failed
    ranks = [torch.load(tmp / f"results-w{world}-rank{r}.pt", weights_only=False) for r in range(world)]
    for key, result in ranks[0].items():  # each rank's micro-batches, by rank
        result["micro_batches"] = [rank[key].get("micro_batches") for rank in ranks]
    return ranks[0]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("equivalence")


@pytest.fixture(scope="module")
def runs(folder):
    """One rank: every case of it, and the rest of this file's runs; it writes the run YAMLs."""
    return launch_worker(folder, 1)


@pytest.fixture(scope="module")
def two_ranks(folder, runs):
    """Two ranks of ZeRO-2 under gloo, on the YAMLs (and the tiny base) the one-rank run wrote."""
    return launch_worker(folder, 2)


def step_logs(result: dict) -> list[dict]:
    return [entry for entry in result["logs"] if "loss" in entry]


def max_difference(got: dict, want: dict) -> float:
    assert got.keys() == want.keys() and want
    return max(float((got[k] - want[k]).abs().max()) for k in want)


def case_results(request, method: str, world: int, name: str) -> tuple[dict, dict]:
    """(``iga-ds train``'s run, the trainer's) of a case, from the launch of its world size."""
    results = request.getfixturevalue("runs" if world == 1 else "two_ranks")
    if (method, name) not in results:
        pytest.skip("IGASFTTrainer needs trl (pip install 'iga-ds[trl]')")
    return results[method, "iga_ds"], results[method, name]


def method_statistics(record: dict) -> list[str]:
    """The method's statistics in an ``iga-ds train`` record (the hook's timings and its step
    count aside: the Trainer logs its own step)."""
    return [key for key in record if key.startswith("hook.") and not key.startswith("hook.time/")
            and key != "hook.step"]


@pytest.mark.parametrize("method, world, name", CASES)
def test_the_recipe_trains_what_iga_ds_train_trains(request, method, world, name):
    want, got = case_results(request, method, world, name)
    assert max_difference(got["params"], want["params"]) < 1e-6
    records, logs = want["records"], step_logs(got)
    assert [entry["step"] for entry in logs] == [r["step"] for r in records] == list(range(1, STEPS + 1))
    statistics = method_statistics(records[0])
    assert ("hook.mask_mean" in statistics) == (method == "iga")
    for record, entry in zip(records, logs):
        assert entry["learning_rate"] == pytest.approx(record["lr"], rel=1e-9)  # iga-ds train's schedule
        for key in ["loss.math", "loss.medical", "loss.legal", "loss.science", "grad_norm", *statistics]:
            assert entry[key] == pytest.approx(record[key], rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("method, world, name", CASES)
def test_each_rank_takes_the_groups_iga_ds_train_gives_it_at_each_micro_batch(request, method, world, name):
    # the weights cannot tell: a step's update sums over its groups, whichever rank took each
    want, got = (result["micro_batches"] for result in case_results(request, method, world, name))
    per_micro = GROUPS_PER_MICRO_BATCH[world]
    assert len(want) == world and all(len(rank) == STEPS * GROUPS_PER_STEP // (world * per_micro) for rank in want)
    assert all(len(batch) == per_micro for rank in want for batch in rank)
    assert got == want


def test_the_trainers_own_optimizer_and_schedule_train_something_else(runs):
    # what schedule= selects is what makes the runs equal: without it they part
    want = runs["iga", "iga_ds"]
    assert max_difference(runs["own_schedule"]["params"], want["params"]) > 1e-4
    lrs = [entry["learning_rate"] for entry in step_logs(runs["own_schedule"])]
    assert lrs[0] == 0.0 != want["records"][0]["lr"]  # the Trainer's warm-up starts at 0


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
    # the batches every other variant takes (tests/bench/test_bench_train.py's smoke run holds them to it)
    assert bench["step_tokens"] == bench["plan_tokens"] and len(bench["plan_tokens"]) == steps
    assert len(bench["step_times_s"]) == steps and all(t > 0 for t in bench["step_times_s"])
    assert len(bench["losses"]) == steps and all(math.isfinite(x) for x in bench["losses"])


if __name__ == "__main__":  # the worker, started by the fixture (tests/ and bench/ on its path)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    worker(Path(sys.argv[1]))
