"""The source tutorials' snippets for the Trainer and accelerate routes, kept as text (their comments translated), and
the checks that grade them by running the real readers and fillers: Python's json (what HF and accelerate use),
hjson (what DeepSpeed uses), HF's "auto" filler, DeepSpeed's config parser, accelerate's launcher. Each check returns
None when the snippet passes, or the error it raised, so a notebook cell can print one verdict line.

The source tutorials are the two Chinese tutorials this course takes its topics from: a blog post on training
Qwen-7B with DeepSpeed ZeRO-3, and "Chapter 4: DeepSpeed distributed training" of a tutorial series, which shows the
snippets below (its section numbers are kept in the comments, for readers who have it).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import tempfile
from pathlib import Path
from unittest import mock

import hjson

from labs import supervisor
from labs.env import importable_path

# The tutorial's ZeRO-2 file (its section 2.1: "ZeRO-2, recommended for most fine-tuning with enough GPU memory").
ZERO2_JSON = """{
  "train_batch_size": "auto",
  "gradient_accumulation_steps": "auto",
  "steps_per_print": 100,
  "gradient_clipping": 1.0,
  "fp16": {
    "enabled": true,
    "loss_scale": 0,
    "initial_scale_power": 16
  },
  "zero_optimization": {
    "stage": 2,
    "allgather_partitions": true,
    "allgather_bucket_size": 2e8,
    "reduce_scatter": true,
    "reduce_bucket_size": 2e8,
    "overlap_comm": true,  // overlap communication with computation, to train faster
    "contiguous_gradients": true
  },
  "optimizer": {
    "type": "AdamW",
    "params": {
      "lr": "auto",
      "weight_decay": "auto"
    }
  }
}"""

# The tutorial's ZeRO-3 Offload file (its section 2.2).
ZERO3_OFFLOAD_JSON = """{
  "zero_optimization": {
    "stage": 3,
    "offload_optimizer": {
      "device": "cpu",     // key: move the optimizer to the CPU
      "pin_memory": true
    },
    "offload_param": {
      "device": "cpu",     // key: move the parameters to the CPU (optional: slower, saves more memory)
      "pin_memory": true
    },
    "overlap_comm": true,
    "contiguous_gradients": true,
    "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9,
    "stage3_prefetch_bucket_size": 1e7,
    "stage3_param_persistence_threshold": 1e5,
    "reduce_bucket_size": 1e7,
    "sub_group_size": 1e9
  },
  "fp16": { "enabled": true },
  "train_batch_size": "auto",
  "gradient_accumulation_steps": "auto"
}"""

# Its two ways to start training (section 3): the Trainer with the ZeRO-2 file saved as ds_config_zero2.json, and
# accelerate's DeepSpeed flags.
TRAINING_ARGUMENTS = dict(output_dir="./res", deepspeed="./ds_config_zero2.json", per_device_train_batch_size=4)
ACCELERATE_FLAGS = ["--use_deepspeed", "--zero_stage", "2", "train.py"]

# Its two-machine accelerate config (section 5.2, "accelerate multi-machine mode"; comment translated).
MULTINODE_YAML = """compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
machine_rank: 0  # set to 0, 1, ... on the different machines
main_process_ip: 192.168.1.100
main_process_port: 29500
num_machines: 2
num_processes: 16
"""


@contextlib.contextmanager
def quiet_deepspeed():
    """DeepSpeed logs warnings with a timestamp when it is imported on a CPU ("Setting accelerator to CPU") and when a
    hostfile is missing; inside this block its logger keeps errors only (what the checks report is their result)."""
    logger = logging.getLogger("DeepSpeed")      # the logger DeepSpeed configures on import: same object

    def errors_only(record):
        return record.levelno >= logging.ERROR

    logger.addFilter(errors_only)
    try:
        yield
    finally:
        logger.removeFilter(errors_only)


def numbered(text: str) -> str:
    """The text with line numbers, so that a reader's "line 17 column 28" can be found."""
    return "\n".join(f"{i:3d}  {line}" for i, line in enumerate(text.splitlines(), 1))


# ---------------------------------------------------------------------------------------------- readers
def json_error(text: str) -> str | None:
    """What Python's json (HF's and accelerate's config reader) says, or None."""
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        return f"JSONDecodeError: {exc}"
    return None


def hjson_error(text: str) -> str | None:
    """What hjson (DeepSpeed's reader for config files) says, or None."""
    try:
        hjson.loads(text)
    except hjson.HjsonDecodeError as exc:
        return f"HjsonDecodeError: {exc}"
    return None


def without_comments(text: str) -> dict:
    """The config the text means, comments dropped (hjson reads it; the result is plain data)."""
    return json.loads(json.dumps(hjson.loads(text)))


