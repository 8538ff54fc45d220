"""One rank of a ZeRO run of a tiny PEFT LLaMA with the IGA hook (started by tests/dist_helpers.launch)."""
from __future__ import annotations

import json
import os
import sys

import torch

from tiny_models import sequence_losses, tiny_peft_llama


def global_batch(step: int, size: int, vocab=61, T=10, num_domains=3):
    """The sequences of one optimizer step; sequence i belongs to domain i % num_domains."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, vocab, (size, T), generator=g)
    attn = torch.ones(size, T, dtype=torch.long)
    attn[::4, -2:] = 0
    labels = ids.clone()
    labels[:, :3] = -100
    labels[attn == 0] = -100
    domains = torch.arange(size) % num_domains
    return ids, attn, labels, domains


def ds_config(s: dict, world_size: int) -> dict:
    micro = len(s["layout"][0][0])
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": s["gas"],
        "train_batch_size": micro * s["gas"] * world_size,
        "gradient_clipping": s.get("clip", 0.0),
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {
            "stage": s.get("stage", 2),
            "overlap_comm": s.get("overlap_comm", False),
            "reduce_bucket_size": s.get("bucket", 500_000_000),
            "allgather_bucket_size": s.get("bucket", 500_000_000),
            "contiguous_gradients": True,
        },
        "bf16": {"enabled": s.get("bf16", False)},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def make_optimizer(params, s):
    return torch.optim.AdamW(params, lr=s.get("lr", 1e-2), betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def compare_gradient_checks(optimizer) -> list[dict]:
    """At each step, the hook's multi-tensor overflow test and norm against DeepSpeed's own loops
    on the same gradients: as they are, and with a NaN, +Inf or -Inf put into one element.
    (DeepSpeed tests for overflow only in bf16 and fp16, which it refuses on a CPU; its norm,
    taken at every step, is where both are compared.)"""
    fused_overflow, fused_norm = optimizer.has_overflow_partitioned_grads_serial, optimizer.get_grad_norm_direct
    records: list[dict] = []

    def overflow_both_ways():
        return bool(fused_overflow()), bool(type(optimizer).has_overflow_partitioned_grads_serial(optimizer))

    def checked(gradients, params, norm_type=2):
        record = {"clean": overflow_both_ways(),
                  "norm": (float(fused_norm(gradients, params)),
                           float(type(optimizer).get_grad_norm_direct(optimizer, gradients, params)))}
        target = gradients[len(gradients) // 2].view(-1)
        kept = target[target.numel() // 2].clone()
        for name, value in (("nan", float("nan")), ("inf", float("inf")), ("-inf", float("-inf"))):
            target[target.numel() // 2] = value
            record[name] = overflow_both_ways()
        target[target.numel() // 2] = kept
        records.append(record)
        return fused_norm(gradients, params, norm_type)

    optimizer.get_grad_norm_direct = checked
    return records


def run_scenario(s: dict, out_path: str, rank: int, world: int, timeout: float) -> None:
    """One scenario: a fresh model, engine and hook, ``s["steps"]`` optimizer steps, rank 0
    writes the results to ``out_path``; the hook is detached at the end."""
    import deepspeed

    from iga_ds.engine import HookConfig, attach

    cuda = s.get("cuda", False)
    model = tiny_peft_llama(seed=0, dropout=0.0)
    if cuda:
        model.to(torch.device("cuda", int(os.environ["LOCAL_RANK"])))
    params = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=make_optimizer(params, s),
                                           config=ds_config(s, world))
    cfg = HookConfig(method=s["method"], params=s.get("params", {}), domains=["a", "b", "c"], seed=7,
                    timeout_s=timeout)
    hook = attach(engine, cfg)
    checks = compare_gradient_checks(engine.optimizer) if s.get("compare_checks") else None
    straddles = any(
        getattr(p, "_hp_mapping", None) is not None and p._hp_mapping.lp_fragment_address.numel < p.numel()
        for p in params
    )
    size = sum(len(m) for r in s["layout"] for m in r)
    if s.get("die_rank") == rank:
        os._exit(3)  # a rank that dies before the first boundary
    stats = []
    # variance 'debiased': sequence i is of group i // 3, in half group % 2 of the step's groups
    halves = (torch.arange(size) // 3) % 2 if s.get("halves") else None
    for step in range(s["steps"]):
        ids, attn, labels, domains = (t.to(engine.device) for t in global_batch(step, size))
        for rows in s["layout"][rank]:
            half = halves[torch.tensor(rows)] if halves is not None else None
            rows = torch.tensor(rows, device=engine.device)
            with hook.micro_batch(domains[rows], halves=half):
                scale = hook.dummy_scale()
                logits = engine(input_ids=ids[rows], attention_mask=attn[rows]).logits
                if scale is not None:
                    logits = logits * scale
                losses = sequence_losses(logits, labels[rows])
                if s.get("nan_step") == step and rank == 0:
                    losses = losses * float("nan")
                engine.backward(hook.objective(losses, domains[rows], scale))
            engine.step()
        st = hook.pop_stats()
        stats.append({k: v for k, v in st.items() if k != "modules"})
    from deepspeed.utils import safe_get_full_fp32_param

    # the fp32 master weights (a collective: every rank asks): what the optimizer computed,
    # before rounding to bf16
    state = {}
    for n, p in engine.module.named_parameters():
        if p.requires_grad:
            full = safe_get_full_fp32_param(p)
            state[n] = (full if full is not None else p).detach().float().cpu().clone()
    if rank == 0:
        owns = hook.capture is not None and hook.capture.owns_gradients
        torch.save({"params": state, "stats": stats, "straddles": straddles,
                    "skipped": engine.skipped_steps, "owns_gradients": owns,
                    "checks": checks, "fused_checks": hook.fused_checks,
                    "reused_zeros": owns and hook.reused_zeros}, out_path)
    hook.detach()


def main() -> int:
    """``ds_worker.py SCENARIO.json OUT.pt``: one scenario (a JSON object), rank 0 writes OUT.pt.

    ``ds_worker.py SCENARIOS.json OUT_DIR``: a JSON list of scenarios run one after the other in
    this one process group (DeepSpeed imported and the group started once), each with its own
    model, engine and hook as in a launch of its own. Rank 0 writes OUT_DIR/<i>.pt; every rank
    writes OUT_DIR/<i>.rank<r>.done once scenario i has finished and its hook is detached. A
    scenario that raises ends the process (the others fail at their next collective), leaving
    the later scenarios unrun."""
    import gc

    import deepspeed

    from iga_ds.engine.internals import disable_cpu_shm_comm_op

    scenario_path, out_path = sys.argv[1], sys.argv[2]
    loaded = json.load(open(scenario_path))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    import datetime

    timeout = float(os.environ.get("IGA_DS_TEST_TIMEOUT", "300"))
    scenarios = loaded if isinstance(loaded, list) else [loaded]
    cuda = any(s.get("cuda", False) for s in scenarios)
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:  # as the trainer does: no C++ build of DeepSpeed's shared-memory op (nor a lock left by a killed one)
        disable_cpu_shm_comm_op()
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout))
    if isinstance(loaded, list):
        for i, s in enumerate(scenarios):
            run_scenario(s, os.path.join(out_path, f"{i}.pt"), rank, world, timeout)
            gc.collect()  # the last scenario's engine and hooks gone before the next is built
            open(os.path.join(out_path, f"{i}.rank{rank}.done"), "w").close()
    else:
        run_scenario(loaded, out_path, rank, world, timeout)
    torch.distributed.destroy_process_group()  # a clean exit: no group threads alive at teardown
    return 0


if __name__ == "__main__":
    sys.exit(main())
