"""DeepSpeed configs as the ecosystem writes them: the HF Trainer's, axolotl's and
LLaMA-Factory's ZeRO-2 examples (tests/fixtures/deepspeed/), "auto" resolved from the run YAML,
hjson, the precision checked against model.dtype, `--deepspeed_config`, and a one-line error
naming the key for everything the engine hook cannot run."""
from __future__ import annotations

import copy
import json
import re
import sys
import types
from pathlib import Path

import pytest
import yaml

from iga_ds.errors import ConfigError
from test_train_support import DOMAINS, run_config_dict, tiny_base, write_isomer_jsonl

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "deepspeed"
HF = FIXTURES / "hf_trainer_ds_config_zero2.json"
AXOLOTL = FIXTURES / "axolotl_zero2.json"
LLAMA_FACTORY = FIXTURES / "llamafactory_ds_z2_config.json"
PUBLIC = [HF, AXOLOTL, LLAMA_FACTORY]


def _run(**over):
    """A run config (data path unused: nothing is read) with dotted overrides."""
    from iga_ds.config.run import config_from_dict

    raw = {"method": {"name": "iga"}, "data": {"groups_per_step": 4, "groups_per_micro_batch": 2}}
    for key, value in over.items():
        node = raw
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return config_from_dict(raw)


def _build(run, raw, cpu=False, world=1, accum=2, source="ds.json", run_source="run.yaml", check_model=False):
    from iga_ds.config.deepspeed import build_ds_config

    return build_ds_config(run, raw, world, accum, source, cpu=cpu, run_source=run_source, check_model=check_model)


def _one_line_error(run, raw, **kwargs) -> str:
    with pytest.raises(ConfigError) as err:
        _build(run, raw, **kwargs)
    text = str(err.value)
    assert "\n" not in text
    return text


def _without_offload(path: Path) -> dict:
    from iga_ds.config.deepspeed import load_ds_json

    raw = load_ds_json(str(path))
    raw["zero_optimization"].pop("offload_optimizer", None)
    return raw


# -- the public layouts ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", PUBLIC, ids=lambda p: p.stem)
@pytest.mark.parametrize("dtype, precision", [("float32", None), ("bfloat16", "bf16"), ("float16", "fp16")])
def test_public_zero2_configs_resolve_into_what_deepspeed_accepts(path, dtype, precision):
    from deepspeed.runtime.config import DeepSpeedConfig

    run = _run(**{"model.dtype": dtype, "method.name": "erm" if dtype == "float16" else "iga",
                  "schedule.gradient_clipping": 0.5})
    ds, hook = _build(run, _without_offload(path), accum=2)
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) == \
        (2 * len(DOMAINS), 2, 4 * len(DOMAINS))
    assert ds["gradient_clipping"] == 0.5
    assert ds["bf16"]["enabled"] is (precision == "bf16") and ds["fp16"]["enabled"] is (precision == "fp16")
    assert "optimizer" not in ds and "scheduler" not in ds  # the trainer builds AdamW and its schedule
    assert '"auto"' not in json.dumps(ds)
    parsed = DeepSpeedConfig(ds)
    assert parsed.train_batch_size == 4 * len(DOMAINS) and parsed.gradient_clipping == 0.5
    assert (parsed.bfloat16_config.enabled, parsed.float16_config.enabled) == (precision == "bf16",
                                                                               precision == "fp16")
    assert parsed.zero_optimization_stage == 2


def test_llama_factory_loads_as_published_and_the_offloading_ones_are_refused_by_key():
    from iga_ds.config.deepspeed import load_ds_json

    _build(_run(), load_ds_json(str(LLAMA_FACTORY)))
    for path in (HF, AXOLOTL):
        text = _one_line_error(_run(), load_ds_json(str(path)), source=path.name)
        assert text.startswith(f"{path.name}: zero_optimization.offload_optimizer: device 'cpu' is not supported")
        assert "remove offload_optimizer" in text


def test_the_input_dict_is_not_changed():
    from iga_ds.config.deepspeed import load_ds_json

    raw = load_ds_json(str(LLAMA_FACTORY))
    before = copy.deepcopy(raw)
    _build(_run(), raw)
    assert raw == before


# -- "auto" and the values the run YAML owns ------------------------------------------------------


