"""iga_ds.integrations.hf: the Hugging Face Trainer as an iga-ds run, against plain references.

Real processes (gloo, ZeRO-2 from ds_configs/zero2_fp32.json, DS_ACCELERATOR=cpu): IGATrainer's
LoRA weights after a few AdamW steps equal a single-process plain-PyTorch reference of the same
method on the same batches (iga-ds train's group order, taken from GroupSampler), at 2 ranks with
gradient accumulation and across an epoch boundary (iga, erm, iga with variance: debiased, and
TRL's SFTTrainer where trl is installed); ERM through it equals the plain Trainer's ERM, with
DeepSpeed and without; a resumed run of a method with state equals the uninterrupted one. The
logs carry the per-domain losses (checked against the reference's) and the method's statistics."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dist_helpers import launch
from hf_trainer_worker import DOMAINS, isomer_rows
from tiny_models import sequence_losses, tiny_peft_llama

from iga_ds.errors import DataError
from iga_ds.lora.modules import find_lora_modules
from iga_ds.methods import get_method
from iga_ds.methods.base import ModuleGrads
from iga_ds.train.batching import GroupSampler

WORKER = Path(__file__).resolve().parents[1] / "hf_trainer_worker.py"
IGA = {"method": "iga", "params": {"tau": 0.5, "normalize": "mean"}}
# 2 ranks x 2 micro-batches of 1 group: 4 groups a step; 8 groups make 2 steps an epoch, so 3 cross one
TWO_RANKS = {"iga": {**IGA, "per_micro": 1, "gas": 2, "steps": 3, "groups": 8, "world": 2},
             "erm": {"method": "erm", "per_micro": 1, "gas": 2, "steps": 3, "groups": 8, "world": 2},
             # each domain's groups in two halves: 2 groups a micro-batch, their places' parity
             "debiased": {"method": "iga", "params": {"tau": 0.5, "variance": "debiased"}, "per_micro": 2, "gas": 1,
                          "steps": 2, "groups": 8, "world": 2},
             # TRL's SFTTrainer through IGASFTTrainer (left out by the worker where trl is absent)
             "sft": {**IGA, "per_micro": 1, "gas": 2, "steps": 3, "groups": 8, "world": 2, "sft": True}}
EMA = {"method": "iga", "params": {"tau": 0.5, "variance": "ema", "variance_decay": 0.5},
       "per_micro": 2, "gas": 1, "steps": 4, "groups": 8, "world": 1}
ONE_RANK = {
    "erm_equal": {"method": "erm", "per_micro": 2, "gas": 2, "steps": 2, "groups": 8, "equal_lengths": True,
                  "world": 1},
    "erm_no_deepspeed": {"method": "erm", "per_micro": 2, "gas": 2, "steps": 2, "groups": 8, "equal_lengths": True,
                         "world": 1, "no_deepspeed": True},
    "plain": {"plain": True, "per_micro": 2, "gas": 2, "steps": 2, "groups": 8, "world": 1},
    "ema_whole": {**EMA, "save_steps": 2},
    "ema_resumed": {**EMA, "resume": "ema_whole/checkpoint-2"},
    "ema_resumed_without_state": {**EMA, "resume": "ema_whole/checkpoint-2", "without_method_state": True},
}


def run_launch(tmp_path: Path, scenarios: dict, world: int) -> dict:
    for s in scenarios.values():  # a resume names a folder of an earlier scenario of the launch
        if "resume" in s:
            s["resume"] = str(tmp_path / s["resume"])
    path = tmp_path / "scenarios.json"
    path.write_text(json.dumps(scenarios))
    results = launch(WORKER, world, [str(path), str(tmp_path)], timeout=300)
    failed = "".join(f"--- rank {r} exit {rc}:\n{text[-4000:]}" for r, (rc, text) in enumerate(results) if rc)
    assert not failed, failed
    return torch.load(tmp_path / "results.pt", weights_only=False)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_launch(tmp_path_factory.mktemp("hf2"), json.loads(json.dumps(TWO_RANKS)), world=2)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return run_launch(tmp_path_factory.mktemp("hf1"), json.loads(json.dumps(ONE_RANK)), world=1)


def padded(rows: dict, index: list[int]):
    width = max(len(rows["input_ids"][i]) for i in index)
    ids = torch.zeros(len(index), width, dtype=torch.long)
    labels = torch.full((len(index), width), -100, dtype=torch.long)
    mask = torch.zeros(len(index), width, dtype=torch.long)
    for row, i in enumerate(index):
        n = len(rows["input_ids"][i])
        ids[row, :n], labels[row, :n], mask[row, :n] = (torch.tensor(rows["input_ids"][i]),
                                                         torch.tensor(rows["labels"][i]), 1)
    return ids, mask, labels, torch.tensor([rows["domain_ids"][i] for i in index])


def reference(s: dict) -> tuple[dict, list[list[float]]]:
    """Plain autograd per-domain gradients of each step's whole batch, the method, clipping at 1.0
    and torch AdamW: (LoRA weights, each step's per-domain mean sequence losses)."""
    model = tiny_peft_llama(seed=0)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    method = get_method(s["method"], **s.get("params", {}), **({"seed": 7} if s["method"] == "iga" else {}))
    modules = find_lora_modules(model)
    lora = [p for m in modules for p in (m.lora_A.weight, m.lora_B.weight)]
    rows = isomer_rows(s["groups"], equal_lengths=s.get("equal_lengths", False))
    order = GroupSampler(s["groups"], s["per_micro"] * s["world"] * s["gas"], seed=11)
    domain_losses = []
    for step in range(s["steps"]):
        index = [g * len(DOMAINS) + d for g in order.step_groups(step) for d in range(len(DOMAINS))]
        ids, mask, labels, domains = padded(rows, index)
        losses = sequence_losses(model(input_ids=ids, attention_mask=mask).logits, labels)
        domain_losses.append([float(losses[domains == d].detach().mean()) for d in range(len(DOMAINS))])
        # the means the method takes: per domain, or per (domain, half) as domain + N * half, the half
        # being the parity of the sequence's group's place among the step's groups
        halves = (torch.arange(len(index)) // len(DOMAINS)) % 2
        slots = domains + len(DOMAINS) * halves if method.domain_halves else domains
        per_slot = [losses[slots == k] for k in range(int(slots.max()) + 1)]
        opt.zero_grad(set_to_none=True)
        if method.scope == "loss":
            losses.mean().backward()
        else:
            grads = [torch.autograd.grad(x.mean(), lora, retain_graph=True) for x in per_slot]
            module_grads = [ModuleGrads(m.name, m.index, m.lora_A.weight.detach(), m.lora_B.weight.detach(),
                                        torch.stack([g[2 * i] for g in grads]),
                                        torch.stack([g[2 * i + 1] for g in grads]), m.scaling)
                            for i, m in enumerate(modules)]
            for m, u in zip(modules, method.combine(module_grads, step)):
                m.lora_A.weight.grad, m.lora_B.weight.grad = u.gA.clone(), u.gB.clone()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}, domain_losses


def max_difference(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max(float((got[n] - want[n]).abs().max()) for n in want)


def step_logs(result: dict) -> list[dict]:
    return [entry for entry in result["logs"] if "loss" in entry]


@pytest.mark.parametrize("name", ["iga", "erm", "debiased", "sft"])
def test_two_ranks_of_zero2_give_the_reference_update_and_log_its_domain_losses(two_ranks, name):
    if name == "sft":
        pytest.importorskip("trl", reason="IGASFTTrainer needs trl (pip install 'iga-ds[trl]')")
    want, domain_losses = reference(TWO_RANKS[name])
    got = two_ranks[name]
    assert max_difference(got["params"], want) < 3e-5
    logs = step_logs(got)
    assert [entry["step"] for entry in logs] == list(range(1, TWO_RANKS[name]["steps"] + 1))
    for entry, losses in zip(logs, domain_losses):
        assert [entry[f"loss.{d}"] for d in DOMAINS] == pytest.approx(losses, rel=1e-5)


def test_the_method_statistics_reach_the_trainer_logs(two_ranks):
    iga, erm = step_logs(two_ranks["iga"]), step_logs(two_ranks["erm"])
    assert all(0 < entry["hook.mask_mean"] <= 1 and entry["hook.skipped"] == 0 for entry in iga)
    assert not any("hook.mask_mean" in entry for entry in erm)


def test_erm_through_the_integration_is_the_plain_trainers_erm(one_rank):
    # equal target tokens in every row: the plain Trainer's token mean is the mean over sequences
    assert max_difference(one_rank["erm_equal"]["params"], one_rank["plain"]["params"]) < 1e-6
    losses = [entry["loss"] for entry in step_logs(one_rank["plain"])]
    assert [entry["loss"] for entry in step_logs(one_rank["erm_equal"])] == pytest.approx(losses, rel=1e-5)


def test_without_deepspeed_erm_logs_its_domain_losses_and_trains_as_under_deepspeed(one_rank):
    erm, under_deepspeed = one_rank["erm_no_deepspeed"], one_rank["erm_equal"]
    assert max_difference(erm["params"], under_deepspeed["params"]) < 1e-6
    want = [entry[f"loss.{d}"] for entry in step_logs(under_deepspeed) for d in DOMAINS]
    assert [entry[f"loss.{d}"] for entry in step_logs(erm) for d in DOMAINS] == pytest.approx(want, rel=1e-5)


def test_a_method_that_combines_gradients_needs_deepspeed():
    from iga_ds.config.hook import HookConfig
    from iga_ds.errors import ConfigError
    from iga_ds.integrations.hf import PlainObjective

    with pytest.raises(ConfigError, match="method 'iga' combines per-domain gradients and needs DeepSpeed"):
        PlainObjective(HookConfig(method="iga", domains=DOMAINS))


def test_a_resumed_run_of_a_method_with_state_is_the_whole_run(one_rank):
    whole, resumed = one_rank["ema_whole"], one_rank["ema_resumed"]
    assert whole["method_state_files"] == ["checkpoint-2/method_state_rank00000.safetensors",
                                           "checkpoint-4/method_state_rank00000.safetensors"]
    assert max_difference(resumed["params"], whole["params"]) < 1e-6
    # what makes it so: the moving averages the checkpoint kept
    assert max_difference(one_rank["ema_resumed_without_state"]["params"], whole["params"]) > 1e-3

    def after_the_resume(result):
        return [value for entry in step_logs(result) if entry["step"] > 2
                for value in (entry["step"], entry["loss.a"], entry["hook.mask_mean"])]

    assert after_the_resume(resumed) == pytest.approx(after_the_resume(whole), rel=1e-5)


def test_rows_without_the_layout_are_refused_in_one_line():
    from iga_ds.integrations.hf import IsomerCollator, check_isomer_rows, check_whole_groups

    collate = IsomerCollator(pad_token_id=0, num_domains=3)
    rows = [{"input_ids": [1, 2], "labels": [-100, 2], "domain_ids": d % 3, "group_index": d // 3} for d in range(5)]
    with pytest.raises(DataError, match=r"part of group\(s\) \[1\]"):
        check_whole_groups(collate(rows)["group_index"], 3)
    check_whole_groups(collate(rows[:3])["group_index"], 3)
    with pytest.raises(DataError, match="no 'domain_ids' column.*remove_unused_columns=False"):
        collate([{"input_ids": [1], "labels": [1]}])
    import datasets

    shuffled = datasets.Dataset.from_dict({k: v[::-1] for k, v in isomer_rows(2).items()})
    with pytest.raises(DataError, match="row 0: expected group 0, domain 0"):
        check_isomer_rows(shuffled, 3)


@pytest.mark.parametrize("world, accumulation, per_micro", [(2, 2, 1), (2, 1, 2), (1, 2, 2)])
def test_accelerates_sharding_of_the_sampler_gives_each_rank_iga_ds_trains_groups_and_halves(
        world, accumulation, per_micro):
    """Through accelerate's own BatchSamplerShard: micro-batch i of rank r holds the i-th part of
    GroupSampler's slice of the step for rank r, whole groups in the domains' order, and the
    collator's halves are iga-ds train's (the parity of each group's place in the step)."""
    from accelerate.data_loader import BatchSamplerShard

    from iga_ds.integrations.hf import GroupStepSampler, IsomerCollator

    groups, n = 12, len(DOMAINS)
    sampler = GroupStepSampler(groups, n, per_micro, world, accumulation, seed=5)
    order = GroupSampler(groups, per_micro * world * accumulation, seed=5)
    batches = torch.utils.data.BatchSampler(sampler, per_micro * n, drop_last=False)
    rows = isomer_rows(groups)
    collate = IsomerCollator(pad_token_id=0, num_domains=n)
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        for rank in range(world):
            shard = list(BatchSamplerShard(batches, num_processes=world, process_index=rank))
            assert len(shard) == order.steps_per_epoch * accumulation
            for j, batch in enumerate(shard):
                step, i = divmod(j, accumulation)
                mine = order.rank_groups(epoch * order.steps_per_epoch + step, rank, world)
                want = mine[i * per_micro:(i + 1) * per_micro]
                assert batch == [g * n + d for g in want for d in range(n)]
                halves = collate([{k: v[r] for k, v in rows.items()} for r in batch])["halves"]
                if per_micro % 2 == 0:
                    place = order.rank_halves(rank, world)[i * per_micro:(i + 1) * per_micro]
                    assert halves.tolist() == [h for h in place for _ in range(n)]
