"""LoRA plumbing: finding the (lora_A, lora_B, scaling) of every PEFT layer, and capturing
per-domain gradients from the one normal backward."""
