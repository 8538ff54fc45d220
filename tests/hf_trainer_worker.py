"""One rank of Hugging Face Trainer runs of a tiny PEFT LLaMA under DeepSpeed ZeRO-2 (started by
tests/dist_helpers.launch): IGATrainer with a method, or the plain Trainer, each scenario in its
own output folder; rank 0 writes every scenario's LoRA weights and log history."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import torch

from tiny_models import tiny_peft_llama

ROOT = Path(__file__).resolve().parent.parent
DOMAINS = ["a", "b", "c"]
PROMPT = 3  # masked tokens at the start of every row


def isomer_rows(num_groups: int, seed: int = 0, equal_lengths: bool = False) -> dict[str, list]:
    """Token rows of whole groups, group by group in the domains' order (isomer_dataset's layout);
    lengths vary unless ``equal_lengths`` (then every row has the same number of target tokens)."""
    g = torch.Generator().manual_seed(seed)
    columns: dict[str, list] = {"input_ids": [], "labels": [], "domain_ids": [], "group_index": []}
    for group in range(num_groups):
        for d in range(len(DOMAINS)):
            length = 10 if equal_lengths else int(torch.randint(6, 12, (1,), generator=g))
            ids = torch.randint(0, 61, (length,), generator=g).tolist()
            columns["input_ids"].append(ids)
            columns["labels"].append([-100] * PROMPT + ids[PROMPT:])
            columns["domain_ids"].append(d)
            columns["group_index"].append(group)
    return columns


def training_args(s: dict, out: Path, **over):
    """TrainingArguments of a scenario (TRL's SFTConfig for ``sft``, which skips TRL's own tokenization)."""
    from transformers import TrainingArguments

    from iga_ds.config.hook import split_config

    arguments = TrainingArguments
    if s.get("sft"):
        from trl import SFTConfig

        arguments = SFTConfig
        # SFTConfig's own defaults where they differ: fp32 and no checkpointing, as the reference
        over = {"dataset_kwargs": {"skip_prepare_dataset": True}, "bf16": False, "gradient_checkpointing": False,
                **over}
    ds, _ = split_config(json.loads((ROOT / "ds_configs" / "zero2_fp32.json").read_text()))
    settings = dict(output_dir=str(out), per_device_train_batch_size=s["per_micro"] * len(DOMAINS),
                    gradient_accumulation_steps=s["gas"], max_steps=s["steps"], learning_rate=1e-2,
                    lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0, logging_steps=1,
                    save_strategy="steps" if s.get("save_steps") else "no", save_steps=s.get("save_steps") or 500,
                    report_to=[], deepspeed=ds, seed=11, remove_unused_columns=False, disable_tqdm=True,
                    dataloader_num_workers=0)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        over = {"accelerator_config": {"use_configured_state": True}, **over}
        gloo_state_for_deepspeed()
    return arguments(**{**settings, **over})


def gloo_state_for_deepspeed() -> None:
    """Accelerate's process state under DeepSpeed on a machine without CUDA: it finds no backend
    there and would count one process, so the state is set up with gloo first, afresh for each
    scenario (TrainingArguments then keeps it: ``use_configured_state``)."""
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # as TrainingArguments sets it around its own
    try:
        PartialState(backend="gloo")
    finally:
        del os.environ["ACCELERATE_USE_DEEPSPEED"]


def lora_state(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}


def run_iga(s: dict, out: Path) -> dict:
    import datasets

    from iga_ds.integrations.hf import IGATrainer

    data = datasets.Dataset.from_dict(isomer_rows(s["groups"], equal_lengths=s.get("equal_lengths", False)))
    iga = {"method": s["method"], "params": s.get("params", {}), "domains": DOMAINS, "seed": 7}
    args = training_args(s, out, **({"deepspeed": None} if s.get("no_deepspeed") else {}))
    if s.get("sft"):
        from iga_ds.integrations.sft import IGASFTTrainer
        from iga_ds.train.model import build_vocab, build_word_tokenizer

        trainer = IGASFTTrainer(model=tiny_peft_llama(seed=0), args=args, train_dataset=data, iga=iga,
                                processing_class=build_word_tokenizer(build_vocab([])))
    else:
        trainer = IGATrainer(model=tiny_peft_llama(seed=0), args=args, train_dataset=data, iga=iga)
    resume = s.get("resume")
    if resume and s.get("without_method_state"):  # the same checkpoint, less the method's state
        copy = out.with_name(out.name + "-checkpoint")
        shutil.copytree(resume, copy, ignore=shutil.ignore_patterns("method_state_rank*"))
        resume = str(copy)
    trainer.train(resume_from_checkpoint=resume)
    saved = sorted(str(p.relative_to(out)) for p in out.glob("checkpoint-*/method_state_rank*"))
    return {"params": lora_state(trainer.model), "logs": trainer.state.log_history, "method_state_files": saved}


def run_plain(s: dict, out: Path) -> dict:
    """The plain Trainer (the model's own token-mean loss), fed the rows in IGATrainer's order."""
    import datasets
    from transformers import Trainer, default_data_collator

    from iga_ds.integrations.hf import GroupStepSampler

    rows = isomer_rows(s["groups"], equal_lengths=True)
    order = list(GroupStepSampler(s["groups"], len(DOMAINS), s["per_micro"], 1, s["gas"], 11))
    data = datasets.Dataset.from_dict({"input_ids": [rows["input_ids"][i] for i in order],
                                       "labels": [rows["labels"][i] for i in order]})
    args = training_args(s, out, train_sampling_strategy="sequential")
    trainer = Trainer(model=tiny_peft_llama(seed=0), args=args, train_dataset=data,
                      data_collator=default_data_collator)
    trainer.train()
    return {"params": lora_state(trainer.model), "logs": trainer.state.log_history}


def main() -> int:
    scenarios = json.loads(Path(sys.argv[1]).read_text())
    out_dir = Path(sys.argv[2])
    results = {}
    for name, s in scenarios.items():
        if s.get("sft") and importlib.util.find_spec("trl") is None:
            continue  # the test skips it
        run = run_plain if s.get("plain") else run_iga
        results[name] = run(s, out_dir / s.get("folder", name))
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(results, out_dir / "results.pt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
