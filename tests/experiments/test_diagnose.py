"""`iga-ds diagnose`: the task and cue directions, and what each method's update keeps of them.

The measures are checked against values worked out by hand from the methods' definitions on
gradients built for the purpose (the weight-space map taken by a central difference of
s (B + e gB)(A + e gA), not by the formula the module uses); the per-domain gradients against
one backward over everything; the command end to end on a shrunk built-in base.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
from tiny_models import shrunk_tiny_base_config

from iga_ds.cli import main
from iga_ds.data.domains import DEFAULT_DOMAINS
from iga_ds.data.synth import generate_groups
from iga_ds.errors import ConfigError, DataError, UserError
from iga_ds.experiments import diagnose as dg
from iga_ds.experiments.experiment import ungroup
from iga_ds.experiments.grid import POOLED_DOMAIN
from iga_ds.files import write_jsonl
from iga_ds.methods import ModuleGrads, get_method

R, IN, OUT, N = 2, 4, 4, 3
FRESH = dg.FreshLora(r=2, alpha=4.0, init_b_std=0.1)  # B drawn: both factors have gradients


# -- helpers ---------------------------------------------------------------------------------


def weight_image(A, B, s, gA, gB):
    """s (gB A + B gA), as the exact central difference of the quadratic s (B + e gB)(A + e gA)."""
    e = 0.5
    return (s * ((B + e * gB) @ (A + e * gA) - (B - e * gB) @ (A - e * gA)) / (2 * e)).reshape(-1)


def modules_from(task_A, task_B, cue_A, cue_B, seed=0):
    """One module: no-cue per-domain gradients (task_A/B: N x ...) and cue ones (task + cue)."""
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(R, IN, generator=g, dtype=torch.float64)
    B = torch.randn(OUT, R, generator=g, dtype=torch.float64)
    plain = ModuleGrads("m", 0, A, B, task_A, task_B, 0.5)
    cue = ModuleGrads("m", 0, A, B, task_A + cue_A, task_B + cue_B, 0.5)
    return [cue], [plain]


def shares(result, space, label):
    row = result[space]["methods"][label]
    return row["task"], row["cue"]


# -- the measures, by hand -------------------------------------------------------------------


def test_erm_keeps_both_directions_exactly_and_a_method_equal_to_erm_keeps_them_too():
    g = torch.Generator().manual_seed(1)
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    cue, plain = modules_from(rand(N, R, IN), rand(N, OUT, R), rand(N, R, IN), rand(N, OUT, R))
    methods = dg.build_methods(["erm_captured"])
    result = dg.measure(cue, plain, methods)
    for space in dg.SPACES:
        assert shares(result, space, "erm") == (1.0, 1.0)
        assert shares(result, space, "erm_captured") == pytest.approx((1.0, 1.0), rel=1e-12)
        assert result[space]["methods"]["erm_captured"]["size"] == pytest.approx(1.0, rel=1e-12)
    # cos(U_erm, t) with U_erm = t + c, every term rebuilt here in the weight space
    m, p = cue[0], plain[0]
    t = weight_image(m.A, m.B, 0.5, p.gA.mean(0), p.gB.mean(0))
    c = weight_image(m.A, m.B, 0.5, m.gA.mean(0), m.gB.mean(0)) - t
    u = t + c
    assert result["weight"]["methods"]["erm"]["cos_task"] == pytest.approx(float(u @ t / u.norm() / t.norm()), rel=1e-9)
    assert result["weight"]["directions"]["cos_task_cue"] == pytest.approx(float(t @ c / t.norm() / c.norm()), rel=1e-9)


def test_a_variance_mask_cannot_tell_apart_two_directions_every_domain_shares():
    """Every domain has the same task and the same cue gradient: SAND-mask sees no variance, so it
    keeps each non-zero element whole and scales by 1/kept (the kept share is 6 of 8 elements in
    each factor here): task and cue are kept alike, 4/3 of ERM's, and neither spreads."""
    g = torch.Generator().manual_seed(2)
    tA, tB, cA, cB = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((R, IN), (OUT, R)) * 2)
    for x in (tA, cA):
        x[0, :2] = 0.0  # two of the eight elements of A, and of B, are zero in every gradient
    for x in (tB, cB):
        x[:2, 0] = 0.0
    expand = lambda x: x.expand(N, *x.shape).clone()  # noqa: E731
    cue, plain = modules_from(expand(tA), expand(tB), expand(cA), expand(cB))
    result = dg.measure(cue, plain, dg.build_methods(["sand_mask"]))
    for space in dg.SPACES:
        task, kept_cue = shares(result, space, "sand_mask")
        assert task == pytest.approx(8 / 6, rel=1e-9) and kept_cue == pytest.approx(8 / 6, rel=1e-9)
        assert result[space]["directions"]["task_spread"] == pytest.approx(0.0, abs=1e-12)
        assert result[space]["directions"]["cue_spread"] == pytest.approx(0.0, abs=1e-12)