def test_gradient_clipping_auto_absent_equal_or_an_error_naming_both():
    from iga_ds.config.run import load_run_config

    assert _run().schedule.gradient_clipping == 1.0  # DeepSpeed's shipped configs clip at 1.0
    assert _build(_run(), {})[0]["gradient_clipping"] == 1.0
    assert _build(_run(**{"schedule.gradient_clipping": 0}), {"gradient_clipping": "auto"})[0]["gradient_clipping"] == 0
    assert _build(_run(), {"gradient_clipping": 1})[0]["gradient_clipping"] == 1.0
    text = _one_line_error(_run(), {"gradient_clipping": 0.3})
    assert text == ('gradient_clipping: ds.json sets gradient_clipping: 0.3 and run.yaml schedule.gradient_clipping: '
                    '1.0; set "auto" in ds.json and the value in run.yaml')
    assert "gradient_clipping" in _one_line_error(_run(), {"gradient_clipping": True})
    with pytest.raises(ConfigError, match="schedule.gradient_clipping: expected a non-negative number"):
        load_run_config(None, ["schedule.gradient_clipping=-1"])


def test_an_adamw_block_takes_the_run_yamls_schedule():
    run = _run(**{"schedule.lr": 3e-4})
    auto = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}
    assert "optimizer" not in _build(run, {"optimizer": auto})[0]
    same = {"type": "adamw", "params": {"lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}}
    assert "optimizer" not in _build(run, {"optimizer": same})[0]
    text = _one_line_error(run, {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    assert text.startswith("optimizer.params.lr: ds.json sets 0.001 but run.yaml has schedule.lr: 0.0003; ")
    text = _one_line_error(run, {"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.95]}}})
    assert text.startswith("optimizer.params.betas: ds.json sets [0.9, 0.95] but run.yaml has schedule.betas")
    assert _one_line_error(run, {"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}).startswith(
        "ds.json: optimizer.params.torch_adam: not a setting of iga-ds's AdamW")
    assert _one_line_error(run, {"optimizer": {"type": "Lamb", "params": {}}}).startswith(
        "ds.json: optimizer.type: 'Lamb': iga-ds trains with the AdamW of the run YAML's schedule")


def test_a_warmup_scheduler_block_with_auto_values_stands_for_the_run_yamls_schedule():
    for kind, params in [("WarmupLR", {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}),
                         ("WarmupDecayLR", {"total_num_steps": "auto", "warmup_num_steps": "auto"}),
                         ("WarmupCosineLR", {"total_num_steps": "auto", "warmup_num_steps": "auto"})]:
        assert "scheduler" not in _build(_run(), {"scheduler": {"type": kind, "params": params}})[0]
    text = _one_line_error(_run(), {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}}})
    assert text.startswith("ds.json: scheduler.params.warmup_num_steps: 100; set its values to \"auto\" or remove the "
                           "block: run.yaml's schedule decides the learning rate")
    assert _one_line_error(_run(), {"scheduler": {"type": "OneCycle", "params": {}}}).startswith(
        "ds.json: scheduler.type: 'OneCycle' is not run by iga-ds; remove the block")
    assert _one_line_error(_run(), {"scheduler": {"type": "WarmupLR", "params": {"cycle_momentum": "auto"}}}) \
        .startswith("ds.json: scheduler.params.cycle_momentum: not a parameter of WarmupLR")


# -- precision ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, raw, words", [
    ("float16", {"bf16": {"enabled": True}}, "run.yaml sets model.dtype: float16 but ds.json sets bf16.enabled: true"),
    ("bfloat16", {"fp16": {"enabled": True}},
     "run.yaml sets model.dtype: bfloat16 but ds.json sets fp16.enabled: true"),
    ("bfloat16", {}, "run.yaml sets model.dtype: bfloat16 but ds.json enables neither bf16 nor fp16"),
    ("bfloat16", {"bf16": {"enabled": False}}, "model.dtype: bfloat16 but ds.json enables neither"),
    ("float16", {"bfloat16": {"enabled": True}}, "ds.json sets bfloat16.enabled: true"),
])
def test_model_dtype_and_the_precision_block_must_agree(dtype, raw, words):
    text = _one_line_error(_run(**{"model.dtype": dtype, "method.name": "erm"}), raw)
    assert text.startswith("model.dtype: ") and words in text


def test_a_precision_mismatch_with_a_shipped_config_points_at_the_shipped_bf16_one():
    from iga_ds.config.deepspeed import default_ds_config, load_ds_json
    from iga_ds.config.run import shipped_file

    fp32 = default_ds_config()
    bf16 = _one_line_error(_run(**{"model.dtype": "bfloat16"}), load_ds_json(fp32), source=fp32)
    assert bf16.endswith(f"point deepspeed (or --deepspeed) at the shipped bf16 config, "
                         f"{shipped_file('ds_configs/zero2.json')}, or model.dtype: float32 in run.yaml"), bf16
    fp16 = _one_line_error(_run(**{"model.dtype": "float16", "method.name": "erm"}), load_ds_json(fp32), source=fp32)
    assert "(iga-ds init DIR) and set fp16.enabled" in fp16 and f"in {fp32}" not in fp16


def test_precision_auto_follows_the_model_dtype_and_other_pairs_are_fine():
    bf16 = _build(_run(**{"model.dtype": "bfloat16"}), {"bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}})[0]
    assert (bf16["bf16"]["enabled"], bf16["fp16"]["enabled"]) == (True, False)
    assert _build(_run(**{"model.dtype": "bfloat16"}), {"bf16": {"enabled": True}})[0]["bf16"]["enabled"] is True
    # float32 weights may train in bf16: DeepSpeed casts them
    assert _build(_run(), {"bf16": {"enabled": True}})[0]["bf16"]["enabled"] is True
    both = _one_line_error(_run(), {"bf16": {"enabled": True}, "fp16": {"enabled": True}})
    assert both == "ds.json: bf16.enabled and fp16.enabled are both true; enable one at most"
    assert "bf16.enabled: expected true, false or \"auto\", got 'yes'" in _one_line_error(
        _run(), {"bf16": {"enabled": "yes"}})


def test_fp16_with_a_method_that_captures_gradients_is_refused_when_read():
    raw = {"fp16": {"enabled": "auto"}}
    assert _build(_run(**{"model.dtype": "float16", "method.name": "erm"}), raw)[0]["fp16"]["enabled"] is True
    text = _one_line_error(_run(**{"model.dtype": "float16", "method.name": "iga"}), raw)
    assert text == ("ds.json: fp16.enabled: the engine hook supports bf16 and fp32 with method 'iga' (dynamic loss "
                    "scaling is not handled); use bf16")


def test_half_precision_on_the_cpu_names_where_it_came_from():
    text = _one_line_error(_run(**{"model.dtype": "bfloat16"}), {"bf16": {"enabled": "auto"}}, cpu=True)
    assert text == ('model.dtype: run.yaml sets model.dtype: bfloat16 (which turns bf16.enabled "auto" in ds.json '
                    'on), but this run is on the CPU, where only fp32 trains; use model.dtype: float32 in run.yaml')
    from iga_ds.config.run import shipped_file

    fp32 = shipped_file("ds_configs/zero2_fp32.json")
    assert _one_line_error(_run(), {"bf16": {"enabled": True}}, cpu=True) == (
        "ds.json: bf16.enabled: true, but this run is on the CPU, where only fp32 trains; point deepspeed (or "
        f"--deepspeed) at the shipped fp32 config, {fp32}, or set bf16.enabled: false in ds.json")
    assert _build(_run(), {"bf16": {"enabled": "auto"}}, cpu=True)[0]["bf16"]["enabled"] is False


def _on_the_cpu(run, raw) -> str:
    """The one line the CPU gives, and that a fix it suggests is one the CPU accepts."""
    text = _one_line_error(run, raw, cpu=True)
    assert "this run is on the CPU, where only fp32 trains" in text and "bf16 config" not in text, text
    assert "use bf16" not in text, text
    return text


@pytest.mark.parametrize("dtype, raw", [
    ("float32", {"fp16": {"enabled": True}}),  # fp16 with IGA: it said "use bf16", which the CPU refuses too
    ("float16", {"fp16": {"enabled": "auto"}}),
    ("bfloat16", {}),  # it pointed at the shipped bf16 config, which the CPU refuses too
    ("bfloat16", {"bf16": {"enabled": True}}),
])
def test_on_the_cpu_a_half_precision_is_refused_with_fixes_that_train_there(dtype, raw):
    """Each fix the line names, done as it says, gives a config the CPU accepts."""
    from iga_ds.config.deepspeed import load_ds_json

    text = _on_the_cpu(_run(**{"model.dtype": dtype}), raw)
    if "use model.dtype: float32 in run.yaml" in text:
        dtype = "float32"
    shipped = re.search(r"at the shipped fp32 config, (\S+?\.json)", text)
    if shipped:
        raw = load_ds_json(shipped.group(1))
    assert dtype == "float32" and (shipped or all(b["enabled"] == "auto" for b in raw.values())), text
    _build(_run(**{"model.dtype": dtype}), raw, cpu=True)  # no error


def test_a_model_dtype_given_on_the_command_line_is_named_as_such(tmp_path):
    """Not blamed on the run YAML, which may not set it at all."""
    from iga_ds.config.run import load_run_config

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"method": {"name": "iga"}, "data": {"groups_per_step": 4,
                                                                         "groups_per_micro_batch": 2}}))
    run = load_run_config(path, ["model.dtype=bfloat16"])
    cpu = _on_the_cpu(run, {})
    assert cpu.startswith("model.dtype: the command line sets model.dtype: bfloat16, but ") and \
        cpu.endswith("; use model.dtype=float32 on the command line"), cpu
    gpu = _one_line_error(run, {}, cpu=False)
    assert gpu.startswith("model.dtype: the command line sets model.dtype: bfloat16 but ds.json enables neither"), gpu
    assert str(path) not in gpu and "run.yaml" not in gpu
    from_file = load_run_config(path, ["model={dtype: bfloat16}", "seed=1"])  # a mapping above the key counts
    assert "the command line sets model.dtype" in _one_line_error(from_file, {}, cpu=True)
    path.write_text(yaml.safe_dump({"model": {"dtype": "bfloat16"}}))
    assert _one_line_error(load_run_config(path, ["seed=1"]), {}, cpu=True, run_source=str(path)).startswith(
        f"model.dtype: {path} sets model.dtype: bfloat16, but ")


# -- what the engine hook cannot run --------------------------------------------------------------


@pytest.mark.parametrize("raw, key", [
    ({"zero_optimization": {"stage": 3}}, "zero_optimization.stage: expected 0, 1 or 2, got 3"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
     "zero_optimization.offload_optimizer: device 'nvme'"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, "zero_optimization.offload_param"),
    ({"zero_optimization": {"stage": 2, "cpu_offload": True}}, "zero_optimization.cpu_offload"),
    ({"zero_optimization": "two"}, "zero_optimization: expected an object"),
    ({"amp": {"enabled": True, "opt_level": "O1"}}, "amp.enabled: Apex AMP does not run with ZeRO"),
    ({"elasticity": {"enabled": True}}, "elasticity.enabled"),
    ({"fp16": {"enabled": False, "loss_scale": "auto"}}, 'fp16.loss_scale: "auto" is not resolved'),
])
def test_what_the_engine_hook_cannot_run_is_one_line_naming_the_key(raw, key):
    text = _one_line_error(_run(), raw)
    assert text.startswith(f"ds.json: {key}"), text


@pytest.mark.parametrize("key, value", [("overlap_waves", 2), ("owner_balance", "round_robin"),
                                        ("fused_gradient_checks", False), ("freeze_gc", False)])
def test_a_removed_hook_setting_is_an_unknown_key(key, value):
    # performance switches folded into the hook's one behaviour (docs/HOOK.md)
    from iga_ds.engine import split_config

    text = _one_line_error(_run(), {"zero_optimization": {"stage": 2}, "iga": {key: value}})
    assert f"{key}: unknown key; expected one of: method, params" in text, text
    with pytest.raises(ConfigError, match=rf"^iga\.{key}: unknown key; expected one of: method, params, "):
        split_config({"iga": {key: value}})


def test_reduce_bucket_size_auto_is_hidden_size_squared_as_the_hf_trainer_fills_it(tmp_path):
    from transformers import GPT2Config

    auto = {"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}

    def bucket(**over):
        return _build(_run(**over), auto)[0]["zero_optimization"]["reduce_bucket_size"]

    assert bucket() == 128 * 128  # the built-in base's default shape
    assert bucket(**{"model.tiny": {"hidden_size": 64, "num_heads": 4}}) == 64 * 64
    GPT2Config(n_embd=48, n_layer=1, n_head=2).save_pretrained(tmp_path / "gpt2")  # hidden_size is its n_embd
    assert bucket(**{"model.name_or_path": str(tmp_path / "gpt2")}) == 48 * 48
    # a hub model not in the cache: nothing is downloaded to find out
    text = _one_line_error(_run(**{"model.name_or_path": "iga-ds-tests/never-downloaded"}), auto)
    assert text.startswith('ds.json: zero_optimization.reduce_bucket_size: "auto" is hidden_size x hidden_size'), text
    assert "iga-ds-tests/never-downloaded is not in the Hugging Face cache" in text and "give a number" in text


def test_switched_off_offload_and_amp_are_fine():
    ds = _build(_run(), {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "none"}},
                         "amp": {"enabled": "auto", "opt_level": "auto"}})[0]
    assert ds["zero_optimization"]["stage"] == 1 and "amp" not in ds


# -- keys DeepSpeed does not know -----------------------------------------------------------------


@pytest.mark.parametrize("raw, line", [
    ({"zero_optimisation": {"stage": 2}},
     "ds.json: zero_optimisation: not a key of DeepSpeed {v}; did you mean 'zero_optimization'?"),
    ({"gradient_clip": 1.0}, "ds.json: gradient_clip: not a key of DeepSpeed {v}; did you mean 'gradient_clipping'?"),
    ({"zero_optimization": {"stage": 2, "overlap_com": True}},
     "ds.json: zero_optimization.overlap_com: not a key of DeepSpeed {v}; did you mean 'overlap_comm'?"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"devise": "none"}}},
     "ds.json: zero_optimization.offload_optimizer.devise: not a key of DeepSpeed {v}; did you mean 'device'?"),
    ({"bf16": {"enable": "auto"}}, "ds.json: bf16.enable: not a key of DeepSpeed {v}; did you mean 'enabled'?"),
    ({"fp16": {"enabled": False, "initial_scale_pow": 16}},
     "ds.json: fp16.initial_scale_pow: not a key of DeepSpeed {v}; did you mean 'initial_scale_power'?"),
    ({"optimizer": {"typ": "AdamW"}}, "ds.json: optimizer.typ: not a key of DeepSpeed {v}; did you mean 'type'?"),
    ({"activation_checkpointing": {"partition_activation": True}},
     "ds.json: activation_checkpointing.partition_activation: not a key of DeepSpeed {v}; did you mean "
     "'partition_activations'?"),
])
def test_an_unknown_deepspeed_key_names_the_file_the_key_and_the_nearest_known_one(raw, line):
    from iga_ds.config.ds_keys import deepspeed_version

    assert _one_line_error(_run(), raw) == line.format(v=deepspeed_version())


