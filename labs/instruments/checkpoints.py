"""What each engine's checkpoint is made of: a real save at the end of a run, described, then deleted.

    launch.run(..., instruments=("state_bytes", "state_dict"))
    run.summary["state_dict"][0]   # rank 0: {"format": "dcp" | "deepspeed", "files": [...], "samples": [...], ...}

- FSDP2: `torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)` returns the *sharded* state
  dict: every value a DTensor whose local piece is this rank's shard. `torch.distributed.checkpoint.save` writes it
  as one file per rank plus a `.metadata` index (DCP); `get_model_state_dict(..., full_state_dict=True,
  cpu_offload=True)` gathers plain full tensors onto rank 0 instead.
- DeepSpeed: `engine.save_checkpoint(dir)` writes the module's state dict (ZeRO-3: empty placeholders) and, per
  rank, the optimizer's flat fp32 partitions; `deepspeed.utils.zero_to_fp32` stitches them into full fp32 tensors
  offline (the script DeepSpeed copies next to every checkpoint).

Each entry records file names and sizes, and for a few named tensors their type, dtype, shape on this rank, full
shape and placement. The checkpoint goes to a temporary folder (rank 0 makes it, every rank writes there: one host)
and is removed afterwards; only its description lands in summary.json.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from labs.train import Instrument

# Tensors described by name (suffixes): the tied embedding (99% of `tiny`), one layer's weight, one norm.
SAMPLES = ("embed_tokens.weight", "layers.0.mlp.up_proj.weight", "model.norm.weight")


class StateDict(Instrument):
    name = "state_dict"

    def __init__(self):
        self.found = None

    def finished(self, engine):
        folder = _shared_temporary_folder()
        try:
            self.found = _fsdp2(engine, folder) if hasattr(engine, "settings") else _deepspeed(engine, folder)
        finally:
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(folder, ignore_errors=True)

    def summary(self) -> dict:
        return self.found


def describe(value) -> dict:
    """Type, dtype, this rank's shape, the full shape and the placement of one state-dict value."""
    if hasattr(value, "to_local"):
        return dict(type="DTensor", dtype=str(value.dtype).removeprefix("torch."),
                    local_shape=list(value.to_local().shape), full_shape=list(value.shape),
                    placement=str(tuple(value.placements)))
    if isinstance(value, torch.Tensor):
        return dict(type="Tensor", dtype=str(value.dtype).removeprefix("torch."), local_shape=list(value.shape),
                    full_shape=list(value.shape), placement="whole")
    return dict(type=type(value).__name__, dtype=None, local_shape=None, full_shape=None, placement=None)


def _fsdp2(engine, folder: Path) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    model, optimizer = get_state_dict(engine.module, engine.optimizer)
    full = get_model_state_dict(engine.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    dcp.save({"model": model, "optimizer": optimizer}, checkpoint_id=str(folder))
    dist.barrier()
    first = next(key for key in model if key.endswith(SAMPLES[0]))
    return dict(format="dcp", rank=dist.get_rank(), model_keys=len(model), files=_files(folder),
                file_contents=_dcp_contents(folder, dist.get_rank()),
                samples=[dict(name=k, **describe(v)) for k, v in model.items() if k.endswith(SAMPLES)],
                optimizer_keys=sorted(optimizer), optimizer_state_of=first,
                optimizer_state={k: describe(v) for k, v in optimizer["state"][first].items()},
                full_keys=len(full), full_samples=[dict(name=k, **describe(v)) for k, v in full.items()
                                                   if k.endswith(SAMPLES)])


def _deepspeed(engine, folder: Path) -> dict:
    engine.save_checkpoint(str(folder), tag="final")
    dist.barrier()
    found = dict(format="deepspeed", rank=dist.get_rank(), files=_files(folder))
    if dist.get_rank() == 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        # ZeRO-3 writes one model-states file per rank (zero_pp_rank_N_...), ZeRO-0/1/2 one for all (mp_rank_00_...)
        model_file = sorted((folder / "final").glob("*model_states.pt"))[0]
        states = torch.load(model_file, map_location="cpu", weights_only=False)
        optim_file = next((folder / "final").glob("*zero_pp_rank_0_*optim_states.pt"))
        saved = torch.load(optim_file, map_location="cpu", weights_only=False)
        optim = saved["optimizer_state_dict"]
        found.update(file_contents=_tensor_contents(saved),
                     model_file=model_file.name, model_file_keys=sorted(states),
                     samples=[dict(name=k, **describe(v)) for k, v in states["module"].items() if k.endswith(SAMPLES)],
                     optimizer_file=optim_file.name, optimizer_keys=sorted(optim),
                     optimizer_flat=[describe(t) for t in _flat_groups(optim)])
        full = get_fp32_state_dict_from_zero_checkpoint(str(folder), tag="final")
        found.update(full_keys=len(full), full_samples=[dict(name=k, **describe(v)) for k, v in full.items()
                                                        if k.endswith(SAMPLES)])
    return found


def _flat_groups(optim: dict) -> list:
    """The fp32 master partition(s): ZeRO-3 keeps them under 'fp32_flat_groups', ZeRO-1/2 under
    'single_partition_of_fp32_groups'."""
    for key in ("fp32_flat_groups", "single_partition_of_fp32_groups"):
        if key in optim:
            return list(optim[key])
    return []


def _dcp_contents(folder: Path, rank: int) -> dict:
    """Bytes this rank's .distcp file holds per saved entry, read from DCP's own index (.metadata lists where each
    slice of each tensor lies): {"model.<name>": bytes, "optimizer.state.<name>.exp_avg": bytes, ...}."""
    import torch.distributed.checkpoint as dcp

    found = {}
    for index, where in dcp.FileSystemReader(str(folder)).read_metadata().storage_data.items():
        if where.relative_path == f"__{rank}_0.distcp":
            found[index.fqn] = found.get(index.fqn, 0) + where.length
    return found


def _tensor_contents(saved, prefix="") -> dict:
    """Bytes of every tensor in a loaded DeepSpeed file, by key path ("optimizer_state_dict.fp32_flat_groups.0",
    ...): the elements' bytes, and the bytes of the storage torch.save writes for it when a view shares a larger one."""
    if isinstance(saved, torch.Tensor):
        return {prefix: dict(bytes=saved.numel() * saved.element_size(),
                             storage_bytes=saved.untyped_storage().nbytes())}
    items = saved.items() if isinstance(saved, dict) else enumerate(saved) if isinstance(saved, (list, tuple)) else ()
    found = {}
    for key, value in items:
        found.update(_tensor_contents(value, f"{prefix}.{key}" if prefix else str(key)))
    return found


def _files(folder: Path) -> list[dict]:
    return [dict(name=str(p.relative_to(folder)), bytes=p.stat().st_size) for p in sorted(folder.rglob("*"))
            if p.is_file()]


def _shared_temporary_folder() -> Path:
    """A folder rank 0 creates and every rank learns (the ranks of a run share one host here)."""
    name = [tempfile.mkdtemp(prefix="labs-state-dict-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    return Path(name[0])
