"""bench_step.py --profile, and the engine hook's world-size-1 path (no packed all-gather buffer)."""
from __future__ import annotations

import math
import statistics
from types import SimpleNamespace

import pytest
import torch

import bench_step  # bench/ is on the path: pytest's pythonpath option (pyproject.toml)
from iga_ds.methods import get_method
from tiny_models import batch, sequence_losses, tiny_peft_llama


def test_full_collections_are_counted_and_timed_per_block():
    import gc

    with bench_step.FullCollections() as young:
        gc.collect(0)
        gc.collect(1)
    with bench_step.FullCollections() as full:
        gc.collect()
        gc.collect()
    assert (young.count, young.ms) == (0, 0.0)
    assert full.count == 2 and full.ms > 0
    assert young not in gc.callbacks and full not in gc.callbacks


def test_driver_passes_the_profile_options_to_the_workers():
    argv = ["--gpus", "2", "--profile", "prof", "--profile-trace", "--methods", "erm,iga", "--out=x.json"]
    assert bench_step.strip_driver_args(argv) == ["--profile", "prof", "--profile-trace"]
    args = bench_step.parse_args(argv)
    assert args.profile == "prof" and args.profile_trace
    assert bench_step.parse_args([]).profile is None
    with pytest.raises(SystemExit):
        bench_step.parse_args(["--profile-trace"])


def test_method_names_are_checked():
    assert bench_step.check_method("iga_fused") == "iga_fused"
    for bad in ("iga_fused-w4", "sgd", ""):
        with pytest.raises(ValueError):
            bench_step.check_method(bad)
    with pytest.raises(SystemExit):
        bench_step.parse_args(["--methods", "erm,iga_fused-w2"])
    assert bench_step.parse_args(["--methods", "erm,iga_bf16"]).methods == ["erm", "iga_bf16"]


def test_rounds_pool_the_steps_and_profile_only_once():
    argv = ["--gpus", "2", "--rounds", "3", "--profile=prof", "--profile-trace", "--steps", "5"]
    assert bench_step.strip_driver_args(argv) == ["--profile=prof", "--profile-trace", "--steps", "5"]
    assert bench_step.strip_profile_args(bench_step.strip_driver_args(argv)) == ["--steps", "5"]
    with pytest.raises(SystemExit):
        bench_step.parse_args(["--rounds", "0"])

    def result(method, steps, method_ms, peak):  # what a worker reports; 4096 tokens per step, 2 GPUs
        step = statistics.median(steps)
        fwd_bwd = [0.75 * t for t in steps]
        return {"method": method, "step_ms": step, "step_ms_all": steps, "tokens_per_s": 4096 / (step / 1e3),
                "tokens_per_s_per_gpu": 2048 / (step / 1e3), "peak_gib": peak, "method_ms": method_ms,
                "comm_ms": 1.0, "trainable_params": 7, "fwd_bwd_ms": statistics.median(fwd_bwd),
                "fwd_bwd_ms_all": fwd_bwd, "boundary_ms": 0.25 * step, "boundary_ms_all": [0.25 * t for t in steps],
                "full_gc_ms_all": [0.0, step / 100]}

    rounds = [[result("erm", [100.0, 104.0], 0.0, 20.0), result("iga", [120.0, 126.0], 9.0, 21.0)],
              [result("iga", [130.0, 131.0], 11.0, 21.5), result("erm", [110.0, 112.0], 0.0, 20.0)],
              [result("erm", [101.0, 103.0], 0.0, 19.0), result("iga", [121.0, 125.0], 10.0, 21.0)]]
    erm, iga = bench_step.pool_rounds(rounds, ["erm", "iga"])
    assert iga["step_ms_all"] == [120.0, 126.0, 130.0, 131.0, 121.0, 125.0]
    assert iga["step_ms"] == statistics.median(iga["step_ms_all"]) == 125.5
    assert iga["tokens_per_s"] == pytest.approx(4096 / 0.1255) and iga["tokens_per_s_per_gpu"] == pytest.approx(2048 / 0.1255)
    assert iga["rounds"] == [123.0, 130.5, 123.0] and erm["rounds"] == [102.0, 111.0, 102.0]
    assert iga["method_ms"] == 10.0 and iga["peak_gib"] == 21.5 and erm["peak_gib"] == 20.0
    assert iga["fwd_bwd_ms_all"] == [0.75 * t for t in iga["step_ms_all"]]
    assert iga["full_gc_ms_all"] == [0.0, 1.23, 0.0, 1.305, 0.0, 1.23]  # each round's, in the order they ran
    assert iga["fwd_bwd_ms"] == pytest.approx(0.75 * 125.5) and iga["boundary_ms"] == pytest.approx(0.25 * 125.5)
    # the phases against ERM's: capture from forward+backward, the rest of the boundary
    args = SimpleNamespace(micro=4, seq=8, gas=1, rank=2, alpha=4.0, dtype="fp32", tau=0.5, normalize="mean",
                           warmup=1, steps=2, rounds=3, layers=1, hidden=8, config=None, grad_ckpt=False)
    report = bench_step.summarize([erm, iga], {}, args)
    iga_row = report["results"][1]
    assert iga_row["capture_ms"] == pytest.approx(iga["fwd_bwd_ms"] - erm["fwd_bwd_ms"])
    assert iga_row["boundary_other_ms"] == pytest.approx(iga["boundary_ms"] - erm["boundary_ms"] - 10.0 - 1.0)
    assert bench_step.pool_rounds(rounds[:1], ["erm", "iga"]) == rounds[0]


