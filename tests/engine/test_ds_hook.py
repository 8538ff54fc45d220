"""The ZeRO hook in real processes (gloo) against a single-process reference without DeepSpeed.

The scenarios share one launch of two ranks (SharedRun), each with its own engine and hook;
the dead rank's test, which kills a process, has a launch of its own."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dist_helpers import launch
from ds_worker import global_batch, make_optimizer
from iga_ds.lora.modules import find_lora_modules
from iga_ds.methods import ModuleGrads, available_methods, get_method
from tiny_models import sequence_losses, tiny_peft_llama

pytestmark = pytest.mark.slow
WORKER = Path(__file__).resolve().parents[1] / "ds_worker.py"

# global batch of 12 sequences (4 groups x 3 domains); sequence i is domain i % 3
EVEN_2x1 = [[[0, 1, 2, 3, 4, 5]], [[6, 7, 8, 9, 10, 11]]]
EVEN_2x2 = [[[0, 1, 2], [3, 4, 5]], [[6, 7, 8], [9, 10, 11]]]
# rank 0 holds domains {0,0,1 | 0,0,1}, rank 1 the rest: unequal per rank, equal overall
UNEVEN_2x2 = [[[0, 3, 1], [6, 9, 4]], [[7, 10, 2], [5, 8, 11]]]


def reference(s: dict, steps=None, norms: list | None = None) -> dict:
    """Plain autograd, same method, torch AdamW; micro-batches only matter for loss-level methods.
    ``norms``: gets each step's gradient norm before clipping, where the scenario clips."""
    model = tiny_peft_llama(seed=0, dropout=0.0)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(params, s)
    method = get_method(s["method"], **s.get("params", {}), seed=7)
    modules = find_lora_modules(model)
    world, gas = len(s["layout"]), s["gas"]
    size = sum(len(m) for r in s["layout"] for m in r)
    for step in steps if steps is not None else range(s["steps"]):
        ids, attn, labels, domains = global_batch(step, size)
        opt.zero_grad(set_to_none=True)
        if method.scope == "loss":
            for rank_layout in s["layout"]:
                for rows in rank_layout:
                    rows = torch.tensor(rows)
                    scale = torch.ones((), requires_grad=True) if method.needs_dummy_scale() else None
                    logits = model(input_ids=ids[rows], attention_mask=attn[rows]).logits
                    if scale is not None:
                        logits = logits * scale
                    loss = method.objective(sequence_losses(logits, labels[rows]), domains[rows], 3, scale)
                    (loss / (world * gas)).backward()
        else:
            losses = sequence_losses(model(input_ids=ids, attention_mask=attn).logits, labels)
            lora = [p for m in modules for p in (m.lora_A.weight, m.lora_B.weight)]
            # the means the method takes: per domain, or per (domain, half) as domain + 3 * half, the
            # half being the parity of the sequence's group (i // 3) among the step's
            slots = domains + 3 * ((torch.arange(size) // 3) % 2) if s.get("halves") else domains
            per_domain = []
            for d in range(int(slots.max()) + 1):
                sel = slots == d
                per_domain.append(torch.autograd.grad(losses[sel].sum() / sel.sum(), lora, retain_graph=True))
            grads = [
                ModuleGrads(m.name, m.index, m.lora_A.weight.detach(), m.lora_B.weight.detach(),
                            torch.stack([g[2 * i] for g in per_domain]),
                            torch.stack([g[2 * i + 1] for g in per_domain]), m.scaling)
                for i, m in enumerate(modules)
            ]
            for m, u in zip(modules, method.combine(grads, step)):
                m.lora_A.weight.grad, m.lora_B.weight.grad = u.gA.clone(), u.gB.clone()
        if s.get("clip", 0.0) > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, s["clip"])
            if norms is not None:
                norms.append(float(norm))
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def run(tmp_path, s, world=2):
    scen = tmp_path / "scenario.json"
    scen.write_text(json.dumps(s))
    out = tmp_path / "out.pt"
    accelerator = {"DS_ACCELERATOR": "cuda"} if s.get("cuda") else {}
    results = launch(WORKER, world, [str(scen), str(out)], extra_env=accelerator)
    for rc, text in results:
        assert rc == 0, text[-4000:]
    return torch.load(out, weights_only=True)


def assert_params_close(got, ref, atol=1e-5):
    assert set(got) == set(ref)
    worst = max((got[k] - ref[k]).abs().max().item() for k in ref)
    assert worst < atol, f"max parameter difference {worst:.3e}"


class SharedRun:
    """Several scenarios run one after the other in one launch of ``world`` processes
    (ds_worker.py given a list): DeepSpeed's import and the process group's start-up, most of
    a scenario's time on a CPU, are paid once. Each scenario still builds its own model, ZeRO
    engine and hook and detaches the hook (ds_worker.run_scenario), as a launch of its own does.

    ``result(name)`` holds a scenario to what ``run`` holds one launch to: every rank finished
    it (its hook detached) and the launch exited 0, unless the launch stopped at a later
    scenario, which then fails with the ranks' output."""

    def __init__(self, tmp_path: Path, scenarios: dict[str, dict], world: int = 2, timeout: float = 540):
        self.names = list(scenarios)
        self.out = tmp_path / "out"
        self.out.mkdir(parents=True)
        batch = tmp_path / "scenarios.json"
        batch.write_text(json.dumps([scenarios[n] for n in self.names]))
        self.world = world
        self.results = launch(WORKER, world, [str(batch), str(self.out)], timeout=timeout)

    def finished(self, index: int) -> bool:
        return all((self.out / f"{index}.rank{r}.done").exists() for r in range(self.world))

    def result(self, name: str) -> dict:
        index = self.names.index(name)
        failed = [(rank, rc, text) for rank, (rc, text) in enumerate(self.results) if rc != 0]
        log = "".join(f"--- rank {rank} exit {rc}:\n{text[-4000:]}" for rank, rc, text in failed)
        assert self.finished(index), f"scenario {name!r} did not finish on every rank\n{log}"
        # a launch that failed after its last scenario (at teardown) fails every scenario, as it would
        # fail a launch of each; one that stopped at a later scenario leaves this one's result whole
        stopped_later = not all(self.finished(i) for i in range(len(self.names)))
        assert not failed or stopped_later, log
        return torch.load(self.out / f"{index}.pt", weights_only=True)


CASES = [
    ("iga", {"tau": 0.5, "normalize": "mean"}, 1, EVEN_2x1, {}),
    ("iga", {"tau": 0.5, "normalize": "snr"}, 2, UNEVEN_2x2, {"overlap_comm": True}),
    # a clip that binds at some steps only: binding at every one (or at none, AdamW undoing a
    # constant factor) it passed a gradient the hook wrote doubled
    ("iga", {"tau": 1.0, "normalize": "mean"}, 2, EVEN_2x2, {"bucket": 200, "clip": 0.8}),
    ("erm", {}, 2, UNEVEN_2x2, {"overlap_comm": True, "bucket": 200}),
    ("erm", {}, 1, EVEN_2x1, {}),
    ("erm_captured", {}, 2, UNEVEN_2x2, {"overlap_comm": True, "bucket": 200}),
    ("pcgrad", {}, 2, UNEVEN_2x2, {}),
    ("sand_mask", {"k": 10.0}, 1, EVEN_2x1, {"overlap_comm": True}),
    ("vrex", {"penalty_weight": 2.0}, 2, EVEN_2x2, {}),
    # ZeRO-0 and ZeRO-1: the capture keeps autograd's plain gradient and the hook overwrites it
    ("iga", {"tau": 0.5, "normalize": "mean"}, 2, EVEN_2x2, {"stage": 0}),
    ("iga", {"tau": 0.5, "normalize": "mean"}, 2, EVEN_2x2, {"stage": 1}),
    # the variance estimators (tests/methods/test_iga_variance.py): ema's averages kept by each module's owner,
    # debiased's per-(domain, half) means captured as 2N slots, over ranks and micro-batches
    ("iga", {"tau": 1.0, "variance": "ema", "variance_decay": 0.5}, 2, UNEVEN_2x2, {"overlap_comm": True}),
    ("iga", {"tau": 1.0, "variance": "debiased"}, 2, UNEVEN_2x2, {"halves": True}),
    ("iga", {"tau": 1.0, "variance": "debiased"}, 1, EVEN_2x1, {"halves": True, "bucket": 200}),
]


CASE_IDS = [f"{c[0]}-gas{c[2]}-{'-'.join(f'{k}{v}' if k == 'stage' else k for k, v in c[4].items()) or 'plain'}"
            + (f"-{c[1]['variance']}" if "variance" in c[1] else "") for c in CASES]


def case_scenario(method, params, gas, layout, extra) -> dict:
    return {"method": method, "params": params, "gas": gas, "layout": layout, "steps": 3, **extra}


def every_method_scenario(name: str) -> dict:
    return {"method": name, "gas": 1, "layout": EVEN_2x1, "steps": 2, "compare_checks": True}


CAPTURED_ERM = {"method": "erm_captured", "params": {}, "gas": 2, "layout": UNEVEN_2x2, "steps": 3}
# IGA at tau = 0 (the mask exactly one): the same layout and schedule as DeepSpeed's ERM case below
IGA_TAU0 = {"method": "iga", "params": {"tau": 0.0}, "gas": 2, "layout": UNEVEN_2x2, "steps": 3,
            "overlap_comm": True, "bucket": 200}
NON_FINITE = {"method": "iga", "params": {}, "gas": 1, "layout": EVEN_2x1, "steps": 2, "nan_step": 0}
# the scenarios of the tests below that need no launch of their own (all but the dead rank's)
SHARED = {
    **{f"case/{i}": case_scenario(*c) for i, c in zip(CASE_IDS, CASES)},
    **{f"method/{name}": every_method_scenario(name) for name in available_methods()},
    "captured_erm": CAPTURED_ERM,
    "iga_tau0": IGA_TAU0,
    "non_finite": NON_FINITE,
}


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> SharedRun:
    """One launch of two ranks for every scenario in SHARED, each test then checks its own."""
    return SharedRun(tmp_path_factory.mktemp("ds-hook-shared"), SHARED)


@pytest.mark.parametrize("case_id,method,params,gas,layout,extra", [(i, *c) for i, c in zip(CASE_IDS, CASES)],
                         ids=CASE_IDS)
def test_two_processes_match_single_process_reference(shared, case_id, method, params, gas, layout, extra):
    s = case_scenario(method, params, gas, layout, extra)
    got = shared.result(f"case/{case_id}")
    if extra.get("stage", 2) > 0:  # ZeRO-0 partitions nothing
        assert got["straddles"], "the test model should have a LoRA tensor cut by the ZeRO partition boundary"
    # IGA's pseudo-inverse (r x r solves on Grams) amplifies the float32 rounding of the two
    # paths' gradient sums a little: 3 AdamW steps of 1e-2 move each parameter by up to 3e-2
    norms: list[float] = []
    assert_params_close(got["params"], reference(s, norms=norms), atol=3e-5 if method == "iga" else 1e-5)
    if "clip" in extra:
        assert min(norms) < extra["clip"] < max(norms), f"clip {extra['clip']} should bind at some of the steps " \
                                                        f"only; the gradient norms were {norms}"
    # methods that combine per-domain gradients own the LoRA factors' gradients under ZeRO-2
    # (backward leaves them to the capture); the others, and other stages, keep the plain path
    owns = get_method(method, **params).needs_domain_gradients and extra.get("stage", 2) == 2
    assert got["owns_gradients"] == owns
    assert got["reused_zeros"] == owns  # and ZeRO-2 is handed persistent zeros for them
    if method == "iga":
        assert 0 < got["stats"][-1]["mask_mean"] <= 1 and got["stats"][-1]["gir"] > 0


@pytest.mark.parametrize("name", available_methods())
def test_every_method_runs_two_steps_under_zero2(shared, name):
    got = shared.result(f"method/{name}")
    assert all(torch.isfinite(v).all() for v in got["params"].values()), name
    assert_checks_agree(got, steps=2)


def assert_checks_agree(got: dict, steps: int) -> None:
    """DeepSpeed's per-tensor NaN/Inf test and gradient norm, replaced by multi-tensor kernels,
    gave DeepSpeed's answers on the same gradients at every step (rank 0's partition)."""
    assert got["fused_checks"] and len(got["checks"]) == steps
    for record in got["checks"]:
        assert record["clean"] == (False, False)
        assert record["nan"] == record["inf"] == record["-inf"] == (True, True)
        fused, own = record["norm"]
        assert fused == pytest.approx(own, rel=1e-6) and own > 0


def test_captured_erm_trains_like_deepspeeds_erm(shared):
    # the reduction once per step must not change the update: DeepSpeed's ERM (the loss-level
    # reference, every micro-batch reduced) and the captured one train the same adapter
    s = CAPTURED_ERM
    got = shared.result("captured_erm")
    assert got["owns_gradients"]
    assert_params_close(got["params"], reference(dict(s, method="erm")))


def test_iga_at_tau_zero_trains_like_deepspeeds_erm(shared):
    # the paper's "tau -> 0 recovers ERM", made exact by the tangent projection: under ZeRO-2 on
    # two ranks, the adapter IGA trains equals the one DeepSpeed's own ERM trains (float32 rounding)
    got = shared.result("iga_tau0")
    deepspeed_erm = shared.result("case/erm-gas2-overlap_comm-bucket")
    assert_params_close(got["params"], deepspeed_erm["params"])
    assert_params_close(got["params"], reference(dict(IGA_TAU0, method="erm", params={})))


def test_non_finite_loss_skips_the_step_on_every_rank(shared):
    s = NON_FINITE
    got = shared.result("non_finite")
    assert got["skipped"] == 1 and got["stats"][0]["skipped"] and not got["stats"][1]["skipped"]
    # the skipped step left no trace: weights and AdamW state are those of a run of step 1 alone
    assert_params_close(got["params"], reference(s, steps=[1]))


def test_dead_rank_makes_the_others_fail_instead_of_hanging(tmp_path):
    scen = tmp_path / "scenario.json"
    scen.write_text(json.dumps({"method": "iga", "gas": 1, "layout": EVEN_2x1, "steps": 1, "die_rank": 1}))
    import time

    t0 = time.time()
    results = launch(WORKER, 2, [str(scen), str(tmp_path / "out.pt")], timeout=200,
                     extra_env={"IGA_DS_TEST_TIMEOUT": "20"})
    assert results[1][0] == 3
    assert results[0][0] != 0, "the surviving rank must exit with an error"
    assert time.time() - t0 < 200
