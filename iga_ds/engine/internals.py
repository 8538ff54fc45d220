"""Every use of DeepSpeed's internals, in one place: the seam the rest of iga-ds goes through.

- what the hook needs from an engine, checked once at attach (:func:`check_engine`): every
  private attribute, method and signature used below that this engine's optimizer must have.
  A missing or changed one stops the run with one line naming the installed DeepSpeed and the
  attribute, never a quieter path that would train something else;
- the optimizer's ``step`` wrapped by the hook, and restored;
- writing a full gradient into ZeRO's partitions, and reading back, from where the optimizer's
  step reads it, that the step will use what was written (:meth:`FullGradWriter.write`'s check,
  a test by behaviour where the attach check sees names only); leaving the LoRA factors' gradients out of
  backward, skipping a step as DeepSpeed's own overflow path does, and DeepSpeed's per-tensor
  gradient checks as multi-tensor kernels;
- optimizer state that does not depend on the world size (for resuming at another size), and
  the AdamW whose step DeepSpeed's elastic checkpoint can save;
- DeepSpeed's globals the trainer resets, and the op builders ``iga-ds selfcheck`` probes.

The private names used here (``_hp_mapping``, ``setup_buckets``, ``micro_step_id``, ...) are
those of DeepSpeed's ZeRO-1/2 optimizer; ``tests/engine/test_ds_internals.py`` removes each in turn
from a real engine. ``TESTED_DEEPSPEED`` is the range pyproject.toml allows (a test holds the
two together). DeepSpeed is imported inside the functions: on a CPU machine ``DS_ACCELERATOR``
must be set before its first import, which the trainer does when it starts.
"""
from __future__ import annotations

import inspect
import os
import re
from pathlib import Path
from typing import Callable

import torch

from iga_ds.errors import ConfigError, UserError
from iga_ds.methods.device_copies import stacked_view

# the oldest and the newest release tested: pyproject.toml's bounds on deepspeed
TESTED_DEEPSPEED = ((0, 17, 6), (0, 19, 8))
MIN_DEEPSPEED = TESTED_DEEPSPEED[0]


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


def deepspeed_mismatch(what: str) -> UserError:
    """The one line that stops a run whose DeepSpeed lacks, or changed, an internal used here."""
    import deepspeed

    low, high = map(_dotted, TESTED_DEEPSPEED)
    return UserError(f"deepspeed {deepspeed.__version__}: {what} is missing or changed, and the engine hook "
                     f"relies on it; install a deepspeed iga-ds is tested with ({low} to {high})")


# -- what the hook relies on, checked at attach ----------------------------------------------------
#
# Each entry: (object, attribute, how a user reads it). A method's parameters are checked where
# the hook calls it by keyword or replaces it with a function of the same signature.

SIGNATURES = {
    "get_grad_norm_direct": ("gradients", "params", "norm_type"),
    "get_all_grad_tensors": ("tensor_list", "dtype"),
}
# DeepSpeedZeroOptimizer's, by what for: the step the hook wraps; a step skipped as DeepSpeed's
# overflow path skips it; the multi-tensor gradient checks (and whether they apply)
ZERO_STEP = ("step", "zero_grad", "micro_step_id", "overflow", "averaged_gradients", "all_grad_tensors")
ZERO_CHECKS = ("cpu_offload", "model_parallel_world_size", "has_moe_layers", "bit16_groups", "device",
               "dp_process_group", "_model_parallel_all_reduce", "has_overflow_partitioned_grads_serial",
               "get_grad_norm_direct")
# ZeRO-2 with the LoRA factors' gradients left out of backward, and persistent zeros for them
ZERO2_OWNED = ("setup_buckets", "ready_for_gradients", "get_all_grad_tensors", "get_param_gradient_attribute",
               "params_in_partition", "gradient_accumulation_dtype")
