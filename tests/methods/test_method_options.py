"""Every registered method takes exactly the options it uses and reports exactly the statistics it
declares. The cases come from the registry: a new method, or a new option, is covered without an
edit here (an option with no example value below fails the test that needs one)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from iga_ds.errors import ConfigError
from iga_ds.methods import ModuleGrads, available_methods, get_method, method_parameters
from iga_ds.methods.iga import method as iga_method
from iga_ds.methods.iga.common import ACTING_DEFAULTS, ACTS_ONLY_WITH
from iga_ds.methods.iga.batched import batched_iga
from iga_ds.methods.iga.options import IGAOptions
from iga_ds.methods.iga.sketch import sketch_keys

REPO = Path(__file__).resolve().parents[2]
METHODS = available_methods()
MODULE_METHODS = [name for name in METHODS if get_method(name).scope == "module"]
# every method's: the hook passes iga.seed to each
UNIVERSAL = {"seed"}
# how the update is computed, not what (test_batched.py holds the paths to one another)
ENGINEERING = {"implementation", "precision"}
# a value other than every method's default, for each option a module-scope method takes
EXAMPLES = {"tau": 0.3, "normalize": "mean", "variance": "ema", "variance_decay": 0.5, "projection": "svd",
            "damping": 0.5, "rank": 2, "svd": "exact", "oversample": 4, "power_iters": 1, "factors": "split",
            "threshold": 0.5, "k": 5.0, "gamma": 2.0}


def options_of(name: str) -> dict:
    return {key: p.default for key, p in method_parameters(name).items()}


def foreign_options(name: str) -> dict:
    """Each option another method takes and ``name`` does not, with that method's default (a
    value valid there)."""
    own, found = options_of(name), {}
    for other in METHODS:
        for key, default in options_of(other).items():
            if key not in own:
                found.setdefault(key, (other, default))
    return found


def modules(seed: int, N: int = 4, r: int = 3) -> list[ModuleGrads]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (d_out, d_in) in enumerate(((12, 10), (9, 14))):  # wider than rank + oversample
        A = torch.randn(r, d_in, generator=g, dtype=torch.float64) * 0.5
        B = torch.randn(d_out, r, generator=g, dtype=torch.float64) * 0.5
        out.append(ModuleGrads(f"m{i}", i, A, B, torch.randn(N, r, d_in, generator=g, dtype=torch.float64),
                               torch.randn(N, d_out, r, generator=g, dtype=torch.float64), 2.0))
    return out


@pytest.mark.parametrize("name", METHODS)
def test_an_option_of_another_method_is_refused_in_one_line(name):
    foreign = foreign_options(name)
    for key, (other, value) in foreign.items():
        with pytest.raises((ConfigError, ValueError)) as err:
            get_method(name, **{key: value})
        message = str(err.value)
        assert "\n" not in message and key in message and name in message, (name, key, other, message)


@pytest.mark.parametrize("name", METHODS)
def test_each_method_takes_each_of_its_options_alone(name):
    assert UNIVERSAL <= set(options_of(name))
    for key, default in options_of(name).items():
        assert type(get_method(name, **{key: default})).name == name


def acting_context(name: str, key: str) -> dict:
    """The other options' values under which ``key`` acts, where ``name`` takes them."""
    own = options_of(name)
    return {other: values[0] for options, other, values in ACTS_ONLY_WITH
            if key in options and other in own and other != key}


def updates(name: str, params: dict) -> list[torch.Tensor]:
    method = get_method(name, **params)  # two steps: a moving average acts from the second
    return [torch.cat([u.gA.flatten(), u.gB.flatten()]) for step in (0, 1) for u in method.combine(modules(step), step)]


@pytest.mark.parametrize("name", MODULE_METHODS)
def test_every_option_a_method_takes_changes_its_update(name):
    """An option taken is one used: at another value (where it acts) the update changes."""
    for key in sorted(set(options_of(name)) - UNIVERSAL - ENGINEERING):
        assert key in EXAMPLES, f"{name} takes {key!r}: give it an example value in EXAMPLES"
        context = acting_context(name, key)
        before, after = updates(name, context), updates(name, {**context, key: EXAMPLES[key]})
        assert any(not torch.equal(a, b) for a, b in zip(before, after)), f"{name}: {key} changes nothing"