def test_an_unknown_key_with_no_near_one_is_named_and_a_sections_keys_listed():
    assert _one_line_error(_run(), {"xyzzy": 1}).endswith(": xyzzy: not a key of DeepSpeed " + _version() +
                                                          "; remove it")
    text = _one_line_error(_run(), {"bf16": {"enabled": True, "qqq": 1}})
    assert text.startswith("ds.json: bf16.qqq: not a key of DeepSpeed") and "expected one of: " in text
    assert "check_grad_overflow, enabled, " in text  # DeepSpeed's own bf16 fields


def _version() -> str:
    from iga_ds.config.ds_keys import deepspeed_version

    return deepspeed_version()


def test_the_known_keys_come_from_the_installed_deepspeed():
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from iga_ds.config.ds_keys import known_keys

    known = known_keys()
    assert set(DeepSpeedZeroConfig.model_fields) <= set(known["zero_optimization"])
    assert "stage3_prefetch_bucket_size" in known["zero_optimization"]  # an alias
    assert set(known["bf16"]) == set(DeepSpeedBF16Config.model_fields) == set(known["bfloat16"])
    for key in ("train_batch_size", "gradient_clipping", "steps_per_print", "wall_clock_breakdown",
                "zero_allow_untested_optimizer", "activation_checkpointing", "flops_profiler", "tensorboard",
                "comms_logger", "data_types", "checkpoint", "iga"):
        assert key in known, key
    assert known["iga"] is None  # the hook's own validator checks it