def test_rank_skew_finds_the_last_rank_and_rank_0s_wait_for_it():
    # two steps of three ranks: in the first rank 2 starts 30 ms late, in the second rank 0's
    # forward and backward take 20 ms longer than the others'
    def rank(starts, fwd_bwd, boundary):
        return {"start_s_all": starts, "fwd_bwd_ms_all": fwd_bwd, "boundary_ms_all": boundary,
                "full_gc_ms_all": [0.0, 0.0], "method_ms_all": [10.0, 10.0]}

    ranks = [rank([100.0, 200.0], [500.0, 520.0], [90.0, 40.0]), rank([100.0, 200.0], [500.0, 500.0], [90.0, 60.0]),
             rank([100.030, 200.0], [500.0, 500.0], [60.0, 60.0])]
    skew = bench_step.rank_skew(ranks)
    assert skew["skew_ms_all"] == pytest.approx([30.0, 20.0])
    assert skew["wait_ms_all"] == pytest.approx([30.0, 0.0])  # rank 0 waited in the first step only
    assert skew["boundary_less_wait_ms_all"] == pytest.approx([60.0, 40.0])
    assert [own["lag_ms_all"] for own in skew["per_rank"]] == [pytest.approx(lags) for lags in
                                                              ([0.0, 20.0], [0.0, 0.0], [30.0, 0.0])]
    assert all("start_s_all" not in own and own["method_ms_all"] == [10.0, 10.0] for own in skew["per_rank"])
    # pooled over rounds like the row's own lists: concatenated in the order the rounds ran, rank by rank
    rows = [{"method": "iga", "step_ms": 600.0, "step_ms_all": [590.0, 610.0], "tokens_per_s": 1.0,
             "tokens_per_s_per_gpu": 0.5, "peak_gib": None, "method_ms": 10.0, "comm_ms": 1.0, **part}
            for part in (skew, bench_step.rank_skew(ranks[::-1]))]
    pooled = bench_step.pool_rounds([[rows[0]], [rows[1]]], ["iga"])[0]
    assert pooled["wait_ms_all"] == pytest.approx([30.0, 0.0, 0.0, 20.0])
    assert pooled["per_rank"][2]["lag_ms_all"] == pytest.approx([30.0, 0.0, 0.0, 20.0])
    assert len(pooled["per_rank"]) == 3 and pooled["skew_ms_all"] == pytest.approx([30.0, 20.0, 30.0, 20.0])


