"""TRL's ``SFTTrainer`` as an iga-ds run: :class:`IGASFTTrainer` (needs ``trl``: ``pip install 'iga-ds[trl]'``).

The rows are :func:`iga_ds.integrations.hf.isomer_dataset`'s, already tokenized with the loss on
the completion, so TRL's own preparation is skipped (``dataset_kwargs={"skip_prepare_dataset":
True}``); TRL's packing and padding-free batches are refused, since they drop each row's domain.
Everything else is :class:`iga_ds.integrations.hf.IGATrainerMixin`'s."""
from __future__ import annotations

from trl import SFTTrainer

from iga_ds.errors import ConfigError
from iga_ds.integrations.hf import IGATrainerMixin


def check_sft_config(args) -> None:
    """The SFTConfig settings the isomer rows need, each refused in one line."""
    if args is None:
        raise ConfigError("IGASFTTrainer: args: expected an SFTConfig with "
                          "dataset_kwargs={'skip_prepare_dataset': True} and remove_unused_columns=False")
    if not (args.dataset_kwargs or {}).get("skip_prepare_dataset", False):
        raise ConfigError("SFTConfig.dataset_kwargs: expected {'skip_prepare_dataset': True} (the rows come "
                          "tokenized from isomer_dataset, with their group and domain)")
    for name in ("packing", "padding_free"):
        if getattr(args, name, False):
            raise ConfigError(f"SFTConfig.{name}: expected False (it would drop each sequence's domain)")


class IGASFTTrainer(IGATrainerMixin, SFTTrainer):
    """TRL's ``SFTTrainer`` whose run is an iga-ds run of ``iga``'s method (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        check_sft_config(kwargs.get("args", args[1] if len(args) > 1 else None))
        super().__init__(*args, **kwargs)
