"""Finding the LoRA modules of a PEFT model: (lora_A, lora_B, scaling) per adapted layer."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from torch import nn

from iga_ds.errors import ConfigError


@dataclass(frozen=True)
class LoraModule:
    """One adapted layer: dW = scaling * lora_B.weight @ lora_A.weight (out x in).

    Its sizes are read once (the hook asks for them per module at every step, while the
    device waits): LoRA factors keep their shapes, and ZeRO-3, which would empty them, is not
    supported."""

    name: str
    index: int
    lora_A: nn.Linear
    lora_B: nn.Linear
    scaling: float
    layer: nn.Module | None = None  # the PEFT layer that holds the factors (for lora.fused)
    adapter: str = "default"

    @cached_property
    def rank(self) -> int:
        return self.lora_A.weight.shape[0]

    @cached_property
    def in_features(self) -> int:
        return self.lora_A.weight.shape[1]

    @cached_property
    def out_features(self) -> int:
        return self.lora_B.weight.shape[0]

    @cached_property
    def full_rank_cost(self) -> int:
        """out x in: what reconstruction, mask and SVD cost scale with."""
        return self.out_features * self.in_features


def find_lora_modules(model: nn.Module, adapter: str | None = None) -> list[LoraModule]:
    """Every PEFT LoRA linear layer with a trainable adapter, in module order.

    The order is the model's named_modules order, the same on every rank, so the list index
    identifies a module across processes.
    """
    from peft.tuners.lora import LoraLayer

    found: list[LoraModule] = []
    for name, layer in model.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        names = [adapter] if adapter else list(getattr(layer, "active_adapters", ["default"]))
        for ad in names:
            if ad not in layer.lora_A:
                if getattr(layer, "lora_embedding_A", None) and ad in layer.lora_embedding_A:
                    raise ConfigError(f"{name}: LoRA on embeddings is not supported by the engine hook; "
                                      "target linear layers")
                continue
            if getattr(layer, "use_dora", {}).get(ad, False):
                raise ConfigError(f"{name}: DoRA adapters are not supported by the engine hook (use plain LoRA)")
            lora_A, lora_B = layer.lora_A[ad], layer.lora_B[ad]
            if not isinstance(lora_A, nn.Linear) or not isinstance(lora_B, nn.Linear):
                raise ConfigError(f"{name}: only linear LoRA layers are supported, got {type(lora_A).__name__}")
            if lora_A.bias is not None or lora_B.bias is not None:
                raise ConfigError(f"{name}: LoRA with bias is not supported by the engine hook "
                                  "(lora_bias=False)")
            if not lora_A.weight.requires_grad:
                continue
            found.append(LoraModule(f"{name}.{ad}", len(found), lora_A, lora_B, float(layer.scaling[ad]), layer, ad))
    return found
