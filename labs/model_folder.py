"""A local Hugging Face model folder (`--model-path`), checked on the host before any rank starts: the architecture
labs trains, weights whose names and shapes match the config, a vocabulary that holds every id labs' tokenizer feeds
it, and the preset whose run defaults fit it.

    dims = model_folder.check(Path("/models/Qwen2.5-7B"))      # the model's dims, or one LabsError line
    model_folder.preset_of(path, dims)                          # "qwen2.5-7b"; no preset's shape: refused

labs tokenizes with Qwen's BPE (labs.data) whatever tokenizer files the folder holds.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from labs import data, models
from labs.errors import LabsError

# What a preset's shape is (max_position_embeddings differs between releases of one model: not compared)
SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
              "vocab_size", "tie_word_embeddings")


def check(path: Path) -> dict:
    """A local Hugging Face folder labs can train: a Qwen2 config, and weights whose names and shapes match it
    (read from the safetensors headers, no tensor loaded). Returns the model's dims."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        raw = json.loads((path / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LabsError(f"--model-path '{path}': config.json is not valid JSON ({exc})") from None
    if raw.get("model_type") != "qwen2":
        raise LabsError(f"--model-path '{path}' holds a '{raw.get('model_type')}' model; labs trains the Qwen2 "
                        "architecture (model_type 'qwen2': Qwen1.5, Qwen2, Qwen2.5)")
    check_vocabulary(path, raw.get("vocab_size"))
    config = AutoConfig.from_pretrained(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in path.glob("*.bin"))
        raise LabsError(f"--model-path '{path}' has no *.safetensors weights" +
                        (f" (found {other[0]}: convert it with save_pretrained(safe_serialization=True))"
                         if other else ""))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    found = _safetensors_shapes(files)
    for name, shape in expected.items():
        if name not in found:
            raise LabsError(f"--model-path '{path}': weight '{name}' is missing from "
                            f"{', '.join(f.name for f in files)}")
        if found[name] != shape:
            raise LabsError(f"--model-path '{path}': weight '{name}' has shape {list(found[name])}, but config.json "
                            f"says {list(shape)}")
    return models.shape(config)


def check_vocabulary(path: Path, vocab_size) -> None:
    """Every id the corpus can hold is a row of the embedding: Qwen's BPE ranks and <|endoftext|>, the last of them
    (inside the ranks, a smaller table fails with an IndexError at the first step)."""
    needed = data.tokenizer().eot_token + 1
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < needed:
        raise LabsError(f"--model-path '{path}': config.json's vocab_size is {vocab_size!r}, but labs feeds it Qwen's "
                        f"tokenizer (qwen.tiktoken) ids up to {needed - 1:,} (<|endoftext|>): it needs at least "
                        f"{needed:,} (Qwen2 models have 151,936 or 152,064)")


def preset_of(path: Path, dims: dict) -> str:
    """The preset whose shape the folder's model has, for its run defaults (sequence length, learning rate) when
    --model-path comes without --preset; a model of no preset's shape is refused (the tiny preset's defaults would
    train it at seq_len 64 and lr 5e-3)."""
    for name, shape in models.PRESETS.items():
        if all(shape[key] == dims[key] for key in SHAPE_KEYS):
            return name
    raise LabsError(f"--model-path '{path}' ({dims['num_hidden_layers']} layers of width {dims['hidden_size']}) has "
                    "no preset's shape: give --preset, the nearest of " + ", ".join(models.PRESETS) + ", for the "
                    "run's defaults (the model's shape still comes from the folder), and --seq-len and --lr to set "
                    "them yourself")


def _safetensors_shapes(files) -> dict:
    from safetensors import safe_open

    shapes = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        except Exception as exc:        # a truncated or foreign file: the library's own words
            raise LabsError(f"--model-path: '{file}' is not a readable safetensors file ({exc})") from None
    return shapes