def deepspeed_error(config: dict | str, world_size=2) -> str | None:
    """Whether DeepSpeed's own config class accepts it (a dict, or a file path, read with hjson). Without a process
    group it counts one rank, so an integer train_batch_size is checked as one rank's share of `world_size`."""
    if isinstance(config, dict) and isinstance(config.get("train_batch_size"), int):
        config = dict(config, train_batch_size=config["train_batch_size"] // world_size)
    with quiet_deepspeed():
        from deepspeed.runtime.config import DeepSpeedConfig

        try:
            DeepSpeedConfig(config)
        except Exception as exc:        # DeepSpeed raises assorted types; the grade is the message
            return f"{type(exc).__name__}: {exc}"
    return None


def with_comments_on_disk(text: str, folder) -> Path:
    path = Path(folder) / "ds_config_zero2.json"
    path.write_text(text)
    return path


# ---------------------------------------------------------------------------------------------- HF's filler
def hf_fill(config: dict, *, world_size=2, steps=8, hidden_size=64, **training_args) -> tuple[dict | None, str | None]:
    """HF's own "auto" filling (what the Trainer does at TrainingArguments creation and at train start), run in this
    process for `world_size` ranks: returns (filled config, None) or (None, the error HF raises)."""
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config

    class Ranks:   # the TrainingArguments, seen from a job of `world_size` ranks (no process group needed)
        def __init__(self, args):
            self._args = args

        def __getattr__(self, name):
            return world_size if name == "world_size" else getattr(self._args, name)

    class Model:   # the finalize step reads only the model's hidden size
        class config:
            pass

    Model.config.hidden_size = hidden_size
    try:
        with quiet_deepspeed(), tempfile.TemporaryDirectory() as folder:
            args = Ranks(TrainingArguments(output_dir=folder, report_to="none", **training_args))
        filled = HfTrainerDeepSpeedConfig(json.loads(json.dumps(config)))
        filled.trainer_config_process(args)
        filled.trainer_config_finalize(args, Model(), steps)
        return filled.config, None
    except ValueError as exc:
        return None, " ".join(str(exc).split("\n")[:2])
    finally:
        unset_hf_deepspeed_config()   # HF keeps a global pointer to the last config; a ZeRO-3 one would reroute
                                      # every later model build in this process through zero.Init


def training_arguments_error(folder, text: str, **arguments) -> str | None:
    """`TrainingArguments(**arguments)` run as written, in `folder`, with `text` as ./ds_config_zero2.json. The
    config is read first, before anything touches a device: a reader error surfaces without a process group."""
    from transformers import TrainingArguments

    with_comments_on_disk(text, folder)
    with contextlib.chdir(folder):
        try:
            TrainingArguments(report_to="none", **arguments)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
    return None


# ---------------------------------------------------------------------------------------------- accelerate
def accelerate_launch(arguments: list[str], folder, timeout=120) -> tuple[int, str]:
    """`accelerate launch ARGUMENTS` run as written in `folder` (no default accelerate config: HF_HOME points into
    the folder); returns the exit code and the last line of its output."""
    env = dict(os.environ, HF_HOME=str(Path(folder) / "hf_home"), HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = importable_path(env)
    if "DS_ACCELERATOR" not in env and not _cuda():
        env["DS_ACCELERATOR"] = "cpu"
    done = supervisor.run_captured([sys.executable, "-m", "accelerate.commands.launch", *arguments], env, timeout,
                                   cwd=folder)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    return done.returncode, lines[-1] if lines else ""


def probe(folder) -> list[dict]:
    """What labs.course.accelerate_probe wrote in `folder` (one record per process, by rank)."""
    return [json.loads(p.read_text()) for p in sorted(Path(folder).glob("probe*.json"))]


def accelerate_plan(yaml_text: str, folder, script="train.py") -> dict:
    """What `accelerate launch --config_file X script` would start on this machine, computed by accelerate's own
    argument validation and DeepSpeed command builder without starting it; the ZeRO stage and offload the processes'
    DeepSpeed plugin would take from that environment; and whether DeepSpeed's runner finds the hostfile named."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import DeepSpeedPlugin
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    with quiet_deepspeed():
        from deepspeed.launcher.runner import fetch_hostfile
    path = Path(folder) / "accelerate_multinode.yaml"
    path.write_text(yaml_text)
    args = launch_command_parser().parse_args(["--config_file", str(path), script])
    with contextlib.redirect_stdout(None), contextlib.redirect_stderr(None):
        args, defaults, _ = _validate_launch_command(args)
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config or {})
        command, env = prepare_deepspeed_cmd_env(args)
        hostfile = command[command.index("--hostfile") + 1] if "--hostfile" in command else None
        with quiet_deepspeed():
            hosts = fetch_hostfile(hostfile) if hostfile else None
        with mock.patch.dict(os.environ, env, clear=True):      # what each process's DeepSpeed plugin would hold
            plugin = DeepSpeedPlugin()
    return dict(command=command, mixed_precision=env.get("ACCELERATE_MIXED_PRECISION"), zero_stage=plugin.zero_stage,
                offload=plugin.offload_optimizer_device, hostfile=hostfile, hosts=hosts)


def accelerate_refusal(fragment: str) -> str:
    """The message of the ValueError in accelerate's DeepSpeed preparation (Accelerator._prepare_deepspeed, as
    installed here) that contains `fragment`: the refusal itself, read from the code that raises it."""
    import inspect

    from accelerate import Accelerator

    source = inspect.getsource(Accelerator._prepare_deepspeed)
    for block in source.split("raise ValueError(")[1:]:
        message = "".join(part.strip()[1:-1] for part in block.split(")")[0].splitlines() if part.strip())
        if fragment in message:
            return message
    raise LookupError(f"no ValueError mentioning {fragment!r} in this accelerate's _prepare_deepspeed")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def verdict(label: str, error: str | None, passed: str = "passes") -> str:
    """One line: the snippet, and what the check said (an error cut to its first line)."""
    return f"{label}: {passed}" if error is None else f"{label}: FAILS: {error.splitlines()[0][:160]}"
