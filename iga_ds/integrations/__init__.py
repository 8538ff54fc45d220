"""iga-ds where users already train: ``integrations.hf`` turns a Hugging Face ``Trainer`` run
into an iga-ds run (the engine hook on the Trainer's own DeepSpeed engine, whole isomer groups
a step, per-domain losses and the method's statistics in the Trainer's logs), ``integrations.sft``
does the same for TRL's ``SFTTrainer``, and ``integrations.recipe`` builds from a run YAML the
run ``iga-ds train`` would train, for either of them. Nothing here is imported until a user
imports it: ``from iga_ds.integrations.hf import IGATrainer``."""