def test_only_public_deepspeed_modules_and_names_are_read_for_keys():
    from iga_ds.config import ds_keys

    names = list(ds_keys.CONSTANT_MODULES)
    for table in (ds_keys.SECTION_MODELS, ds_keys.SECTION_CONSTANTS):
        names += [".".join(pair) for pair in table.values()]
    names += [".".join(pair) for pair in ds_keys.TOP_LEVEL_MODELS]
    assert all(name.startswith("deepspeed.") for name in names)
    assert not [name for name in names if any(part.startswith("_") for part in name.split("."))]


@pytest.mark.parametrize("path", sorted((REPO / "ds_configs").glob("*.json")) + sorted(FIXTURES.glob("*.json")),
                         ids=lambda p: p.name)
def test_every_shipped_and_published_deepspeed_config_has_only_known_keys(path):
    from iga_ds.config.deepspeed import load_ds_json
    from iga_ds.config.ds_keys import check_known_keys

    check_known_keys(load_ds_json(str(path)), path.name)


def test_a_misspelt_method_parameter_is_named_before_the_two_files_are_compared():
    run = _run(**{"method.params": {"tau": 0.5}})
    text = _one_line_error(run, {"iga": {"params": {"tua": 0.5}}})
    assert text.startswith("ds.json: iga.params.tua: method 'iga' has no parameter 'tua'; did you mean 'tau'?"), text
    text = _one_line_error(_run(**{"method.params": {"taau": 0.5}}), {"iga": {"params": {"tau": 0.5}}})
    assert text.startswith("run.yaml: method.params.taau: method 'iga' has no parameter 'taau'; did you mean "), text
    # the JSON's own method decides what its params may be; the two methods then disagree, by name
    text = _one_line_error(run, {"iga": {"method": "erm", "params": {"tau": 0.5}}})
    assert text.startswith("ds.json: iga.params.tau: method 'erm' has no parameter 'tau'"), text
    text = _one_line_error(_run(**{"method.params": {"tau": 0.5}}), {"iga": {"params": {"tau": 0.25}}})
    assert text.startswith("params: run.yaml sets method.params"), text  # both spelt right: a disagreement


