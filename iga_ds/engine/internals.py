"""Every use of DeepSpeed's internals, in one place: the seam the rest of iga-ds goes through.

- what the hook needs from an engine, checked once, with messages users can act on;
- writing a full gradient into ZeRO's partitions, leaving the LoRA factors' gradients out of
  backward, and skipping a step as DeepSpeed's own overflow path does;
- optimizer state that does not depend on the world size (for resuming at another size).

The private names used here (``_hp_mapping``, ``setup_buckets``, ``micro_step_id``, ...) are
those of DeepSpeed's ZeRO-1/2 optimizer; the suite exercises each against the installed
DeepSpeed, and ``MIN_DEEPSPEED`` is the oldest release with the public helpers used. DeepSpeed
is imported inside the functions: on a CPU machine ``DS_ACCELERATOR`` must be set before its
first import, which the trainer does when it starts.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from iga_ds.errors import ConfigError
from iga_ds.methods.base import stacked_view

MIN_DEEPSPEED = (0, 15, 3)  # safe_set_full_grad for ZeRO-1/2


def check_engine(engine, needs_domain_gradients: bool) -> None:
    import deepspeed

    version = tuple(int(p) for p in deepspeed.__version__.split("+")[0].split(".")[:3] if p.isdigit())
    if version < MIN_DEEPSPEED:
        raise ConfigError(f"deepspeed {deepspeed.__version__} is too old: the engine hook needs >= 0.15.3")
    stage = engine.zero_optimization_stage()
    if stage == 3:
        raise ConfigError(
            "zero_optimization.stage: 3 is not supported by the engine hook yet (parameters are partitioned); "
            "use 0, 1 or 2"
        )
    if engine.zero_cpu_offload() if hasattr(engine, "zero_cpu_offload") else False:
        raise ConfigError("zero_optimization.offload_optimizer: CPU offload is not supported by the engine hook yet")
    if needs_domain_gradients and engine.fp16_enabled():
        raise ConfigError("fp16.enabled: the engine hook supports bf16 and fp32 (dynamic loss scaling is not "
                          "handled); use bf16")
    if needs_domain_gradients and getattr(engine, "pipeline_parallelism", False):
        raise ConfigError("pipeline parallelism is not supported by the engine hook")


class FullGradWriter:
    """Writes full gradients (the same on every rank) into the optimizer's view of them.

    ZeRO-1/2 keep gradients as fragments of flat partitions. DeepSpeed's tensor-fragment
    mapping locates this rank's fragment of each parameter, and one multi-tensor copy writes
    them all, without communication. ``param.set_full_hp_grad`` (what
    ``deepspeed.utils.safe_set_full_grad`` calls) writes the same fragment one parameter at a
    time and then tests the value for infinities, which waits for the device once per
    parameter: 256 waits a step for LLaMA-2-7B's LoRA factors, most of the boundary's host
    time (docs/results/h100-h200-2026-11-27-evening/). That test only feeds CPU offload's overflow
    tracking; the hook writes finite gradients only (a step with a non-finite one is skipped
    before this), so with offload the per-parameter call stays, and elsewhere it is dropped.
    Without ZeRO the gradient lives in ``param.grad``.

    Where each parameter's fragment sits (its mapping, index and slice) is fixed once ZeRO is
    set up, so it is worked out at the first write and only the fragments themselves, which
    ZeRO makes anew each step, are looked up after: the write runs while the device waits.
    """

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = list(params)
        self._plan: list[tuple] | None = None

    @staticmethod
    def _target(param) -> tuple:
        """(how, param, mapping, index, start, numel): ``fragment`` (one multi-tensor copy),
        ``offload`` (DeepSpeed's per-parameter call), ``none`` (no fragment here) or ``grad``."""
        if not hasattr(param, "_hp_mapping"):
            return ("grad", param, None, 0, 0, 0)
        mapping = param._hp_mapping
        if mapping is None:
            return ("none", param, None, 0, 0, 0)  # this rank holds no fragment of the parameter
        optimizer = getattr(param, "_zero_optimizer", None)
        if getattr(optimizer, "cpu_offload", False) or not hasattr(param, "_index_in_param_group"):
            return ("offload", param, None, 0, 0, 0)
        address = mapping.lp_fragment_address
        return ("fragment", param, mapping, param._index_in_param_group, address.start, address.numel)

    def write(self, values: list[torch.Tensor]) -> None:
        if self._plan is None:
            self._plan = [self._target(p) for p in self.params]
        fragments, pieces = [], []
        for (how, param, mapping, index, start, numel), value in zip(self._plan, values, strict=True):
            if how == "fragment":
                fragments.append(mapping.get_lp_grad_fragment(index))
                # a parameter cut by the partition boundary: its part in this rank's partition
                pieces.append(value if numel == value.numel() else value.reshape(-1).narrow(0, start, numel))
            elif how == "offload":
                param.set_full_hp_grad(value)
            elif how == "grad":
                if param.grad is None:
                    param.grad = value.to(param.dtype).clone()
                else:
                    param.grad.copy_(value)
        if fragments:
            copy_all(fragments, pieces)


def copy_all(targets: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    """``targets[i].copy_(values[i])`` for every i (equal element counts, shapes may differ).

    A batched method's results are views of a few stacks, and ZeRO's fragments of the LoRA
    factors lie one after another in a partition: where both lists, whole or taken every other
    one (each module's A, then its B), are equally spaced views of one storage each
    (:func:`iga_ds.methods.base.stacked_view`), a strided copy per list does it all, without
    an operator per tensor while the device waits for the host; otherwise one multi-tensor
    copy."""
    # every other one first: the hook's results are two stacks, so the whole list never is one
    for parts in ((slice(0, None, 2), slice(1, None, 2)), (slice(None),)):
        pairs = _strided_pairs(targets, values, parts)
        if pairs:
            for target, value in pairs:
                target.copy_(value.reshape(target.shape))
            return
    torch._foreach_copy_(targets, [v.reshape(t.shape) for t, v in zip(targets, values)])


def _strided_pairs(targets: list[torch.Tensor], values: list[torch.Tensor], parts) -> list | None:
    """(target view, value view) per slice in ``parts``, or None as soon as one slice has none
    (the values are looked at first: the targets' walk is spared where they fail)."""
    pairs = []
    for part in parts:
        value = stacked_view(values[part])
        target = None if value is None else stacked_view(targets[part])
        if target is None or target.numel() != value.numel():
            return None
        pairs.append((target, value))
    return pairs


def lora_gradients_can_be_left_out(engine) -> bool:
    """Whether the capture may own the LoRA factors' gradients, so that backward gives them none.

    Checked for ZeRO-2's optimizer, which then fills the factors' partitions with zeros at the
    boundary (the hook writes the method's result over them) but must be told to set up its
    reduction buckets itself (:func:`prepare_backward`). Elsewhere the factors keep their plain
    gradients: correct, only slower.
    """
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    optimizer = engine.optimizer
    return (engine.zero_optimization_stage() == 2 and isinstance(optimizer, DeepSpeedZeroOptimizer)
            and hasattr(optimizer, "setup_buckets") and hasattr(optimizer, "ready_for_gradients"))


def reuse_zero_gradients(optimizer, params: list[torch.nn.Parameter]) -> bool:
    """Hand ZeRO-2 one persistent zero tensor per left-out parameter instead of a new one.

    After every backward, ZeRO-2 gathers each parameter's gradient of its partition
    (``get_all_grad_tensors``) and makes a ``zeros_like`` for each that has none: with the LoRA
    factors left out (:func:`lora_gradients_can_be_left_out`) that is 256 allocations and fills
    per micro-batch for LLaMA-2-7B, about 4 ms of host time each while the device waits (a
    host-bound backward pays it in full). Here those parameters get views of one flat zero
    buffer, zeroed once per call (the boundary's fragments, which the hook's result is written
    into, are views of the same buffer, so a step's values never reach the next). The same
    values as DeepSpeed's; False (nothing changed) where this optimizer has no such method."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not (isinstance(optimizer, DeepSpeedZeroOptimizer) and params
            and callable(getattr(optimizer, "get_all_grad_tensors", None))
            and callable(getattr(optimizer, "get_param_gradient_attribute", None))):
        return False
    # only this rank's partition is ever asked for
    inside = {id(p) for group in getattr(optimizer, "params_in_partition", ()) for p in group}
    params = [p for p in params if id(p) in inside]
    if not params:
        return False
    original = optimizer.get_all_grad_tensors
    accumulation_dtype = optimizer.gradient_accumulation_dtype
    sizes = [p.numel() for p in params]
    flat = torch.zeros(sum(sizes), dtype=accumulation_dtype, device=params[0].device)
    zeros = {id(p): piece.view(p.shape) for p, piece in zip(params, flat.split(sizes))}

    def get_all_grad_tensors(tensor_list, dtype):  # DeepSpeed's signature, which it calls by keyword
        if dtype != accumulation_dtype:
            return original(tensor_list, dtype)
        flat.zero_()
        out = []
        for tensor in tensor_list:
            grad = optimizer.get_param_gradient_attribute(tensor)
            if grad is None:
                grad = zeros.get(id(tensor))
                if grad is None:
                    grad = torch.zeros_like(tensor, dtype=dtype)
            out.append(grad)
        return out

    optimizer.get_all_grad_tensors = get_all_grad_tensors
    return True


def stop_reusing_zero_gradients(optimizer) -> None:
    """Back to DeepSpeed's own ``get_all_grad_tensors`` (the instance attribute removed)."""
    optimizer.__dict__.pop("get_all_grad_tensors", None)


def prepare_backward(optimizer) -> None:
    """ZeRO-2 sets up its reduction buckets (and counts the micro-step) at the first gradient
    a backward produces, and its end-of-backward reduction indexes them. With the LoRA factors
    left out, a backward may produce no gradient at all, so the capture calls this at its first
    backward, where that first gradient would have come (not before forward: the buckets would
    then add to the activations' peak); a no-op when they are already set up."""
    if not optimizer.ready_for_gradients:
        optimizer.setup_buckets()


def skip_optimizer_step(optimizer) -> None:
    """Discard the accumulated gradients as DeepSpeed's own overflow path does, so that the
    engine counts a skipped step: parameters, optimizer state and LR schedule stay put."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if isinstance(optimizer, DeepSpeedZeroOptimizer):
        optimizer.micro_step_id = -1  # INITIAL_MICRO_STEP_ID, as step() sets it
        optimizer.overflow = True
        optimizer.zero_grad(set_to_none=True)
        if hasattr(optimizer, "_release_preflattened_grad_buffers"):
            optimizer._release_preflattened_grad_buffers()
        for k in list(optimizer.averaged_gradients.keys()):
            optimizer.averaged_gradients[k] = None
            optimizer.all_grad_tensors[k] = None
        return
    optimizer.zero_grad(set_to_none=True)


# -- DeepSpeed's per-tensor gradient checks, as multi-tensor kernels ------------------------------
#
# At each step ZeRO-1/2 test every gradient tensor for NaN/Inf (amax, amin, two isfinite, two
# logical ops and an add: about seven kernels a tensor) and then take its norm (a cast, a norm
# and a copy a tensor). For a model whose step is bound by the host, such as a 135M student with
# a LoRA adapter on 120 layers, that is some 2,400 kernel launches a step. One ``_foreach_norm``
# over all the gradients gives both answers: a tensor holds a NaN or an Inf exactly when its
# float64 2-norm is not finite (the squares of finite bf16 or fp32 values cannot overflow
# float64, and a NaN or Inf always reaches the sum).

FUSED_CHECKS = ("has_overflow_partitioned_grads_serial", "get_grad_norm_direct")


def fuse_gradient_checks(optimizer) -> bool:
    """Replace, on this ZeRO-1/2 optimizer only, its per-tensor overflow test and 2-norm with
    multi-tensor versions of the same results; False (nothing changed) where they do not apply
    (another optimizer, CPU offload, model or pipeline parallelism, or a DeepSpeed without them)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not isinstance(optimizer, DeepSpeedZeroOptimizer) or getattr(optimizer, "cpu_offload", True):
        return False
    if getattr(optimizer, "model_parallel_world_size", 2) != 1 or getattr(optimizer, "has_moe_layers", True):
        return False
    if not all(callable(getattr(optimizer, name, None)) for name in FUSED_CHECKS):
        return False
    original_norm = optimizer.get_grad_norm_direct

    def has_overflow_partitioned_grads_serial():
        grads = [g for i in range(len(optimizer.bit16_groups)) for g in (optimizer.averaged_gradients[i] or ())
                 if g is not None]
        invalid = torch.zeros([1], dtype=torch.bool, device=optimizer.device)
        if grads:
            invalid |= ~torch.isfinite(_norms(grads)).all()
        return invalid

    def get_grad_norm_direct(gradients, params, norm_type=2):
        if float(norm_type) != 2.0 or any(getattr(p, "ds_pipe_replicated", False) for p in params):
            return original_norm(gradients, params, norm_type)
        from deepspeed import comm as dist
        from deepspeed.runtime.utils import mask_nan_or_inf_with_val_inplace

        # as DeepSpeed pairs them: the padding tensors dropped, the rest zipped with the parameters
        grads = [g for g, _ in zip((g for g in gradients if not getattr(g, "_zero_padding", False)), params)]
        if grads:
            total = _norms(grads).pow(2).sum().float()
        else:
            total = torch.tensor(0.0, dtype=torch.float32, device=optimizer.device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=optimizer.dp_process_group)
        optimizer._model_parallel_all_reduce(tensor=total, op=dist.ReduceOp.SUM)
        total = total.pow(0.5)
        mask_nan_or_inf_with_val_inplace(total, device=optimizer.device)
        return total

    optimizer.has_overflow_partitioned_grads_serial = has_overflow_partitioned_grads_serial
    optimizer.get_grad_norm_direct = get_grad_norm_direct
    return True


def unfuse_gradient_checks(optimizer) -> None:
    """Back to DeepSpeed's own methods (the instance attributes set above removed)."""
    for name in FUSED_CHECKS:
        optimizer.__dict__.pop(name, None)


def _norms(grads: list[torch.Tensor]) -> torch.Tensor:
    """Each tensor's 2-norm accumulated in float64, as DeepSpeed's own loop takes it."""
    from deepspeed.runtime.zero.utils import get_norm_dtype

    return torch.stack(torch._foreach_norm(grads, 2, dtype=get_norm_dtype()))


def disable_cpu_shm_comm_op() -> None:
    """Skip DeepSpeed's shared-memory all-reduce op on the CPU.

    Training collectives go through gloo; the op only speeds up inference all-reduce and costs
    a C++ build of about a minute on a fresh machine.
    """
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def forget_world_group() -> None:
    """Drop DeepSpeed's cached clone of the world process group.

    DeepSpeed clones the default group once per process (``deepspeed.utils.groups``) and keeps
    the clone after that group is destroyed; a training started after
    ``torch.distributed.destroy_process_group()`` in the same process (a notebook, a script
    running two trainings, ``launch/train.py`` called twice) would otherwise hand the dead
    clone to its first broadcast ("Group ... is not registered").
    """
    from deepspeed.utils import groups

    groups._WORLD_GROUP = None


# -- optimizer state that does not depend on the world size --------------------------------------
#
# DeepSpeed refuses to load ZeRO optimizer partitions saved at a different world size. Each
# checkpoint therefore also keeps every LoRA parameter's full Adam moments, gathered with
# ``deepspeed.utils.safe_get_full_optimizer_state``; on a size change they are written back
# into the new partitions. The write needs DeepSpeed's private link between parameters and
# optimizer-state slices.

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def _trainable(engine):
    return [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]


def save_full_optimizer_state(engine, file: Path, rank: int) -> None:
    """Gather every LoRA parameter's Adam moments to full size (collective); rank 0 writes."""
    from deepspeed.utils import safe_get_full_optimizer_state
    from safetensors.torch import save_file

    tensors = {}
    for name, param in _trainable(engine):
        for key in ADAM_MOMENTS:
            full = safe_get_full_optimizer_state(param, key)
            if full is None:
                return  # not a ZeRO-partitioned optimizer: its own checkpoint suffices
            if rank == 0:
                tensors[f"{name}/{key}"] = full.detach().float().cpu().contiguous()
    if rank == 0:
        groups = engine.optimizer.param_groups
        tmp = file.with_suffix(".tmp")
        save_file(tensors, str(tmp), metadata={"adam_step": str(int(groups[0].get("step", 0)))})
        os.replace(tmp, file)


def load_full_optimizer_state(engine, file: Path) -> None:
    """Set the Adam moments and step of ``file`` into this run's ZeRO partitions."""
    from deepspeed.utils import safe_set_full_optimizer_state
    from safetensors import safe_open

    if not file.is_file():
        raise ConfigError(f"resume: {file} is missing; this checkpoint cannot change the world size")
    zero = engine.optimizer
    opt = zero.optimizer  # the torch AdamW over this rank's flat fp32 partitions
    link = getattr(zero, "_lazy_init_hp_params_optimizer_state", None)
    if link is None:
        raise ConfigError("resume: this DeepSpeed version cannot change the world size on resume (ZeRO-1/2 only)")
    with safe_open(str(file), framework="pt") as f:
        step = int(f.metadata()["adam_step"])
        # A fresh engine has no Adam state yet (torch creates it at the first step) and
        # DeepSpeed links each parameter to its slice of that state only then: create the
        # state the way AdamW would, link, then write the gathered moments into the slices.
        for group in opt.param_groups:
            group["step"] = step
            for flat in group["params"]:
                opt.state[flat] = {
                    "step": torch.tensor(float(step), dtype=torch.float32),
                    "exp_avg": torch.zeros_like(flat, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(flat, memory_format=torch.preserve_format),
                }
        link()
        for name, param in _trainable(engine):
            for key in ADAM_MOMENTS:
                safe_set_full_optimizer_state(param, f.get_tensor(f"{name}/{key}").to(param.device), key)