# BF16_Optimizer's (ZeRO-1 in bf16 with fp32 accumulation, and ZeRO-0 under pipelines)
BF16_STEP = ("step", "zero_grad", "overflow", "clear_hp_grads")
# each LoRA factor's link to its fragment of ZeRO's flat partitions (None where this rank holds
# none of it); where it holds one, the factor's place among its partition's gradients, and the
# fragment's address and gradient
PARAM_LINK = "_hp_mapping"
IN_PARTITION = "_index_in_param_group"
FRAGMENT = ("lp_fragment_address", "get_lp_grad_fragment")
# where each kind's step reads the gradients it steps with: the lists of them per param group, and
# the parameters those lists follow (the write's check reads there, not through the fragment link)
READ_BACK = {"zero": ("averaged_gradients", "params_in_partition"), "bf16": ("fp32_groups_gradient_dict",
                                                                           "bf16_groups")}


def optimizer_kind(optimizer) -> str:
    """``zero`` (DeepSpeed's ZeRO-1/2 optimizer), ``bf16`` (its BF16_Optimizer: the parameters
    linked to fp32 partitions as ZeRO's are) or ``plain`` (any other: gradients in param.grad)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if isinstance(optimizer, DeepSpeedZeroOptimizer):
        return "zero"
    return "bf16" if isinstance(optimizer, BF16_Optimizer) else "plain"


def required_internals(engine, params: list[torch.nn.Parameter], owns_gradients: bool) -> list[tuple]:
    """(object, attribute, name) of every internal the hook will use on this engine:
    ``params`` are the LoRA factors it writes (none for a method that captures nothing),
    ``owns_gradients`` whether backward leaves their gradients to the capture."""
    import deepspeed.runtime.utils as runtime_utils
    import deepspeed.runtime.zero.utils as zero_utils

    optimizer = engine.optimizer
    kind = optimizer_kind(optimizer)
    label = type(optimizer).__name__
    found = [(optimizer, "step", f"{label}.step")]
    if kind == "zero":
        names = ZERO_STEP + ZERO_CHECKS + (ZERO2_OWNED if owns_gradients else ())
        found += [(optimizer, n, f"{label}.{n}") for n in names]
        found += [(runtime_utils, "mask_nan_or_inf_with_val_inplace", "deepspeed.runtime.utils."
                   "mask_nan_or_inf_with_val_inplace"), (zero_utils, "get_norm_dtype",
                                                         "deepspeed.runtime.zero.utils.get_norm_dtype")]
    elif kind == "bf16":
        found += [(optimizer, n, f"{label}.{n}") for n in BF16_STEP]
    if kind != "plain" and params:
        found += [(optimizer, n, f"{label}.{n}") for n in READ_BACK[kind]]
    if kind != "plain":
        for p in params:
            found.append((p, PARAM_LINK, f"the LoRA parameter's {PARAM_LINK}"))
            mapping = getattr(p, PARAM_LINK, None)
            if mapping is not None:
                found.append((p, IN_PARTITION, f"the LoRA parameter's {IN_PARTITION}"))
                found += [(mapping, n, f"the LoRA parameter's {PARAM_LINK}.{n}") for n in FRAGMENT]
    return found


def check_internals(engine, params: list[torch.nn.Parameter], owns_gradients: bool) -> None:
    """Raise :func:`deepspeed_mismatch` for the first internal of :func:`required_internals`
    this engine lacks, or whose parameters changed."""
    for obj, name, label in required_internals(engine, params, owns_gradients):
        if not hasattr(obj, name):
            raise deepspeed_mismatch(label)
        expected = SIGNATURES.get(name)
        if expected and list(inspect.signature(getattr(obj, name)).parameters)[:len(expected)] != list(expected):
            raise deepspeed_mismatch(f"{label} with parameters ({', '.join(expected)})")


def check_engine(engine, needs_domain_gradients: bool, params: list[torch.nn.Parameter] = ()) -> None:
    """What the hook supports of this engine, then every internal it will use (one line each)."""
    import deepspeed

    version = tuple(int(p) for p in deepspeed.__version__.split("+")[0].split(".")[:3] if p.isdigit())
    if version < MIN_DEEPSPEED:
        raise UserError(f"deepspeed {deepspeed.__version__} is too old: the engine hook needs >= "
                        f"{_dotted(MIN_DEEPSPEED)}")
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
    kind = optimizer_kind(engine.optimizer)
    if stage > 0 and kind == "plain":
        raise UserError(f"deepspeed {deepspeed.__version__}: zero_optimization.stage {stage} made a "
                        f"{type(engine.optimizer).__name__}, not one whose gradients the engine hook knows how to "
                        "write (DeepSpeedZeroOptimizer, BF16_Optimizer)")
    check_internals(engine, list(params), needs_domain_gradients and lora_gradients_can_be_left_out(engine))


def wrap_step(optimizer, boundary: Callable) -> Callable:
    """Make ``boundary`` the optimizer's ``step``, which DeepSpeed's engine calls at each
    accumulation boundary; returns the step it replaces, for ``boundary`` to call and for
    :func:`unwrap_step`."""
    original = optimizer.step
    optimizer.step = boundary
    return original


def unwrap_step(optimizer, original: Callable) -> None:
    """Undo :func:`wrap_step`: the class's own ``step`` again where that was the one replaced."""
    own = getattr(type(optimizer), "step", None)
    if own is not None and original == own.__get__(optimizer, type(optimizer)):
        vars(optimizer).pop("step", None)
    else:
        optimizer.step = original