def test_profile_summary_of_a_cpu_profile():
    from torch.profiler import ProfilerActivity, profile, record_function

    x = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        for _ in range(3):
            with record_function("forward"):
                y = x @ x
            with record_function("backward"):
                y.relu_().sum()
    summary = bench_step.profile_summary(prof.key_averages(), 0.01, cuda=False, top=5)
    assert summary["wall_ms"] == 10.0 and summary["self_cpu_ms"] > 0 and summary["self_cuda_ms"] == 0
    assert set(summary["ranges"]) == {"forward", "backward"}
    assert summary["ranges"]["forward"]["calls"] == 3 and summary["ranges"]["forward"]["cpu_ms"] > 0
    ops = summary["top_ops"]
    assert 0 < len(ops) <= 5 and all(set(op) == {"name", "calls", "self_cpu_ms", "self_cuda_ms"} for op in ops)
    assert [op["self_cpu_ms"] for op in ops] == sorted((op["self_cpu_ms"] for op in ops), reverse=True)
    assert "aten::mm" in {op["name"] for op in ops}


def _hook_at_world_size_one(implementation: str, dtype: torch.dtype = torch.float32, **settings):
    """A hook on a stand-in ZeRO-0 engine with a plain optimizer (no torch.distributed: world
    size 1; the DeepSpeed internals a ZeRO optimizer needs are tests/engine/test_ds_internals.py's)
    after one captured micro-batch, the model's weights in ``dtype`` (as DeepSpeed's bf16 mode
    casts them); ``settings``: more HookConfig fields."""
    from iga_ds.engine import HookConfig, attach

    model = tiny_peft_llama(seed=0, dtype=dtype)
    engine = SimpleNamespace(module=model, device="cpu", optimizer=SimpleNamespace(step=lambda *a, **k: None),
                             zero_optimization_stage=lambda: 0, fp16_enabled=lambda: False,
                             gradient_accumulation_steps=lambda: 1, global_steps=0)
    config = HookConfig(method="iga", params={"tau": 0.5, "normalize": "mean", "implementation": implementation},
                       domains=["a", "b", "c"], **settings)
    hook = attach(engine, config)
    ids, attn, labels, domains = batch(seed=1)
    with hook.micro_batch(domains):
        loss = hook.objective(sequence_losses(model(input_ids=ids, attention_mask=attn).logits, labels), domains)
        loss.backward()
    return hook


@pytest.mark.parametrize("implementation", ["reference", "batched"])
def test_world_size_one_results_match_the_packed_path(implementation):
    hook = _hook_at_world_size_one(implementation)
    try:
        assert hook.comm.world_size == 1 and hook.owned == hook.modules
        grads = hook._module_grads(hook.comm.start_reduce_scatter_sum(hook.flat_in).wait(), hook.owned, 0, hook.capture.counts)
        results = hook.method.combine(grads, 0)
        # a statistic a method lacks and one it reports as NaN: both dropped
        del results[0].stats["gir"]
        results[1].stats["mask_min"] = math.nan
        direct = hook._results_direct(hook.owned, results), hook._results_stats(hook.owned, results)
        # at world size 1 the packed chunk is the whole gathered buffer
        gathered = hook._pack(hook.owned, results)
        packed = hook._unpack(gathered), hook._unpack_stats(gathered)
        for (gA, gB), (pA, pB), u, m in zip(direct[0], packed[0], results, hook.modules):
            assert gA.shape == (m.rank, m.in_features) and gB.shape == (m.out_features, m.rank)
            assert gA.dtype == pA.dtype == torch.float32 and gB.dtype == pB.dtype
            assert torch.equal(gA, pA) and torch.equal(gB, pB)
            assert gA.data_ptr() == u.gA.data_ptr() and gB.data_ptr() == u.gB.data_ptr()  # not copied
        assert len(direct[0]) == len(packed[0]) == len(hook.modules)
        assert direct[1] == packed[1]
        names = [m.name for m in hook.modules]
        assert "gir" not in direct[1][names[0]] and "mask_min" not in direct[1][names[1]]
        assert set(direct[1][names[2]]) == {"mask_mean", "mask_frac_below_half", "mask_min", "gir", "energy_kept"}
    finally:
        hook.detach()


