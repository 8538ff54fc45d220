"""docs/INTEGRATIONS.md's scripts (the Trainer's, TRL's SFTTrainer's where trl is installed, and the
recipe's of a run YAML), run as written (one real process, ZeRO-2 on the CPU) on a tiny chat model,
a JSON Lines file of conversational isomer rows and a run YAML of isomer records: each trains IGA,
logs the per-domain losses and the method's statistics, and saves the adapter."""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from dist_helpers import launch
from test_train_support import run_config_dict, write_isomer_jsonl

REPO = Path(__file__).resolve().parents[2]
DOMAINS = ["math", "medical", "legal", "science"]
TURNS = ("{% for m in messages %}<s>{{ 'Q' if m['role'] == 'user' else 'A' }}\n{{ m['content'] }}</s>\n"
         "{% endfor %}{% if add_generation_prompt %}<s>A\n{% endif %}")


# runs each script given as it would run on its own (one process: the libraries load once)
RUNNER = """import os, runpy, sys
for script, out in zip(sys.argv[1::2], sys.argv[2::2]):
    os.environ["OUT"] = out
    runpy.run_path(script, run_name="__main__")
    print(f"=== {script} done", flush=True)
"""


def documented_script(name: str) -> str:
    text = (REPO / "docs" / "INTEGRATIONS.md").read_text(encoding="utf-8")
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if b.startswith(f"# {name}")]
    assert len(blocks) == 1, f"docs/INTEGRATIONS.md: expected one python block starting '# {name}'"
    return blocks[0]


def tiny_chat_model(folder: Path, texts: list[str]) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from iga_ds.train.model import build_vocab, build_word_tokenizer

    tokenizer = build_word_tokenizer(build_vocab(texts))
    tokenizer.chat_template = TURNS
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)


def recipe_run_yaml(tmp_path: Path, model: Path) -> tuple[Path, list[str]]:
    """The run YAML the recipe's script reads (IGA, 2 steps, on the tiny chat model), and its records' texts."""
    import yaml

    records = write_isomer_jsonl(tmp_path / "isomers.jsonl", groups=4, seed=1)
    config = run_config_dict(tmp_path, records, output_dir=str(tmp_path / "iga_ds"), **{
        "model.name_or_path": str(model), "method": {"name": "iga", "params": {"tau": 0.5}},
        "schedule.max_steps": 2})
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    texts = [json.loads(line)[key] for line in records.read_text().splitlines() for key in ("problem", "cot", "answer")]
    return tmp_path / "run.yaml", texts


def test_the_documented_scripts_train_iga_and_log_domain_losses(tmp_path):
    rows = [{"group_id": g, "domain": d,
             "messages": [{"role": "user", "content": f"{d} problem {g}: what is {g} plus {g}"},
                          {"role": "assistant", "content": f"the answer is {2 * g}"}]}
            for g in range(8) for d in DOMAINS]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_yaml, record_texts = recipe_run_yaml(tmp_path, tmp_path / "model")
    tiny_chat_model(tmp_path / "model", [m["content"] for r in rows for m in r["messages"]] + record_texts)
    names = ["train_iga_hf.py", "train_iga_recipe.py"] + (["train_iga_sft.py"] if importlib.util.find_spec("trl")
                                                           else [])
    args = []
    for name in names:
        (tmp_path / name).write_text(documented_script(name))
        args += [str(tmp_path / name), str(tmp_path / name.removesuffix(".py"))]
    (tmp_path / "runner.py").write_text(RUNNER)
    env = {"MODEL": str(tmp_path / "model"), "DATA": str(tmp_path / "train.jsonl"), "MAX_STEPS": "10",
           "DS_CONFIG": str(REPO / "ds_configs" / "zero2_fp32.json"), "RUN_YAML": str(run_yaml)}
    [(rc, output)] = launch(tmp_path / "runner.py", 1, args, timeout=240, extra_env=env)
    assert rc == 0, output[-4000:]
    parts = re.split(r"=== \S+ done\n", output)  # each script's output, in order
    assert len(parts) == len(names) + 1, output[-4000:]
    for name, part in zip(names, parts):  # the progress callback prints each log: the last step's has them
        assert all(key in part for key in ("'loss.math'", "'loss.science'", "'hook.mask_mean'")), part[-3000:]
        assert (tmp_path / name.removesuffix(".py") / "adapter_model.safetensors").is_file()
    if "train_iga_sft.py" not in names:
        pytest.skip("the SFTTrainer script needs trl (pip install 'iga-ds[trl]'); the Trainer's ran")
