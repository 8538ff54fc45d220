"""bench/bench_train.py: the CPU smoke run end to end (every variant in its own process, the
same tokens for all, ``--profile``'s files), and its arithmetic (FLOPs, MFU, the summary) and
skip rule in-process."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bench_train

REPO = Path(__file__).resolve().parents[2]
# sft_trainer_iga starts trl as well (seconds of imports more than hf_trainer): it runs in
# tests/integrations/test_integration_equivalence.py's worker, whose process has them loaded already
SMOKE_VARIANTS = [v for v in bench_train.VARIANTS if v != "sft_trainer_iga"]


@pytest.mark.slow
def test_small_run_measures_every_variant_on_the_same_tokens(tmp_path):
    out = tmp_path / "bench_train.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "bench_train.py"), "--small", "--profile",
                           "--variants", ",".join(SMOKE_VARIANTS), "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    rows = report["variants"]
    assert [row["variant"] for row in rows] == SMOKE_VARIANTS
    assert report["card"] == "CPU" and report["peak_flops"] is None
    ran = [row for row in rows if "skipped" not in row]
    assert all(row["skipped"].strip() for row in rows if row not in ran)  # a skip says why
    # the anchors that need nothing beyond the package's own dependencies always run; liger-kernel needs a GPU
    gpu_only = {v for v in bench_train.VARIANTS if bench_train.LIGER in v}
    assert set(SMOKE_VARIANTS) - {"hf_trainer"} - gpu_only <= {row["variant"] for row in ran}
    assert all("CUDA" in row["skipped"] for row in rows if row["variant"] in gpu_only)
    assert report["settings"]["model_dir"] == "WORK_DIR/model"  # no path of this machine in the JSON
    steps, warmup = report["settings"]["steps"], report["settings"]["warmup_steps"]
    profiled = report["settings"]["profile_steps"]
    assert profiled == bench_train.PROFILE_STEPS
    for row in ran:
        assert "error" not in row, row["error"]
        assert len(row["step_times_s"]) == steps and all(t > 0 for t in row["step_times_s"]), row["variant"]
        assert row["median_step_s"] > 0 and row["tokens_per_s"] > 0, row["variant"]
        assert row["timed_steps"] == steps - warmup - profiled  # --profile: its steps are left out
        assert row["mfu"] is None  # no bf16 peak for a CPU
    # --profile: the plain loop and iga-ds train profile the same steps, their files beside --out
    for row in ran:
        if row["variant"] == "hf_trainer":
            assert "profile_json" not in row
            continue
        variant = row["variant"]
        # recorded by their names: they lie beside --out
        assert (row["profile_json"], row["profile_txt"]) == (f"bench_train_profile_{variant}.json",
                                                             f"bench_train_profile_{variant}.txt")
        profile = json.loads((tmp_path / row["profile_json"]).read_text())
        assert (profile["steps"], profile["first_step"]) == (profiled, warmup + 1), variant  # 1-based steps
        assert any(op["name"] in ("aten::mm", "aten::addmm") for op in profile["ops"]), variant
        assert (tmp_path / row["profile_txt"]).read_text().startswith(f"# {profiled} optimizer steps profiled"), variant
    # the same records, token ids and batches: identical token counts, step by step
    assert len({tuple(row["step_tokens"]) for row in ran}) == 1, {row["variant"]: row["step_tokens"] for row in ran}
    assert ran[0]["tokens"] > 0
    # padding-free is a layout, not another computation: the same losses step by step
    by_name = {row["variant"]: row for row in ran}
    for method in ("erm", "iga"):
        padded, packed = by_name[f"iga_ds_{method}"]["losses"], by_name[f"iga_ds_{method}_packed"]["losses"]
        assert packed == pytest.approx(padded, rel=1e-4), method
    # PEFT's LoRA forward and the fused layers: one function, rounded in another order
    for method in ("erm", "iga"):
        fused, unfused = by_name[f"iga_ds_{method}"]["losses"], by_name[f"iga_ds_{method}_unfused"]["losses"]
        assert fused == pytest.approx(unfused, rel=1e-4), method
    # the plain loop with cuDNN's attention off computes what it computes with it on (seeded alike)
    assert by_name["torch_no_cudnn"]["losses"] == pytest.approx(by_name["torch"]["losses"], rel=1e-6)
    # ERM through the hook is ERM's update on another schedule of reductions: the same losses
    assert by_name["iga_ds_erm_captured"]["losses"] == pytest.approx(by_name["iga_ds_erm"]["losses"], rel=1e-4)
    assert "card: CPU" in proc.stdout and "median step s" in proc.stdout
    # the paired step ratios of every pair that ran, each printed under the table
    pairs = {(p["variant"], p["baseline"]) for p in report["paired"]}
    assert {pair for pair in bench_train.PAIRS
            if set(pair) <= set(SMOKE_VARIANTS) and not {"hf_trainer", *gpu_only} & set(pair)} <= pairs
    assert "iga_ds_iga / iga_ds_erm: step time " in proc.stdout
    # --resume, round by round and with other settings: test_rounds_alternate_the_order_and_resume_round_by_round


def test_a_missing_accelerate_skips_the_hf_trainer_with_the_reason(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else real(name, *a))
    spec = {"packed_attn": "default"}
    assert "accelerate" in bench_train.skip_reason("hf_trainer", spec)
    assert bench_train.skip_reason("torch", spec) is None and bench_train.skip_reason("iga_ds_iga", spec) is None
    row = bench_train.measure("hf_trainer", spec, Path("unused"), argparse.Namespace(), [], None)
    assert row["variant"] == "hf_trainer" and "accelerate" in row["skipped"]
    assert "skipped: accelerate" in bench_train.table([row], "CPU")


def test_a_missing_trl_skips_the_sft_trainer_variant_with_the_reason(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trl" else real(name, *a))
    spec = {"packed_attn": "default"}
    assert "trl is not installed" in bench_train.skip_reason("sft_trainer_iga", spec)
    assert bench_train.skip_reason("hf_trainer", spec) is None


def test_torch_varlen_without_its_kernel_skips_the_padding_free_variants(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    spec = {"packed_attn": "torch_varlen"}
    for variant in ("iga_ds_erm_packed", "iga_ds_iga_packed"):
        assert "torch_varlen attention needs a CUDA device" in bench_train.skip_reason(variant, spec)
    assert bench_train.skip_reason("iga_ds_erm", spec) is None


def test_flops_follow_the_documented_formula():
    counts = {"base_linear": 1000, "lora": 10, "layers": 2, "attn_width": 8}
    # (4 * 1000 + 6 * 10) * T + 12 * 2 * 8 * sum(n^2)
    assert bench_train.step_flops(counts, [5, 7], [13, 25]) == [4060 * 5 + 192 * 13, 4060 * 7 + 192 * 25]


def test_peak_flops_by_card_name_and_override():
    assert bench_train.peak_flops("NVIDIA H200", None) == 989e12
    assert bench_train.peak_flops("NVIDIA H100 80GB HBM3", None) == 989e12
    assert bench_train.peak_flops("NVIDIA A100-SXM4-80GB", None) == 312e12
    assert bench_train.peak_flops("CPU", None) is None
    assert bench_train.peak_flops("CPU", 100.0) == 100e12


def test_summary_leaves_out_the_warm_up_steps():
    result = {"step_times_s": [9.0, 1.0, 2.0, 3.0], "step_tokens": [100, 100, 200, 300], "peak_memory_bytes": 2e9}
    row = bench_train.summarize(result, 1, [50.0, 10.0, 20.0, 30.0], 10.0)
    assert row["median_step_s"] == 2.0 and row["timed_steps"] == 3 and row["tokens"] == 700
    assert row["tokens_per_s"] == pytest.approx(600 / 6)
    assert row["mfu"] == pytest.approx(60 / 6 / 10)
    assert row["peak_memory_gb"] == pytest.approx(2.0)
    assert "error" in bench_train.summarize(result, 4, [0.0] * 4, None)
    # --profile: the profiled steps after the warm-up ones are left out too
    profiled = bench_train.summarize(result, 1, [50.0, 10.0, 20.0, 30.0], 10.0, profiled=2)
    assert profiled["median_step_s"] == 3.0 and profiled["timed_steps"] == 1 and profiled["profiled_steps"] == 2
    assert profiled["mfu"] == pytest.approx(30 / 3 / 10)
    assert "3 profiled" in bench_train.summarize(result, 1, [0.0] * 4, None, profiled=3)["error"]


def test_rounds_pool_each_rounds_timed_steps():
    assert bench_train.timed_ranges(8, 4, 1) == [[1, 4], [5, 8]]
    assert bench_train.timed_ranges(8, 4, 1, profiled=2) == [[3, 4], [5, 8]]  # the first round's profiled steps
    # two rounds of 4 steps, 1 warm-up each: the rounds' second to fourth steps
    result = {"step_times_s": [9.0, 1.0, 2.0, 3.0, 8.0, 4.0, 5.0, 6.0], "step_tokens": [100, 10, 20, 30] * 2}
    row = bench_train.summarize(result, 1, [5.0, 1.0, 2.0, 3.0], 1.0, steps=4)
    assert (row["rounds"], row["timed_ranges"], row["timed_steps"]) == (2, [[1, 4], [5, 8]], 6)
    assert row["median_step_s"] == 3.5 and row["tokens_per_s"] == pytest.approx(120 / 21)
    assert row["mfu"] == pytest.approx(12 / 21)  # each step's FLOPs by its place in the round
    # the pairs read the same ranges: a ratio of 2 everywhere but at the rounds' warm-up steps
    slow = {**row, "variant": "iga_ds_iga", "step_times_s": [1.0, 2.0, 4.0, 6.0, 1.0, 8.0, 10.0, 12.0]}
    pairs = bench_train.paired_ratios([{**row, "variant": "iga_ds_erm"}, slow])
    assert [(p["variant"], p["step_ratio"]) for p in pairs] == [("iga_ds_iga", pytest.approx(2.0))]


@pytest.mark.slow
def test_rounds_alternate_the_order_and_resume_round_by_round(tmp_path):
    out = tmp_path / "rounds.json"
    command = [sys.executable, str(REPO / "bench" / "bench_train.py"), "--small", "--variants", "torch,torch_no_cudnn",
               "--steps", "3", "--out", str(out)]
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run(command + ["--rounds", "2"], cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    ran = [line.split(":")[0] for line in proc.stdout.splitlines() if ": running (" in line]
    assert ran == ["torch", "torch_no_cudnn", "torch_no_cudnn", "torch"]  # the second round in reverse
    rows = json.loads(out.read_text())["variants"]
    assert [(r["rounds"], r["steps"], r["timed_steps"]) for r in rows] == [(2, 6, 4)] * 2
    assert rows[0]["step_tokens"] == rows[1]["step_tokens"] and rows[0]["step_tokens"][:3] == rows[0]["step_tokens"][3:]
    # a run cut after round 1 of torch_no_cudnn: --resume runs its second round only, and a third for both
    report = json.loads(out.read_text())
    cut = report["variants"][1]
    cut = {k: v for k, v in cut.items() if k not in ("rounds", "timed_ranges")}
    report["variants"][1] = {**cut, **bench_train.summarize(
        {"step_times_s": cut["step_times_s"][:3], "step_tokens": cut["step_tokens"][:3]}, 1, [0.0] * 3, None, steps=3)}
    out.write_text(json.dumps(report))
    again = subprocess.run(command + ["--rounds", "3", "--resume"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=600, env=env)
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-4000:]
    ran = [line.split(":")[0] + line.split("round")[-1][:2] for line in again.stdout.splitlines() if ": running (" in line]
    assert ran == ["torch_no_cudnn 2", "torch 3", "torch_no_cudnn 3"], again.stdout
    rows = json.loads(out.read_text())["variants"]
    assert [(r["rounds"], r["steps"]) for r in rows] == [(3, 9)] * 2
    assert rows[0]["step_times_s"][:6] == report["variants"][0]["step_times_s"]  # kept, not measured again
    assert again.stdout.count("measured earlier, kept") == 2  # both: 2 rounds of torch, 1 of torch_no_cudnn
    # other settings in --out: one line, nothing measured or written
    before = out.read_text()
    other = subprocess.run(command[:-4] + ["--steps", "4", "--out", str(out), "--resume"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=600, env=env)
    assert other.returncode == 2 and "--resume" in other.stderr and "other steps" in other.stderr
    assert len(other.stderr.strip().splitlines()) == 1 and out.read_text() == before


def test_recorded_paths_are_portable(tmp_path):
    work, out = tmp_path / "work", tmp_path / "results" / "bench_train.json"
    elsewhere = str(tmp_path / "models" / "m")
    row = {"model_dir": str(work / "model"), "deepspeed": str(REPO / "ds_configs" / "zero2.json"),
           "log": str(work / "logs" / "torch.log"), "profile_json": str(out.parent / "bench_train_profile_torch.json"),
           "profile_txt": "bench_train_profile_torch.txt", "other": str(work / "x"), "steps": 3}
    got = bench_train.portable({**row, "model_dir": elsewhere}, str(work), str(out))
    assert got["model_dir"] == elsewhere  # outside the work folder and the repository: as given
    got = bench_train.portable(row, str(work), str(out))
    assert got == {**row, "model_dir": "WORK_DIR/model", "deepspeed": "ds_configs/zero2.json",
                   "log": "WORK_DIR/logs/torch.log", "profile_json": "bench_train_profile_torch.json"}
    assert bench_train.portable(got, str(work), str(out)) == got  # written again, unchanged


def test_paired_ratios_compare_the_same_timed_steps():
    tokens = [10, 20, 30, 40, 50]
    erm = {"variant": "iga_ds_erm", "step_times_s": [9.0, 1.0, 2.0, 3.0, 4.0], "step_tokens": tokens, "timed_steps": 4,
           "median_step_s": 2.5}
    # IGA's step is ERM's plus a tenth on every timed step, whatever the data make each step cost
    iga = {**erm, "variant": "iga_ds_iga", "step_times_s": [0.5] + [1.1 * t for t in erm["step_times_s"][1:]]}
    loop = {**erm, "variant": "torch", "step_times_s": [5.0, 2.0, 2.0, 2.0, 2.0]}
    other_tokens = {**erm, "variant": "hf_trainer", "step_tokens": [1] * 5}  # not the same steps: no pair
    failed = {"variant": "iga_ds_erm_packed", "error": "x"}
    pairs = {(p["variant"], p["baseline"]): p for p in bench_train.paired_ratios([erm, iga, loop, other_tokens, failed])}
    assert set(pairs) == {("iga_ds_iga", "iga_ds_erm"), ("iga_ds_erm", "torch"), ("iga_ds_iga", "torch")}
    exact = pairs[("iga_ds_iga", "iga_ds_erm")]
    assert exact["step_ratio"] == pytest.approx(1.1) and exact["interval90"] == pytest.approx([1.1, 1.1])
    spread = pairs[("iga_ds_erm", "torch")]  # the warm-up step (9.0 against 5.0) is left out
    assert spread["step_ratio"] == pytest.approx(10 / 8)
    lo, hi = spread["interval90"]
    assert lo < spread["step_ratio"] < hi and 0.5 <= lo and hi <= 2.0
    with pytest.raises(ValueError, match="3 steps against 2"):
        bench_train.paired_ratio([1.0, 2.0, 3.0], [1.0, 2.0])


def hand_losses(model, mb) -> tuple[float, float]:
    """(token mean, mean over sequences of their token means) of the cross-entropy of ``mb``'s
    targets, by hand in float64 from the logits: position t predicts token t + 1."""
    with torch.no_grad():
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits.double()
    logp, targets = logits[:, :-1].log_softmax(-1), mb.labels[:, 1:]
    mask = targets != -100
    nll = -logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1) * mask
    return float(nll.sum() / mask.sum()), float((nll.sum(1) / mask.sum(1)).mean())


def test_the_users_loop_runs_from_the_command_line_with_the_models_own_loss(tmp_path, monkeypatch):
    """``torch_user`` beside ``torch`` through the CLI (driver and worker argv; the worker in this
    process, no second start-up), 2 steps of 2 micro-batches: the same token counts, and step 1's
    losses (the adapters add nothing yet) as a float64 model gives them by hand: the token mean
    for ``torch_user``'s ``labels=`` loss, the mean over sequences for ``torch``'s."""
    real = subprocess.run

    def in_process(command, **kwargs):  # the worker's command line, run by its own main()
        if "--worker" not in command:
            return real(command, **kwargs)
        return subprocess.CompletedProcess(command, bench_train.main(command[2:]))

    monkeypatch.setattr(bench_train.subprocess, "run", in_process)
    work, out = tmp_path / "work", tmp_path / "out.json"
    assert bench_train.main(["--small", "--variants", "torch_user,torch", "--steps", "2", "--groups-per-micro-batch",
                             "2", "--work-dir", str(work), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {row["variant"]: row for row in report["variants"]}
    assert list(rows) == ["torch_user", "torch"] and rows["torch_user"]["label"] == bench_train.LABELS["torch_user"]
    user, plain = rows["torch_user"], rows["torch"]
    assert user["steps"] == 2 and user["dtype"] == "float32" and user["step_tokens"] == plain["step_tokens"]
    assert ("torch", "torch_user") in {(p["variant"], p["baseline"]) for p in report["paired"]}
    spec = json.loads((work / "spec.json").read_text())
    batches, plan = bench_train.load_plan(spec)
    assert len(plan[0]) == 2  # the step's loss: the mean of its micro-batches' losses
    model = bench_train.load_base_model(spec["model_dir"], "float32", "sdpa").double()
    token_mean, sequence_mean = (sum(v) / 2 for v in zip(*(hand_losses(model, batches.micro_batch(g))
                                                           for g in plan[0])))
    assert user["losses"][0] == pytest.approx(token_mean, rel=1e-5)
    assert plain["losses"][0] == pytest.approx(sequence_mean, rel=1e-5)
    assert abs(token_mean - sequence_mean) > 1e-4 * token_mean  # the two losses are told apart