def test_a_missing_base_model_is_named_where_this_machine_trains(tmp_path):
    run = _run(**{"model.name_or_path": str(tmp_path / "nowhere")})
    text = _one_line_error(run, {}, check_model=True)
    assert text == (f"run.yaml: model.name_or_path: {str(tmp_path / 'nowhere')!r} is no local folder or file here; "
                    "expected a local model folder, a Hugging Face hub id (org/name or org/name@revision), a .gguf "
                    "file or packaged:NAME")
    (tmp_path / "tok").mkdir()
    text = _one_line_error(_run(**{"model.name_or_path": str(tmp_path / "tok")}), {}, check_model=True)
    assert text == (f"run.yaml: model.name_or_path: {tmp_path / 'tok'} is not a Hugging Face model folder "
                    "(no config.json)")
    _build(run, {})  # a dry run names the machine (cpu): the folder may live only there
    _build(_run(**{"model.name_or_path": "org/not-looked-up"}), {}, check_model=True)  # nothing is downloaded


# -- hjson ----------------------------------------------------------------------------------------


def test_hjson_comments_and_trailing_commas_are_read(tmp_path):
    from iga_ds.config.deepspeed import load_ds_json

    path = tmp_path / "zero2.json"
    path.write_text('{\n  // ZeRO-2, as DeepSpeed reads it\n  "zero_optimization": {"stage": 2,},\n'
                    '  # bf16 follows model.dtype\n  "bf16": {"enabled": "auto"},\n}\n')
    raw = load_ds_json(str(path))
    assert raw == {"zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"}}
    assert _build(_run(**{"model.dtype": "bfloat16"}), raw)[0]["bf16"] == {"enabled": True}