def test_a_method_failing_on_non_finite_sums_skips_the_step_and_on_finite_ones_raises():
    """The boundary reads no flag before the method: a method that raises (an SVD that does not
    converge) is forgiven only where the sums it was given were not finite."""
    from iga_ds.engine.hook import _Combined
    from iga_ds.engine.phase_clock import PhaseClock

    hook = _hook_at_world_size_one("reference")
    try:
        def fails(modules, step):
            raise RuntimeError("the SVD did not converge")

        def run():
            out = _Combined(PhaseClock(torch.device("cpu")), hook.capture.counts)
            return hook._run_method(hook.flat_in, hook.owned, 0, hook.capture.counts, 0, out), out

        results, out = run()  # finite sums, the real method: flags for the sums and the results
        assert len(results) == len(hook.modules) and not out.failed
        assert [bool(f) for f in out.finite] == [True, True] and not hook._any_rank_bad(out.finite, out.failed)
        hook.method.combine = fails
        with pytest.raises(RuntimeError, match="did not converge"):
            run()
        hook.flat_in[7] = math.nan
        results, out = run()
        assert results == [] and out.failed and [bool(f) for f in out.finite] == [False]
        assert hook._any_rank_bad(out.finite, out.failed)
    finally:
        hook.detach()


@pytest.mark.parametrize("counts", [[2.0, 2.0, 2.0], [1.0, 2.0, 4.0]])
def test_module_grads_are_per_domain_means(counts):
    """One in-place scale for equal counts, per-module scales otherwise: both the plain division."""
    hook = _hook_at_world_size_one("reference")
    try:
        N = hook.num_domains
        sums = hook.flat_in.clone()
        counts = torch.tensor(counts, dtype=torch.float64)
        grads = hook._module_grads(hook.flat_in, hook.owned, 0, counts)
        assert len(grads) == len(hook.modules)
        for g, m in zip(grads, hook.modules):
            off = hook.layout.in_offsets[m.index]
            nA, nB = N * m.rank * m.in_features, N * m.out_features * m.rank
            want_A = sums[off: off + nA].double().view(N, m.rank, m.in_features) / counts.view(-1, 1, 1)
            want_B = sums[off + nA: off + nA + nB].double().view(N, m.out_features, m.rank) / counts.view(-1, 1, 1)
            torch.testing.assert_close(g.gA.double(), want_A, rtol=1e-6, atol=0)
            torch.testing.assert_close(g.gB.double(), want_B, rtol=1e-6, atol=0)
            assert want_A.abs().sum() > 0
            assert torch.equal(g.A, m.lora_A.weight.detach()) and g.A.dtype == torch.float32
    finally:
        hook.detach()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_module_grads_carry_the_dtype_of_the_training(dtype):
    """IGA's precision "auto" follows the weights' dtype, which the float32 factors it gets no longer show."""
    hook = _hook_at_world_size_one("batched", dtype)
    try:
        grads = hook._module_grads(hook.flat_in, hook.owned, 0, hook.capture.counts)
        assert {g.A.dtype for g in grads} == {g.gA.dtype for g in grads} == {torch.float32}
        assert {g.trained_in for g in grads} == {dtype}
        auto = get_method("iga", precision="auto")
        assert auto.precision_for(grads) == ("bf16" if dtype == torch.bfloat16 else "ieee")
    finally:
        hook.detach()


def test_the_hook_freezes_the_collector_while_attached():
    """The model the hook was attached to is out of Python's collections until detach (then
    nothing stays frozen)."""
    import gc

    gc.unfreeze()
    hook = _hook_at_world_size_one("batched")
    try:
        weight = hook.modules[0].lora_A.weight
        assert gc.get_freeze_count() > 0
        assert not any(o is weight for o in gc.get_objects())
    finally:
        hook.detach()
    assert gc.get_freeze_count() == 0
    assert any(o is weight for o in gc.get_objects())