def test_an_option_outside_the_setting_it_acts_in_is_refused():
    """Where a method takes an option and the one it acts under, another value of the first is
    refused where the second's value is not the one it acts under."""
    checked = 0
    for name in MODULE_METHODS:
        own = options_of(name)
        for options, other, values in ACTS_ONLY_WITH:
            if other not in own or own[other] in values:
                continue
            for key in (k for k in options if k in own and k in EXAMPLES):
                with pytest.raises(ValueError, match=rf"{key}=.*: acts only with {other} "):
                    get_method(name, **{key: EXAMPLES[key]})
                get_method(name, **{**acting_context(name, key), key: EXAMPLES[key]})
                checked += 1
    assert checked >= 6  # the truncation's five under iga_binary and mean_no_mask, and more
    # the rules compare with the defaults the methods have
    assert all(options_of(name)[key] == default for name in MODULE_METHODS
               for key, default in ACTING_DEFAULTS.items() if key in options_of(name))


@pytest.mark.parametrize("name", MODULE_METHODS)
def test_a_method_reports_exactly_the_statistics_it_declares(name):
    declared = {s.name for s in get_method(name).statistics}
    settings = [{}]
    settings += [{"projection": "svd"}] if "projection" in options_of(name) else []
    settings += [{"implementation": "batched"}] if "implementation" in options_of(name) else []
    for params in settings:
        for update in get_method(name, **params).combine(modules(0), 3):
            assert set(update.stats) == declared, (name, params, set(update.stats) ^ declared)


def test_the_config_reference_lists_exactly_the_options_and_statistics():
    text = (REPO / "docs" / "CONFIG.md").read_text(encoding="utf-8")
    for name in METHODS:
        (row,) = [line for line in text.splitlines() if line.startswith(f"| `{name}` |")]
        params, stats = row.split(" | ")[2:4]  # | name | scope | parameters | statistics | reference |
        assert set(re.findall(r"`(\w+)=", params)) == set(options_of(name)) - UNIVERSAL, name
        assert set(re.findall(r"`([\w<>]+)`", stats)) == {s.name for s in get_method(name).statistics}, name


def test_the_tangent_projection_draws_no_sketch_keys(monkeypatch):
    """The batched path's tangent update is what it was when every step drew keys it never read."""
    mods = modules(0)
    drawn = batched_iga(mods, IGAOptions(), generators=sketch_keys(0, 3, [m.index for m in mods]))

    def no_keys(*args):
        raise AssertionError("sketch keys drawn")

    monkeypatch.setattr(iga_method, "sketch_keys", no_keys)
    for update, (gA, gB, stats) in zip(get_method("iga", implementation="batched").combine(mods, 3), drawn):
        assert torch.equal(update.gA, gA) and torch.equal(update.gB, gB) and dict(update.stats) == dict(stats)
    with pytest.raises(AssertionError, match="sketch keys drawn"):  # the svd projection reads them
        get_method("iga_svd", implementation="batched").combine(mods, 3)


def test_a_record_from_before_iga_svd_reads_as_the_method_it_ran():
    """Runs recorded `projection` and the truncation's options under `iga`; at iga's own values
    they are no setting of the row, and `projection: svd` is one."""
    from iga_ds.methods import runs_by_default

    assert runs_by_default("iga", "projection", "tangent") and runs_by_default("iga", "rank", None)
    assert not runs_by_default("iga", "projection", "svd") and not runs_by_default("iga", "rank", 4)
    assert runs_by_default("iga_svd", "projection", "svd") and runs_by_default("iga_svd", "damping", 0.1)
    assert runs_by_default("iga", "tau", options_of("iga")["tau"]) and not runs_by_default("iga", "tau", 7.0)
    assert not runs_by_default("vrex", "projection", "tangent")  # not of IGA's family: an unknown key