@pytest.mark.parametrize("text, message", [
    ('{\n  "zero_optimization": {\n    "stage": [2\n  }\n}\n', r"^{path}:\d+: not valid JSON or hjson \("),
    ('{\n  "bf16": {"enabled": true}}\n}\n', r"^{path}:\d+: not valid JSON or hjson \(Extra data\)"),
    ('{"gradient_clipping": 1.0, "gradient_clipping": 0.5}', r"^{path}: key 'gradient_clipping' is given twice"),
    ('[1, 2]', r"^{path}: expected a JSON object, got list"),
])
def test_broken_syntax_is_one_line_with_the_file_and_line(tmp_path, text, message):
    import re

    from iga_ds.config.deepspeed import load_ds_json

    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_ds_json(str(path))
    assert re.match(message.format(path=re.escape(str(path))), str(err.value)) and "\n" not in str(err.value)


def test_a_syntax_error_names_its_line(tmp_path):
    from iga_ds.config.deepspeed import load_ds_json

    path = tmp_path / "bad.json"
    path.write_text('{\n  "a": 1,\n  "b": [1, 2,\n  "c": }\n}\n')
    with pytest.raises(ConfigError, match=rf"^{path}:4: "):
        load_ds_json(str(path))


# -- --deepspeed_config ----------------------------------------------------------------------------