class FullGradWriter:
    """Writes full gradients (the same on every rank) into the optimizer's view of them.

    ZeRO-1/2 (and BF16_Optimizer) keep gradients as fragments of flat partitions. DeepSpeed's
    tensor-fragment mapping locates this rank's fragment of each parameter, and one
    multi-tensor copy writes them all, without communication. ``param.set_full_hp_grad`` (what
    ``deepspeed.utils.safe_set_full_grad`` calls) writes the same fragment one parameter at a
    time and then tests the value for infinities, which waits for the device once per
    parameter: 256 waits a step for LLaMA-2-7B's LoRA factors. That test only feeds CPU offload's
    overflow tracking, and the hook refuses CPU offload at attach. Only a plain optimizer
    (ZeRO-0 in fp32) reads ``param.grad``: under ZeRO a gradient written there is dropped, so
    a parameter without its link (checked at attach) is an error, never that path.

    Where each parameter's fragment sits (its mapping, index and slice) is fixed once ZeRO is
    set up, so it is worked out at the first write and only the fragments themselves, which
    ZeRO makes anew each step, are looked up after: the write runs while the device waits.
    """

    def __init__(self, params: list[torch.nn.Parameter], optimizer):
        self.params = list(params)
        self.optimizer = optimizer
        self.kind = optimizer_kind(optimizer)
        self.fragments = self.kind != "plain"
        self._plan: list[tuple] | None = None
        self._places: dict[int, tuple[int, int]] | None = None  # id(param) -> (group, index), for the check

    def _target(self, param) -> tuple:
        """(how, param, mapping, index, start, numel): ``fragment`` (one multi-tensor copy),
        ``none`` (this rank holds no fragment of it) or ``grad``."""
        if not self.fragments:
            return ("grad", param, None, 0, 0, 0)
        mapping = param._hp_mapping
        if mapping is None:
            return ("none", param, None, 0, 0, 0)
        address = mapping.lp_fragment_address
        return ("fragment", param, mapping, param._index_in_param_group, address.start, address.numel)

    def write(self, values: list[torch.Tensor], check: bool = False) -> tuple[torch.Tensor, float] | None:
        """Write ``values`` (one full gradient per parameter). ``check``: also return, as a device
        scalar, how far what the optimizer's step will read is from what was written, and the
        tolerance (:meth:`written_difference`); None otherwise."""
        if self._plan is None:
            self._plan = [self._target(p) for p in self.params]
        fragments, pieces, written = [], [], []
        for (how, param, mapping, index, start, numel), value in zip(self._plan, values, strict=True):
            if how == "fragment":
                fragments.append(mapping.get_lp_grad_fragment(index))
                # a parameter cut by the partition boundary: its part in this rank's partition
                pieces.append(value if numel == value.numel() else value.reshape(-1).narrow(0, start, numel))
                written.append((param, pieces[-1]))
            elif how == "grad":
                if param.grad is None:
                    param.grad = value.to(param.dtype).clone()
                else:
                    param.grad.copy_(value)
                written.append((param, value))
        if fragments:
            copy_all(fragments, pieces)
        return self.written_difference(written) if check else None

    # -- the write checked by behaviour: what the step reads is what was written -------------------
    #
    # The attach check finds every attribute by name; it cannot see a DeepSpeed whose fragment link
    # still answers but no longer hands out the tensors its step reads (a copy, say): the method's
    # gradient would land nowhere and the run would train on zeros. So the check reads each
    # parameter's gradient where the step reads it (:data:`READ_BACK`), found by the parameter's own
    # place in the optimizer's groups, never through the link the write went through.

    def written_difference(self, written: list[tuple[torch.nn.Parameter, torch.Tensor]]) -> tuple[torch.Tensor, float]:
        """(||read - written|| / ||written|| over this rank's parameters, as a float32 device scalar
        read with no wait for the device; how far a correct write may be): the difference is
        infinite where a gradient the step reads is missing or of another size, 0 where nothing is
        written. The tolerance is the rounding of the step's gradient dtype (ZeRO's accumulation
        dtype may be bf16: a float32 value then rounds to it)."""
        device = written[0][1].device if written else torch.device("cpu")
        read = [self._read_back(param) for param, _ in written]
        if any(r is None or r.numel() != w.numel() for r, (_, w) in zip(read, written)):
            return torch.full((), float("inf"), device=device), 0.0
        if not written:
            return torch.zeros((), device=device), 0.0
        wanted = [w.reshape(-1).float() for _, w in written]
        differences = torch._foreach_sub([r.reshape(-1).float() for r in read], wanted)
        apart = torch.stack(torch._foreach_norm(differences)).norm()
        size = torch.stack(torch._foreach_norm(wanted)).norm()
        # a write of zeros read back as zeros is the same gradient: 0 / 0 counts as 0
        difference = torch.where(size > 0, apart / size.clamp(min=torch.finfo(torch.float32).tiny), apart)
        return difference, 2 * max(torch.finfo(r.dtype).eps for r in read)

    def _read_back(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """``param``'s gradient (this rank's part of it) where the optimizer's step reads it."""
        if self.kind == "plain":
            return param.grad
        if self._places is None:
            groups = getattr(self.optimizer, READ_BACK[self.kind][1])
            self._places = {id(p): (i, j) for i, group in enumerate(groups) for j, p in enumerate(group)}
        place = self._places.get(id(param))
        if place is None:
            return None
        i, j = place
        grads = getattr(self.optimizer, READ_BACK[self.kind][0]).get(i)
        if grads is None or j >= len(grads):
            return None
        # DeepCompile's pre-flattened partition (newer releases), where ZeRO's step then reads instead
        flat = getattr(grads, "flat_partition", None)
        if flat is None:
            return grads[j]
        start = sum(g.numel() for g in grads[:j])
        return flat.view(-1).narrow(0, start, grads[j].numel())


def written_gradient_lost(optimizer, step: int, ranks: list[int], difference: float) -> UserError:
    """The one line that stops a run whose optimizer would step with another gradient than the one
    the hook wrote at optimizer ``step`` (1 the first; :meth:`FullGradWriter.written_difference`),
    naming the installed DeepSpeed and the ``ranks`` where it differs."""
    import deepspeed

    low, high = map(_dotted, TESTED_DEEPSPEED)
    kind, label = optimizer_kind(optimizer), type(optimizer).__name__
    where = f"{label}.{READ_BACK[kind][0]}" if kind != "plain" else "param.grad"
    on = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    return UserError(
        f"deepspeed {deepspeed.__version__}: optimizer step {step}: the gradient {label} would step with is not the "
        f"one the engine hook wrote (read back from {where} on {on}, it differs by {difference:.3g} of its norm): "
        f"the write through {PARAM_LINK}.get_lp_grad_fragment no longer reaches what the step reads; install a "
        f"deepspeed iga-ds is tested with ({low} to {high})")


def copy_all(targets: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    """``targets[i].copy_(values[i])`` for every i (equal element counts, shapes may differ).

    A batched method's results are views of a few stacks, and ZeRO's fragments of the LoRA
    factors lie one after another in a partition: where both lists, whole or taken every other
    one (each module's A, then its B), are equally spaced views of one storage each
    (:func:`iga_ds.methods.device_copies.stacked_view`), a strided copy per list does it all,
    without an operator per tensor while the device waits for the host; otherwise one
    multi-tensor copy."""
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

    ZeRO-2's optimizer then fills the factors' partitions with zeros at the boundary (the hook
    writes the method's result over them) but must be told to set up its reduction buckets
    itself (:func:`prepare_backward`; what that needs is checked at attach). Elsewhere the
    factors keep their plain gradients: the same result, only slower.
    """
    return engine.zero_optimization_stage() == 2 and optimizer_kind(engine.optimizer) == "zero"


def reuse_zero_gradients(optimizer, params: list[torch.nn.Parameter]) -> bool:
    """Hand ZeRO-2 one persistent zero tensor per left-out parameter instead of a new one.

    After every backward, ZeRO-2 gathers each parameter's gradient of its partition
    (``get_all_grad_tensors``) and makes a ``zeros_like`` for each that has none: with the LoRA
    factors left out (:func:`lora_gradients_can_be_left_out`) that is one allocation and fill
    per LoRA tensor per micro-batch, host time while the device waits. Here those parameters get views of one flat zero
    buffer, zeroed once per call (the boundary's fragments, which the hook's result is written
    into, are views of the same buffer, so a step's values never reach the next). The same
    values as DeepSpeed's, on a ZeRO-2 optimizer whose methods were checked at attach; False
    (nothing changed) where this rank's partition holds none of ``params``."""
    # only this rank's partition is ever asked for
    inside = {id(p) for group in optimizer.params_in_partition for p in group}
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
    engine counts a skipped step: parameters, optimizer state and LR schedule stay put. What
    each kind of optimizer is written here was checked at attach (:data:`ZERO_STEP`,
    :data:`BF16_STEP`)."""
    kind = optimizer_kind(optimizer)
    if kind == "zero":
        optimizer.micro_step_id = -1  # INITIAL_MICRO_STEP_ID, as step() sets it
        optimizer.overflow = True
        optimizer.zero_grad(set_to_none=True)
        # DeepCompile's pre-flattened gradients (newer releases only; nothing to release without them)
        if hasattr(optimizer, "_release_preflattened_grad_buffers"):
            optimizer._release_preflattened_grad_buffers()
        for k in list(optimizer.averaged_gradients.keys()):
            optimizer.averaged_gradients[k] = None
            optimizer.all_grad_tensors[k] = None
    elif kind == "bf16":
        # its fp32 gradients accumulate until its own step clears them: cleared here instead
        optimizer.overflow = True
        optimizer.clear_hp_grads()
        optimizer.zero_grad(set_to_none=True)
    else:
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
    multi-tensor versions of the same results (what they use was checked at attach:
    :data:`ZERO_CHECKS`); False (nothing changed) where they do not apply: another optimizer,
    CPU offload, model parallelism or mixture of experts, where DeepSpeed's own loops run."""
    if optimizer_kind(optimizer) != "zero" or optimizer.cpu_offload:
        return False
    if optimizer.model_parallel_world_size != 1 or optimizer.has_moe_layers:
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

    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if not isinstance(compatible, dict):
        raise deepspeed_mismatch("deepspeed.ops.__compatible_ops__")
    compatible["deepspeed_shm_comm"] = False


def forget_world_group() -> None:
    """Drop DeepSpeed's cached clone of the world process group.

    DeepSpeed clones the default group once per process (``deepspeed.utils.groups``) and keeps
    the clone after that group is destroyed; a training started after
    ``torch.distributed.destroy_process_group()`` in the same process (a notebook, a script
    running two trainings, ``launch/train.py`` called twice) would otherwise hand the dead
    clone to its first broadcast ("Group ... is not registered").
    """
    from deepspeed.utils import groups

    if not hasattr(groups, "_WORLD_GROUP"):
        raise deepspeed_mismatch("deepspeed.utils.groups._WORLD_GROUP")
    groups._WORLD_GROUP = None


# -- optimizer state that does not depend on the world size --------------------------------------
#
# DeepSpeed refuses to load ZeRO optimizer partitions saved at a different world size. Each
# checkpoint therefore also keeps every LoRA parameter's full Adam moments, gathered with
# ``deepspeed.utils.safe_get_full_optimizer_state``; on a size change they are written back
# into the new partitions. The write needs DeepSpeed's private link between parameters and
# optimizer-state slices.

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")
SGD_MOMENTS = ("momentum_buffer",)


def optimizer_moments(optimizer) -> tuple[str, ...]:
    """The per-parameter state keys a full optimizer state holds: SGD's momentum buffer, else Adam's moments."""
    inner = getattr(optimizer, "optimizer", optimizer)  # ZeRO's wrapper holds the torch optimizer
    return SGD_MOMENTS if isinstance(inner, torch.optim.SGD) else ADAM_MOMENTS


def _trainable(engine):
    return [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]


def save_full_optimizer_state(engine, file: Path, rank: int) -> None:
    """Gather every LoRA parameter's optimizer state (Adam's moments, SGD's momentum) to full size
    (collective); rank 0 writes."""
    from deepspeed.utils import safe_get_full_optimizer_state
    from safetensors.torch import save_file

    tensors = {}
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    # before the first optimizer step (every step so far skipped) torch has no state yet and
    # DeepSpeed has not linked the parameters to it (its gather fails): the state is zeros then
    stepped = bool(getattr(inner, "state", None))
    for name, param in _trainable(engine):
        for key in optimizer_moments(engine.optimizer):
            if not stepped and hasattr(param, "_hp_mapping"):
                full = torch.zeros_like(param, dtype=torch.float32)
            else:
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
        raise deepspeed_mismatch(f"{type(zero).__name__}._lazy_init_hp_params_optimizer_state (to resume at "
                                 "another world size; ZeRO-1/2 only)")
    with safe_open(str(file), framework="pt") as f:
        step = int(f.metadata()["adam_step"])
        # A fresh engine has no Adam state yet (torch creates it at the first step) and
        # DeepSpeed links each parameter to its slice of that state only then: create the
        # state the way AdamW would, link, then write the gathered moments into the slices.
        keys = optimizer_moments(opt)
        for group in opt.param_groups:
            group["step"] = step
            for flat in group["params"]:
                opt.state[flat] = {key: torch.zeros_like(flat, memory_format=torch.preserve_format) for key in keys}
                if keys == ADAM_MOMENTS:
                    opt.state[flat]["step"] = torch.tensor(float(step), dtype=torch.float32)
        link()
        for name, param in _trainable(engine):
            for key in keys:
                safe_set_full_optimizer_state(param, f.get_tensor(f"{name}/{key}").to(param.device), key)


# -- DeepSpeed's checkpoint files, read without running their code -------------------------------
#
# DeepSpeed's loader unpickles (``torch.load(weights_only=False)``): a checkpoint folder from
# someone else could run any code on resume. Its files hold tensors, plain values and these of
# its classes (ZeRO's loss scaler, stage and fragment addresses), which torch's weights-only
# unpickler is allowed to rebuild; anything else a file names is refused.

CHECKPOINT_CLASSES = ("deepspeed.runtime.fp16.loss_scaler.LossScaler",
                      "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                      "deepspeed.runtime.zero.config.ZeroStageEnum",
                      "deepspeed.utils.tensor_fragment.fragment_address")


def load_checkpoints_without_pickle(engine) -> None:
    """Make ``engine``'s checkpoint loader read every file as ``torch.load(weights_only=True)``
    with :data:`CHECKPOINT_CLASSES` allowed; a file naming anything else stops the resume with one
    line naming the file and the object (:class:`ConfigError`). Nothing changes for a checkpoint
    engine other than DeepSpeed's torch one (a warning says that it unpickles)."""
    import importlib
    import logging
    import pickle

    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    checkpoint_engine = getattr(engine, "checkpoint_engine", None)
    if checkpoint_engine is None or not hasattr(checkpoint_engine, "load"):
        raise deepspeed_mismatch(f"{type(engine).__name__}.checkpoint_engine.load (to resume without unpickling)")
    if not isinstance(checkpoint_engine, TorchCheckpointEngine):
        logging.getLogger(__name__).warning("resume: %s unpickles the checkpoint's files: resume only checkpoints "
                                            "you trust", type(checkpoint_engine).__name__)
        return
    allowed = []
    for dotted in CHECKPOINT_CLASSES:
        module, _, name = dotted.rpartition(".")
        found = getattr(importlib.import_module(module), name, None)
        if found is None:
            raise deepspeed_mismatch(f"{dotted} (a class its checkpoints hold)")
        allowed.append(found)
    torch.serialization.add_safe_globals(allowed)

    def load(path, map_location=None):  # DeepSpeed's signature
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as exc:
            named = re.search(r"GLOBAL ([\w.]+)", str(exc))  # torch names what the file asked for
            refused = named.group(1) if named else "an object"
            raise ConfigError(f"resume: {path}: refused to unpickle {refused}, which no DeepSpeed checkpoint holds "
                              "(loading it would run what the file says); resume only checkpoints that training "
                              "wrote") from None

    checkpoint_engine.load = load


class GroupStepCount:
    """Mixin: the optimizer's step count in each param group, where DeepSpeed's elastic ZeRO
    checkpoint (the one that resumes at another world size) stores and restores it
    (``param_groups[0]["step"]``, where DeepSpeed's own Adam keeps it); torch's optimizers keep
    it per parameter (AdamW) or not at all (SGD), so the elastic save would drop it."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        for group in self.param_groups:
            group.setdefault("step", 0)

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        for group in self.param_groups:
            group["step"] = self._steps_taken(group)
        return loss


class GroupStepAdamW(GroupStepCount, torch.optim.AdamW):
    """torch AdamW that also records the step count in each param group."""

    def _steps_taken(self, group) -> int:
        # an empty group (a trainer's no-decay group of a LoRA model) steps nothing: its count stays
        state = self.state.get(group["params"][0], {}) if group["params"] else {}
        return int(state["step"]) if "step" in state else int(group["step"])


class GroupStepSGD(GroupStepCount, torch.optim.SGD):
    """torch SGD (with momentum) that records the step count in each param group."""

    def _steps_taken(self, group) -> int:
        return int(group["step"]) + bool(group["params"])


# -- DeepSpeed's ops, as `iga-ds selfcheck` reports them ------------------------------------------


def deepspeed_op_status() -> dict[str, dict[str, bool]]:
    """For each op DeepSpeed knows: prebuilt into the install, and compatible (could JIT-build),
    from the op builders' own ``is_compatible`` probes (header and toolkit checks: nothing is
    built). DeepSpeed prints warnings while probing; the caller keeps them out of its report."""
    try:
        from deepspeed.git_version_info import installed_ops
        from deepspeed.ops.op_builder.all_ops import ALL_OPS
        from deepspeed.ops.op_builder.builder import probe_is_compatible
    except ImportError as exc:
        raise deepspeed_mismatch(f"the op builders ({exc.name or exc})") from None
    return {name: {"installed": bool(installed_ops.get(name, False)),
                   "compatible": bool(probe_is_compatible(builder, False))}
            for name, builder in sorted(ALL_OPS.items())}