def test_a_cue_whose_sign_varies_across_domains_is_masked_and_the_shared_task_is_kept():
    """Task gradient the same in every domain on elements T, cue gradient on elements C apart
    from T, 3, -1 and 1 times a pattern in the three domains (signs agree on 1/3 of domains,
    below SAND-mask's tau 1/2): the mask keeps T whole and drops C, so U = t / kept."""
    g = torch.Generator().manual_seed(3)
    tA, tB = torch.zeros(R, IN, dtype=torch.float64), torch.zeros(OUT, R, dtype=torch.float64)
    pA, pB = torch.zeros_like(tA), torch.zeros_like(tB)
    tA[0] = torch.rand(IN, generator=g, dtype=torch.float64) + 0.5  # T: row 0 of A, column 0 of B
    tB[:, 0] = -(torch.rand(OUT, generator=g, dtype=torch.float64) + 0.5)
    pA[1] = torch.rand(IN, generator=g, dtype=torch.float64) + 0.5  # C: the other row and column
    pB[:, 1] = torch.rand(OUT, generator=g, dtype=torch.float64) + 0.5
    scale = torch.tensor([3.0, -1.0, 1.0], dtype=torch.float64).view(N, 1, 1)
    expand = lambda x: x.expand(N, *x.shape).clone()  # noqa: E731
    cue, plain = modules_from(expand(tA), expand(tB), scale * pA, scale * pB)
    result = dg.measure(cue, plain, dg.build_methods(["sand_mask"]))
    kept = 0.5  # half the elements of each factor are in T
    task, kept_cue = shares(result, "factor", "sand_mask")
    assert task == pytest.approx(1 / kept, rel=1e-9) and kept_cue == 0.0
    m = cue[0]
    t, c = weight_image(m.A, m.B, 0.5, tA, tB), weight_image(m.A, m.B, 0.5, pA, pB)  # c: the mean, 1 x pattern
    u = t / kept
    expected = (float(u @ t / ((t + c) @ t)), float(u @ c / ((t + c) @ c)))
    assert shares(result, "weight", "sand_mask") == pytest.approx(expected, rel=1e-9)
    # the cue's per-domain deviations are 2, -2 and 0 times its mean: spread sqrt(8/3); the task's none
    for space in dg.SPACES:
        assert result[space]["directions"]["cue_spread"] == pytest.approx(math.sqrt(8 / 3), rel=1e-9)
        assert result[space]["directions"]["task_spread"] == pytest.approx(0.0, abs=1e-12)


# -- records and method specs ----------------------------------------------------------------


def test_the_no_cue_twin_loses_exactly_its_cue_sentence():
    rec = generate_groups(1, seed=5, shortcut=0.9)[0]
    cue = rec["meta"]["cue"]
    twin = dg.without_cue(rec)
    assert cue in rec["problem"] and cue not in twin["problem"]
    assert twin["problem"] == rec["problem"].replace(cue, "", 1).strip()
    assert twin["cot"] == rec["cot"] and twin["answer"] == rec["answer"] and rec["meta"]["cue"] == cue
    with pytest.raises(DataError, match="not in its problem"):
        dg.without_cue({**rec, "problem": rec["problem"].replace(cue, "")})
    with pytest.raises(DataError, match="no meta.cue"):
        dg.without_cue(generate_groups(1, seed=5)[0])