@pytest.fixture
def fake_trainer(monkeypatch):
    """The trainer module replaced by one that records the config it is given."""
    seen = []

    def train(cfg, **_):
        seen.append(cfg)
        return types.SimpleNamespace(status="stopped", step=0, total_steps=0, output_dir=cfg.output_dir)

    monkeypatch.setitem(sys.modules, "iga_ds.train.trainer", types.SimpleNamespace(train=train))
    return seen


def _launch_main():
    import importlib.util

    spec = importlib.util.spec_from_file_location("launch_train", REPO / "launch" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.mark.parametrize("flags", [["--deepspeed_config", "{ds}"], ["--deepspeed-config", "{ds}"],
                                   ["--deepspeed", "{ds}"], ["--deepspeed", "--deepspeed_config", "{ds}"],
                                   ["--deepspeed", "{ds}", "--deepspeed_config", "{ds}"]])
def test_deepspeed_config_is_accepted_wherever_deepspeed_is(tmp_path, monkeypatch, fake_trainer, flags):
    from iga_ds.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "hf.json").write_text(HF.read_text())
    run = tmp_path / "run.yaml"
    run.write_text("output_dir: out\n")
    argv = ["--config", str(run), *[f.format(ds="hf.json") for f in flags], "seed=4"]
    assert main(["train", *argv]) == 0
    assert _launch_main()(argv) == 0
    assert [cfg.deepspeed for cfg in fake_trainer] == [str(tmp_path / "hf.json")] * 2
    assert [cfg.seed for cfg in fake_trainer] == [4, 4]


def test_two_different_deepspeed_files_are_an_error(tmp_path, fake_trainer, capsys):
    from iga_ds.cli import main

    run = tmp_path / "run.yaml"
    run.write_text("output_dir: out\n")
    argv = ["--config", str(run), "--deepspeed", "a.json", "--deepspeed_config", "b.json"]
    assert main(["train", *argv]) == 2
    assert capsys.readouterr().err.strip() == ("iga-ds: error: --deepspeed a.json and --deepspeed_config b.json "
                                               "name two files; give one")
    assert _launch_main()(argv) == 2
    assert not fake_trainer


# -- a real run --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_training_steps_with_the_llama_factory_config(tmp_path):
    """LLaMA-Factory's ZeRO-2 config, as published, drives a real CPU run of IGA."""
    import yaml

    from iga_ds.config.run import config_from_dict
    from iga_ds.train.trainer import Trainer

    data = write_isomer_jsonl(tmp_path / "train.jsonl", groups=4, seed=2)
    base = tiny_base(tmp_path, data)
    cfg = config_from_dict(run_config_dict(tmp_path, data, deepspeed=str(LLAMA_FACTORY),
                                           output_dir=str(tmp_path / "out"),
                                           **{"schedule.max_steps": 2, "method.name": "iga"}))
    result = Trainer(cfg, base_model_dir=str(base), quiet=True).run()
    assert result.status == "completed" and result.step == 2
    resolved = yaml.safe_load((tmp_path / "out" / "config.resolved.yaml").read_text())["resolved"]
    ds = resolved["deepspeed_config"]
    assert ds["gradient_clipping"] == 1.0 and ds["bf16"]["enabled"] is False and ds["fp16"]["enabled"] is False
    assert ds["train_batch_size"] == 2 * len(DOMAINS) and ds["zero_optimization"]["round_robin_gradients"] is True
    assert resolved["iga"]["method"] == "iga"
    assert all(rec["loss"] > 0 for rec in result.history)
