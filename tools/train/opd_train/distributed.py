"""opd-train on several processes (`accelerate launch`): the process group, and FSDP2 for the frozen base.

Data parallel (any accelerate config): rank 0 reads the input and sends each step's batch to the
other ranks (`SharedBatches`); every rank trains on records rank::world of it, and the adapter
gradients and the metric contributions (shares of one global token mean) are summed over ranks
(Trainer._all_reduce), so N ranks give one process's step.

FSDP (an accelerate config with `distributed_type: FSDP`, `fsdp_version: 2`): the same, and the
frozen base weights are sharded with torch's `fully_shard` over all ranks: one unit per decoder
layer (`fsdp_transformer_layer_cls_to_wrap`, default the model's `_no_split_modules`, whatever
`fsdp_auto_wrap_policy` says) and one for the decoder's other weights (embeddings, final norm).
The LoRA weights stay whole on every rank (`ignored_params`): they and their AdamW state are a
small fraction of the base, and so gradient sums, clipping, checkpoints (one full peft adapter
written by rank 0) and resume are the data-parallel ones. An untied LM head is not sharded (it is
called outside the decoder, chunk by chunk). Each layer's weights are all-gathered for every
forward and backward pass, so all ranks make the same number of passes: a rank with fewer
micro-batches adds zero-weight ones (`padding`).

Accelerate itself enables FSDP only on accelerators (its PartialState reports no distribution for
CPU processes), so opd-train reads the launcher's FSDP_* settings itself and shards on CPU (gloo)
as on GPU (NCCL). Settings it cannot honour are refused by name (`fsdp_settings`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from opd_common.errors import ConfigError

log = logging.getLogger("opd-train")

TRUE = ("1", "true", "yes")


@dataclass
class FsdpSettings:
    reshard_after_forward: bool
    layer_classes: list[str] | None  # None = the model's _no_split_modules


def _env(name: str, default: str = "") -> str:
    return os.environ.get(name, default).strip()


def fsdp_settings() -> FsdpSettings | None:
    """The FSDP settings `accelerate launch` put in the environment, or None without FSDP; unsupported ones raise."""
    if _env("ACCELERATE_USE_FSDP").lower() not in TRUE:
        return None
    version = _env("FSDP_VERSION", "1")
    if version != "2":
        raise ConfigError(f"opd-train supports FSDP2 only, but the accelerate config has fsdp_version {version}; "
                          "set fsdp_version: 2 in it (or pass --fsdp_version 2 to accelerate launch)")
    refused = {  # environment variable -> (accelerate config key, why / what instead)
        "FSDP_OFFLOAD_PARAMS": ("fsdp_offload_params", "only the LoRA weights train, and opd-train keeps them and "
                                                       "their optimizer state on the device"),
        "FSDP_CPU_RAM_EFFICIENT_LOADING": ("fsdp_cpu_ram_efficient_loading", "every rank loads the base weights "
                                                                             "itself before sharding them"),
        "FSDP_ACTIVATION_CHECKPOINTING": ("fsdp_activation_checkpointing", "use opd-train --gradient-checkpointing "
                                                                           "instead"),
    }
    for name, (key, why) in refused.items():
        if _env(name).lower() in TRUE:
            raise ConfigError(f"the accelerate config sets {key}: true, which opd-train does not support ({why}); "
                              "set it to false")
    reshard = _env("FSDP_RESHARD_AFTER_FORWARD", "true").lower()
    classes = [c.strip() for c in _env("FSDP_TRANSFORMER_CLS_TO_WRAP").split(",") if c.strip()]
    return FsdpSettings(reshard_after_forward=reshard in (*TRUE, "full_shard", "hybrid_shard"),
                        layer_classes=classes or None)


def accelerate_config(kind: str, num_processes: int, **fsdp_config) -> dict:
    """A one-machine `accelerate launch --config_file` config (YAML reads this as JSON) that opd-train is
    tested with: kind "ddp" (data parallel) or "fsdp" (FSDP2), `fsdp_config` overriding FSDP keys.
    The torchrun launcher of MULTI_GPU/FSDP starts the ranks on CPU too (gloo, with --device cpu);
    accelerate's --cpu flag would run one process."""
    config = {"compute_environment": "LOCAL_MACHINE", "mixed_precision": "no", "num_machines": 1,
              "num_processes": num_processes, "machine_rank": 0, "main_process_port": 0}
    if kind == "ddp":
        return {**config, "distributed_type": "MULTI_GPU"}
    fsdp = {"fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_reshard_after_forward": True,
            "fsdp_state_dict_type": "FULL_STATE_DICT", "fsdp_cpu_ram_efficient_loading": False}
    return {**config, "distributed_type": "FSDP", "fsdp_config": {**fsdp, **fsdp_config}}