def test_method_specs_go_through_the_registry():
    spec = dg.parse_method("iga:tau=0.25,normalize=mean")
    assert (spec.name, spec.params) == ("iga", {"tau": 0.25, "normalize": "mean"})
    assert list(dg.build_methods(["sand_mask", "iga:tau=0.25"])) == ["erm", "sand_mask", "iga:tau=0.25"]
    with pytest.raises(ConfigError, match="no parameter 'nonsense'"):
        dg.build_methods(["iga:nonsense=1"])
    with pytest.raises(UserError, match="changes the loss"):
        dg.build_methods(["irm"])
    with pytest.raises(UserError, match="given twice"):
        dg.build_methods(["sand_mask", "sand_mask"])
    with pytest.raises(UserError, match="split in two halves"):  # the diagnostic gives one mean per domain
        dg.build_methods(["iga:variance=debiased"])
    with pytest.raises(UserError, match="KEY=VALUE"):
        dg.parse_method("iga:tau")


# -- on a model ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A shrunk built-in base (seconds to pretrain), and records with a planted cue."""
    import os

    from iga_ds.train.pretrain import default_tiny_base

    root = tmp_path_factory.mktemp("diagnose")
    os.environ["IGA_DS_CACHE"] = str(root / "cache")  # the suite's own; put back after the test
    base = default_tiny_base(shrunk_tiny_base_config(), groups=10, progress=False, log=lambda msg: None)
    data = root / "cue.jsonl"
    write_jsonl(data, generate_groups(3, seed=11, shortcut=0.9))
    return str(base), str(data)