def _finite_one_by_one(tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def test_the_hook_checks_tiled_results_through_their_bases():
    # a method's TiledResults are checked through their bases: a non-finite element written
    # through a module's view is seen, and what the bases hold decides (here a base the stub's
    # results do not even view, so the per-module tensors alone would pass)
    from iga_ds.engine.hook import EngineHook, _Combined
    from iga_ds.engine.phase_clock import PhaseClock
    from iga_ds.methods import ModuleUpdate, TiledResults

    gA, gB = torch.zeros(3, 2, 5), torch.zeros(3, 4, 2)
    tiled = TiledResults([ModuleUpdate(a, b) for a, b in zip(gA.unbind(0), gB.unbind(0))], [gA, gB])
    detached = TiledResults([ModuleUpdate(torch.zeros(2, 5), torch.zeros(4, 2))], [torch.full((3,), math.nan)])

    def verdicts(results):
        hook = SimpleNamespace(method=SimpleNamespace(combine=lambda modules, step: results),
                               _module_grads=lambda *args: [], device=torch.device("cpu"))
        out = _Combined(PhaseClock(torch.device("cpu")), torch.ones(2))
        assert EngineHook._run_method(hook, torch.zeros(4), [object()], 0, torch.ones(2), 0, out) is results
        return [bool(flag) for flag in out.finite]  # the sums', then the results'

    assert verdicts(tiled) == [True, True]
    tiled[1].gB[3, 1] = math.inf
    assert verdicts(tiled) == [True, False]
    assert verdicts(detached) == [True, False]


def test_batched_finiteness_and_float32_copies_match_the_per_tensor_versions():
    from iga_ds.engine.finite import finite_flag as _finite_flag
    from iga_ds.engine.float32_copies import Float32Copies

    def finite(ts):
        flag = _finite_flag(ts, "cpu")
        assert flag.dtype == torch.bool and flag.shape == ()
        return bool(flag)

    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g), torch.randn(2, 2, 2, generator=g)]
    assert finite(tensors) and finite([])
    for bad in (math.nan, math.inf, -math.inf):
        for i in range(len(tensors)):
            t = [x.clone() for x in tensors]
            t[i].view(-1)[1] = bad
            assert not finite(t) and not _finite_one_by_one(t)
    # views of stacks, as a batched method returns them: checked through the stack where they
    # cover it, one by one where they do not (a value outside them must not count)
    for cover in (4, 2):
        for where in range(4):
            stack = torch.randn(4, 3, 5, generator=g)
            stack[where, 1, 2] = math.nan
            views = [*stack.unbind(0)[:cover], torch.randn(3, generator=g)]
            assert finite(views) == _finite_one_by_one(views) == (where >= cover)
    same = Float32Copies(tensors).refresh()  # float32 already: the tensors themselves
    assert all(c.data_ptr() == x.data_ptr() for c, x in zip(same, tensors))
    low = [x.to(torch.bfloat16).requires_grad_() for x in tensors]
    copies = Float32Copies(low)
    first = copies.refresh()
    for got, x in zip(first, low):
        assert got.dtype == torch.float32 and got.shape == x.shape and torch.equal(got, x.detach().float())
    with torch.no_grad():  # an optimizer step changes the factors: the next refresh sees it, same buffer
        low[0].add_(1.0)
    again = copies.refresh()
    assert torch.equal(again[0], low[0].detach().float()) and again[0].data_ptr() == first[0].data_ptr()


