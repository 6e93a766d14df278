"""Getting the model out of a run: a checkpoint's ZeRO partitions consolidated (DeepSpeed's zero_to_fp32) and
written as a Hugging Face model folder, with the tokenizer the run trained with.

    folder = export.to_hf("runs/long", "models/long")              # the run's newest complete checkpoint
    AutoModelForCausalLM.from_pretrained("models/long"), AutoTokenizer.from_pretrained("models/long")

The folder holds what a transformers user needs and nothing that needs labs or DeepSpeed:
- config.json and generation_config.json: Qwen2ForCausalLM with the run's dimensions, the KV cache on for
  generation, <|endoftext|> as end of text;
- model.safetensors (or shards and an index past 5 GB), in `dtype`: bf16 by default, the weights the run computed
  with (its fp32 master weights rounded); fp32 keeps the master weights themselves. A tied embedding is stored once;
- tokenizer.json and tokenizer_config.json: Qwen's byte-level BPE that labs.data reads from qwen.tiktoken,
  converted by transformers' TikTokenConverter. Ordinary text gets exactly the ids the run trained on. Special-token
  strings (<|im_start|> ...) typed inside text become special tokens there, as chat templates need; labs' training
  tokenizer keeps them as plain text;
- labs_export.json: where the weights came from (run, checkpoint, step, dtype).
The output folder may be new or an earlier export (its labs_export.json says so); anything else is refused.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from labs import checkpoint, data, models, resume, runfolder, zenflow_layout
from labs.errors import LabsError, check_choice

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PROVENANCE = "labs_export.json"
PARTIAL = ".labs-export-partial"       # in a folder being written; removed just before it takes its place
PREFIX = "hf."              # labs.models.CausalLM keeps the HF model as `self.hf`


@dataclass
class Exported:
    path: Path
    source: Path            # the checkpoint
    step: int
    bytes: int              # the weight files on disk

    @property
    def summary(self) -> str:
        return f"step {self.step}, {self.bytes / 2**20:,.1f} MiB of weights"


def consolidated(path: Path) -> dict:
    """The whole model's fp32 master weights from a checkpoint's ZeRO partitions (zero_to_fp32), with the names of
    the Hugging Face model (the training wrapper's prefix removed). A ZenFlow checkpoint's matrices are stored
    transposed, which zero_to_fp32 does not know: they are read back (labs.zenflow_layout)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    try:
        with _quiet():
            state = get_fp32_state_dict_from_zero_checkpoint(str(path.parent), tag=path.name)
    except (OSError, ValueError, KeyError, RuntimeError, EOFError) as error:   # files missing, empty or foreign
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise LabsError(f"checkpoint '{path}' is not a DeepSpeed ZeRO checkpoint that zero_to_fp32 can read "
                        f"({reason}); export another checkpoint of the run") from None
    if zenflow_layout.transposed(checkpoint.ds_config(path)):
        state = zenflow_layout.untransposed(state)
    return {name.removeprefix(PREFIX): tensor for name, tensor in state.items()}


def hf_config(manifest: dict, spec: dict):
    """The checkpointed model as a transformers config (recorded in the checkpoint; for checkpoints written before
    labs recorded it, the run's preset), ready for inference."""
    from transformers import AutoConfig

    if manifest.get("hf_config"):
        recorded = dict(manifest["hf_config"])
        config = AutoConfig.for_model(recorded.pop("model_type"), **recorded)
    else:
        config = models.qwen2_config(spec["preset"])
    eot = data.tokenizer().eot_token
    config.use_cache = True             # training turned the KV cache off; generation wants it
    config.bos_token_id = config.eos_token_id = eot
    config.architectures = ["Qwen2ForCausalLM"]
    return config


def to_hf(run_dir, out_dir, dtype: str = "bf16", tokenizer: bool = True) -> Exported:
    """Write `run_dir`'s newest complete checkpoint (or the checkpoint folder named) as a Hugging Face folder
    (`tokenizer=False`: the weights and config alone)."""
    check_choice("dtype", dtype, DTYPES)
    run_folder = resume.run_folder_of(run_dir, what="export: RUN_DIR")
    path = checkpoint.find(run_dir)
    out = _check_out(Path(out_dir))
    # one export into `out` at a time: a second is told who holds it, and what a killed one left is safe to recover
    with runfolder.lock(out.parent / f".{out.name}.lock", out, "export folder"):
        _recover(out)
        return _export(run_folder, path, _check_out(out), dtype, tokenizer)     # `out` again, as it is now


def _export(run_folder: Path, path: Path, out: Path, dtype: str, tokenizer: bool) -> Exported:
    from transformers import AutoModelForCausalLM

    spec = json.loads((run_folder / "run.json").read_text())
    manifest = checkpoint.manifest(path)
    config = hf_config(manifest, spec)
    state = {name: tensor.to(DTYPES[dtype]) for name, tensor in consolidated(path).items()}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
    expected = set(model.state_dict())
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        expected.discard("lm_head.weight")
    if set(state) != expected:
        raise LabsError(f"checkpoint '{path}' does not hold the model run.json describes: missing "
                        f"{sorted(expected - set(state))[:3]}, unexpected {sorted(set(state) - expected)[:3]}")
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    work = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    earlier = None
    try:
        work.mkdir()
        (work / PARTIAL).touch()  # what says a folder of this name is an export's, once its process is gone
        with _quiet():
            model.save_pretrained(work, safe_serialization=True, max_shard_size="5GB")
        if tokenizer:
            save_tokenizer(work)
        weights = sum(p.stat().st_size for p in work.glob("*.safetensors"))
        (work / PROVENANCE).write_text(json.dumps(dict(
            run=str(run_folder.resolve()), checkpoint=str(path.resolve()), step=manifest["step"], dtype=dtype,
            weights_bytes=weights, exported=time.strftime("%Y-%m-%dT%H:%M:%S%z")), indent=1) + "\n")
        if out.exists():          # an earlier export (_check_out): set aside, not deleted, until the new one is in
            earlier = Path(tempfile.mkdtemp(prefix=f".{out.name}.replaced-", dir=out.parent))
            out.rename(earlier)   # onto the new empty folder: a name no other export uses
        work.rename(out)
        (out / PARTIAL).unlink()  # a kill just before this leaves it in a whole export: _recover removes it
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if earlier is not None:
            if not out.exists():                       # stopped between the two renames: the earlier one goes back
                earlier.rename(out)
            shutil.rmtree(earlier, ignore_errors=True)  # the new export is in its place
    return Exported(out, path, manifest["step"], weights)


def save_tokenizer(folder: Path):
    """tokenizer.json + tokenizer_config.json for AutoTokenizer: the Qwen BPE of labs.data, converted from its
    tiktoken file (same ranks, same pre-tokenizer pattern, the 208 special tokens after the 151,643 ranks)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    encoding = data.tokenizer()
    backend = TikTokenConverter(vocab_file=str(data.qwen_tiktoken_path()), pattern=encoding._pat_str,
                                extra_special_tokens=encoding._special_tokens).converted()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=data.ENDOFTEXT, pad_token=data.ENDOFTEXT)
    tokenizer.save_pretrained(folder)


def _recover(out: Path):
    """What an export killed outright (SIGKILL, power) left beside `out`, found under its lock, so no export that is
    running left it: its half-written folder (.OUT.partial-*, holding PARTIAL) is removed; an earlier export it had
    set aside (.OUT.replaced-*, holding PROVENANCE) goes back in place if `out` is missing, the newest such, and
    the rest are removed, superseded. Nothing else is touched."""
    if (out / PARTIAL).is_file() and (out / PROVENANCE).is_file():
        (out / PARTIAL).unlink()         # killed after its last rename: the export is whole
    for work in runfolder.hidden(out, "partial"):
        if (work / PARTIAL).is_file():
            shutil.rmtree(work, ignore_errors=True)
    set_aside = []
    for earlier in runfolder.hidden(out, "replaced", r"[a-z0-9_]{8}"):     # tempfile.mkdtemp's 8 characters
        if (earlier / PROVENANCE).is_file():
            set_aside.append(earlier)
        else:
            with contextlib.suppress(OSError):
                earlier.rmdir()          # killed before the earlier export moved in: empty
    set_aside.sort(key=_exported, reverse=True)
    if set_aside and not out.exists():
        set_aside.pop(0).rename(out)
        print(f"labs: an export stopped before finishing had set '{out}' aside; it is back in place until this export "
              "replaces it", file=sys.stderr)
    for earlier in set_aside:
        shutil.rmtree(earlier, ignore_errors=True)


def _exported(folder: Path) -> str:
    """When the export in `folder` was written, as its PROVENANCE says ('' if unreadable)."""
    try:
        return json.loads((folder / PROVENANCE).read_text()).get("exported", "")
    except (OSError, ValueError):
        return ""


def _check_out(out: Path) -> Path:
    if out.exists() and not (out.is_dir() and ((out / PROVENANCE).is_file() or not any(out.iterdir()))):
        raise LabsError(f"export folder '{out}' exists and is not an earlier labs export (no {PROVENANCE}); "
                        "labs replaces only what it wrote: choose another folder")
    parent = runfolder.nearest_existing(out.parent)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise LabsError(f"export folder '{out}': '{parent}' is not writable")
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


@contextlib.contextmanager
def _quiet():
    """zero_to_fp32 prints what it rebuilds and draws progress bars, so does transformers: none of it is news."""
    from deepspeed.utils import logger
    from transformers.utils import logging as hf_logging

    level, bars = logger.level, hf_logging.is_progress_bar_enabled()
    logger.setLevel("WARNING")
    hf_logging.disable_progress_bar()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)
        if bars:
            hf_logging.enable_progress_bar()
