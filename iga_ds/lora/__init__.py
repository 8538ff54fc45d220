"""LoRA plumbing: finding the (lora_A, lora_B, scaling) of every PEFT layer, capturing
per-domain gradients from the one normal backward, and the fused LoRA layer."""