def test_float32_copies_of_parameters_back_to_back_in_one_buffer_follow_them():
    # ZeRO lays the trainable bf16 parameters back to back in one flat buffer: one copy of the
    # whole span refreshes them, and it must see every later change, including a parameter
    # moved to other storage (then the copy goes tensor by tensor)
    from iga_ds.engine.float32_copies import Float32Copies

    g = torch.Generator().manual_seed(1)
    shapes = [(4, 6), (6, 4), (3,), (2, 5)]
    flat = torch.randn(sum(math.prod(s) for s in shapes) + 7, generator=g).to(torch.bfloat16)
    params, at = [], 0
    for shape in shapes:
        n = math.prod(shape)
        params.append(torch.nn.Parameter(flat[at: at + n].view(shape)))
        at += n

    def check(copies):
        got = copies.refresh()
        assert len(got) == len(copies.tensors)
        assert all(torch.equal(c, p.detach().float()) for c, p in zip(got, copies.tensors))
        return got

    copies = Float32Copies(params)
    first = check(copies)
    assert copies._source_span() is not None  # the one-copy path is the one under test
    with torch.no_grad():
        flat.mul_(2.0)  # an optimizer step writing the flat buffer
    check(copies)
    params[2].data = torch.randn(3, generator=g).to(torch.bfloat16)  # moved elsewhere
    again = check(copies)
    assert copies._source_span() is None and again[0].data_ptr() == first[0].data_ptr()
    # out of order, or with a gap between two of them: tensor by tensor
    check(Float32Copies(params[1::-1]))
    assert Float32Copies([params[0], params[3]])._source_span() is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_statistics_and_phase_clock_on_cuda():
    """The statistics' copy is queued, not waited for: what is read is the table as it was when
    the copy was queued, even if the device overwrites it afterwards; the clock's marks time
    what the device ran between them."""
    from iga_ds.engine.phase_clock import PhaseClock
    from iga_ds.methods.iga.tiles import StatsTable

    clock = PhaseClock(torch.device("cuda"))
    clock.mark("start")
    torch.cuda._sleep(50_000_000)  # tens of milliseconds of device time on any recent card
    table = torch.arange(6, dtype=torch.float64, device="cuda").view(2, 3)
    stats = StatsTable(["a", "b"], table)
    table.fill_(-1.0)  # queued after the copy
    clock.mark("end")
    columns = [stats.column(j) for j in range(3)]
    assert [dict(c) for c in columns] == [{"a": 0.0, "b": 3.0}, {"a": 1.0, "b": 4.0}, {"a": 2.0, "b": 5.0}]
    seconds = clock.seconds("start", "end")
    assert 0.001 < seconds < 10 and clock.seconds("end", "end") == 0.0


def test_copy_all_matches_a_copy_per_tensor(monkeypatch):
    """The writer's strided copies against one copy_ per pair: fragments of one flat partition
    (A then B per module, of unequal sizes), results as views of two stacks, and lists that no
    view covers."""
    from iga_ds.engine.internals import copy_all

    g = torch.Generator().manual_seed(3)
    M, r, d_in, d_out = 5, 2, 7, 3
    gA, gB = torch.randn(M, r, d_in, generator=g), torch.randn(M, d_out, r, generator=g)
    values = [t for pair in zip(gA.unbind(0), gB.unbind(0)) for t in pair]
    sizes = [t.numel() for t in values]
    loose = [torch.randn(2, 3, generator=g) for _ in range(4)]
    cases = [
        (lambda: list(torch.zeros(sum(sizes)).split(sizes)), values, True),  # two strided copies
        (lambda: list(torch.zeros(M, r * d_in).unbind(0)), list(gA.unbind(0)), True),  # one
        (lambda: [torch.zeros(6, dtype=torch.float64) for _ in loose], loose, False),  # one by one, cast
        (lambda: list(torch.zeros(4, 6).unbind(0))[::-1], loose, False),  # out of order: one by one
    ]
    per_tensor = torch._foreach_copy_
    for make_targets, vals, strided in cases:
        got, want = make_targets(), make_targets()
        with monkeypatch.context() as patch:
            if strided:  # the strided path must be the one taken
                patch.setattr(torch, "_foreach_copy_", None)
            copy_all(got, vals)
        assert torch._foreach_copy_ is per_tensor
        for w, v in zip(want, vals):
            w.copy_(v.reshape(w.shape))
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert all(a.abs().sum() > 0 for a in got)