def test_per_domain_gradients_agree_with_one_backward_over_everything(tiny):
    base, data = tiny
    source = dg.resolve_source(base)
    model, modules, tok = dg.load_model(source, FRESH, device="cpu")
    from iga_ds.data.prompts import prompt_format
    from iga_ds.train.batching import pad_rows, sequence_losses

    groups, _ = dg.twin_groups(data, 3, None)
    rows = dg.encode_domains(groups, tok, prompt_format(tok), 512)
    per_domain = dg.domain_gradients(model, modules, rows, tok.pad_token_id, batch_size=2)  # 2 + 1 per domain
    everything = [r for domain_rows in rows for r in domain_rows]
    mb = pad_rows(everything, [0] * len(everything), tok.pad_token_id)
    sequence_losses(model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits, mb.labels).mean().backward()
    for m, (gA, gB) in zip(modules, per_domain):
        assert gA.abs().max() > 0 and gB.abs().max() > 0
        torch.testing.assert_close(gA.mean(0), m.lora_A.weight.grad, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(gB.mean(0), m.lora_B.weight.grad, rtol=1e-4, atol=1e-7)


RUN_DOMAINS = ["science", "math", "medical", "legal"]  # a run's order, not the sorted one


def test_a_run_trained_ungrouped_is_measured_on_the_datas_domains(tiny):
    _, data = tiny
    groups, order = dg.twin_groups(data, 2, [POOLED_DOMAIN])  # what an ERM-SFT run's settings name
    assert order == sorted(RUN_DOMAINS) == sorted({r["domain"] for g in groups for r in g})
    assert [[r["domain"] for r in g] for g in groups] == [order, order]


@pytest.fixture(scope="module")
def run_folder(tiny, tmp_path_factory):
    """A run folder as training leaves it: the adapter (a fresh one, B drawn) with its tokenizer,
    and config.resolved.yaml naming the base and the domains."""
    import yaml

    base, _ = tiny
    model, _, tok = dg.load_model(dg.resolve_source(base), FRESH, device="cpu")
    run = tmp_path_factory.mktemp("run")
    model.save_pretrained(str(run / "adapter"))
    tok.save_pretrained(str(run / "adapter"))
    resolved = {"base_model_dir": base, "prompt_format": "plain", "iga": {"domains": RUN_DOMAINS}}
    (run / "config.resolved.yaml").write_text(yaml.safe_dump({"model": {"name_or_path": "builtin:tiny"},
                                                              "data": {"max_length": 512}, "resolved": resolved}))
    return str(run)


def test_the_command_on_a_run(tiny, run_folder, tmp_path, capsys):
    base, data = tiny
    out = tmp_path / "diag.json"
    rc = main(["diagnose", "--run", run_folder, "--data", data, "--groups", "2", "--method", "sand_mask",
               "--method", "erm_captured", "--method", "iga:tau=0.25", "--batch-size", "3", "--device", "cpu",
               "--no-progress", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    labels = ["erm", "sand_mask", "erm_captured", "iga:tau=0.25"]
    assert [m["label"] for m in result["methods"]] == labels and set(result["weight"]["methods"]) == set(labels)
    rows = [line.split()[0] for line in printed.splitlines() if line.split() and line.split()[0] in labels]
    assert rows == labels + labels  # the gradients' rows, then the updates', in the order given
    # an adapter saved without optimizer state: the optimizer's update is AdamW's first step
    after = result["after_optimizer"]
    assert after["optimizer"] == {"optimizer": "adamw", "step": 0, "betas": [0.9, 0.999], "eps": 1e-8,
                                  "gradient_clipping": 1.0, "state": None, "moments": "zero"}
    assert "after the optimizer (adamw, step 1, zero moments)" in printed
    for space in dg.SPACES:
        assert shares(after, space, "erm") == (1.0, 1.0)
        assert shares(after, space, "erm_captured") == pytest.approx((1.0, 1.0), rel=1e-5)
    assert result["source"]["kind"] == "run" and result["data"] == {"path": data, "groups": 2, "domains": RUN_DOMAINS}
    assert result["methods"][3] == {"label": "iga:tau=0.25", "method": "iga", "params": {"tau": 0.25}}
    for space in dg.SPACES:
        assert shares(result, space, "erm") == (1.0, 1.0)
        assert shares(result, space, "erm_captured") == pytest.approx((1.0, 1.0), rel=1e-5)
        d = result[space]["directions"]
        assert d["task_norm"] > 0 and d["cue_norm"] > 0  # the twins' gradients differ from the cue records'
    assert len(result["modules"]) == result["num_modules"] == 4  # q, k, v, o of the one layer
    assert not list(tmp_path.glob(".*"))  # written under a temporary name, then renamed
    # the same adapter drawn afresh on the bare base: the same directions (their norms and spreads
    # do not depend on the order of the domains), so the run's adapter and tokenizer were the ones read
    fresh = dg.diagnose(dg.Settings(base, data, 2, [], str(tmp_path / "fresh.json"), batch_size=3, device="cpu",
                                    fresh=FRESH, progress=False), log=lambda msg: None)
    for space in dg.SPACES:
        assert fresh[space]["directions"] == pytest.approx(result[space]["directions"], rel=1e-5)
    # a fresh adapter's settings for a run that has its own: refused, before the model loads
    capsys.readouterr()
    assert main(["diagnose", "--run", run_folder, "--data", data, "--groups", "1", "--lora-r", "2",
                 "--out", str(tmp_path / "no.json")]) == 2
    assert "has its own adapter" in capsys.readouterr().err and not (tmp_path / "no.json").exists()


@pytest.mark.parametrize("args, says", [
    (["--data", "missing.jsonl"], "missing.jsonl"),
    (["--method", "iga:nonsense=1"], "nonsense"),
    (["--groups", "0"], "--groups 0"),
    (["--data", "NOCUE"], "no meta.cue"),
    (["--data", "POOLED"], "at least 2"),  # an ungrouped row's records: one domain, nothing to compare
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, says):
    no_cue = tmp_path / "plain.jsonl"
    write_jsonl(no_cue, generate_groups(2, seed=1))
    argv = {"--run": "builtin:tiny", "--data": str(tmp_path / "ok.jsonl"), "--groups": "1",
            "--out": str(tmp_path / "d.json")}
    write_jsonl(tmp_path / "ok.jsonl", generate_groups(2, seed=1, shortcut=0.9))
    pooled = tmp_path / "pooled.jsonl"
    write_jsonl(pooled, ungroup(generate_groups(2, seed=1, shortcut=0.9), DEFAULT_DOMAINS))
    for key, value in zip(args[::2], args[1::2]):
        argv[key] = {"NOCUE": str(no_cue), "POOLED": str(pooled)}.get(value, value)
    rc = main(["diagnose", *[x for kv in argv.items() for x in kv]])
    err = capsys.readouterr().err
    assert rc == 2 and says in err
    assert len(err.strip().splitlines()) == 1 and err.startswith("iga-ds: error:")
    assert not (tmp_path / "d.json").exists()