def init_process_group(device: str) -> str:
    """Join the launcher's process group (gloo on CPU, NCCL on GPU); returns this rank's device."""
    from accelerate import PartialState

    rank_device = PartialState(cpu=device == "cpu").device
    return "cpu" if rank_device.type == "cpu" else str(rank_device)  # (accelerate says cpu:0, safetensors wants cpu)


def shard_base(student, settings: FsdpSettings) -> int:
    """fully_shard the student's frozen base weights (see the module docstring); returns the number of layer units."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    base = student.peft.get_base_model()
    decoder = base.get_decoder()
    names = settings.layer_classes or list(getattr(base, "_no_split_modules", None) or [])
    layers = [m for m in decoder.modules() if type(m).__name__ in names]
    if not layers:
        raise ConfigError(f"FSDP: the model has no layers of class {', '.join(names) or '(none named)'} to shard; "
                          "set fsdp_transformer_layer_cls_to_wrap in the accelerate config to its decoder layer class")
    device_type = str(student.device).split(":")[0]
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    adapter = set(student.params)  # trainable: whole on every rank, summed by hand like data parallel
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=settings.reshard_after_forward, ignored_params=adapter)
    fully_shard(decoder, mesh=mesh, ignored_params=adapter)
    log.info("FSDP: %d decoder layers (%s) and the decoder's other weights sharded over %d ranks", len(layers),
             ", ".join(names), dist.get_world_size())
    return len(layers)


def padding(count: int, examples: list, device, fsdp: FsdpSettings | None) -> list[list]:
    """Zero-weight micro-batches for a rank that makes `count`: under FSDP, up to the largest count of any
    rank (each pass gathers every layer's weights, so all ranks must make as many); without, one for a
    rank that got no records of the step (so that it reports every metric, as zeros, to the sums)."""
    import torch
    import torch.distributed as dist

    filler = min(examples, key=lambda e: e.length)
    if fsdp is None:
        return [] if count else [[filler]]
    most = torch.tensor([count], device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return [[filler]] * (int(most.item()) - count)


class SharedBatches:
    """A StepBatches that only rank 0 reads: it sends each step's batch (or the end of the input, or the
    error that stopped it) with the reader's position to the other ranks, which open no input. So stdin
    (a pipe from opd-score) works under several ranks, and input files need exist only where rank 0 runs.
    Other attributes (step, consumed, pending, ...) are the wrapped reader's."""

    def __init__(self, stream, rank: int):
        self.__dict__.update(_stream=stream, _rank=rank)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._stream, name, value)

    def next_batch(self):
        import torch.distributed as dist

        from opd_common.errors import OpdError

        s = self._stream
        message: list = [None]
        if self._rank == 0:
            try:
                batch, error = s.next_batch(), None
            except OpdError as exc:  # e.g. dynamic sampling's bound: every rank stops with the same error
                batch, error = None, exc
            message = [(batch, error, s.consumed, s.pending, s.last_id, s.last_stats)]
        dist.broadcast_object_list(message, src=0)
        batch, error, s.consumed, s.pending, s.last_id, s.last_stats = message[0]
        if error is not None:
            raise error
        return batch
