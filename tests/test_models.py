import pytest
import torch

from labs import models
from labs.errors import LabsError


@pytest.mark.parametrize("preset, total", [("tiny", 9_822_784), ("qwen-7b", 7_721_324_544),
                                           ("qwen2.5-7b", 7_615_616_512)])
def test_param_counts_match_the_hf_model(preset, total):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):      # shapes only: a 7B model costs no memory here
        model = AutoModelForCausalLM.from_config(models.qwen2_config(preset))
    assert sum(p.numel() for p in model.parameters()) == models.param_counts(models.shape(preset))["total"] == total


def test_unknown_preset():
    with pytest.raises(LabsError, match="unknown preset 'qwen-70b'; choose one of: tiny, qwen-7b, qwen2.5-3b, qwen2.5-7b"):
        models.check_preset("qwen-70b")


def test_flops_per_token_matches_the_shared_reference_formula():
    # Qwen2.5-7B: 6 * (N - input embedding) + 12 * L * H * S.
    dims = models.shape("qwen2.5-7b")
    n = models.param_counts(dims)["total"] - 152064 * 3584
    assert models.flops_per_token(dims, 4096) == 6 * n + 12 * 28 * 3584 * 4096


def test_chunked_loss_equals_stock_loss():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(models.qwen2_config("tiny"))
    ids = torch.randint(0, 151_000, (2, 33))
    stock = models.CausalLM(hf, loss="hf")(ids)
    chunked = models.CausalLM(hf, loss="chunked", chunk_tokens=10)(ids)
    assert torch.allclose(stock, chunked, atol=1e-5)
    chunked.backward()
    assert hf.lm_head.weight.grad is not None


def test_activation_checkpointing_keeps_gradients():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    ids = torch.randint(0, 151_000, (2, 16))
    grads = []
    for how in ("none", "full", "1"):
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(models.qwen2_config("tiny"))
        assert models.checkpoint_layers(hf, how) == {"none": 0, "full": 2, "1": 1}[how]
        models.CausalLM(hf)(ids).backward()
        grads.append(hf.model.layers[0].mlp.up_proj.weight.grad)
    assert torch.allclose(grads[0], grads[1]) and torch.allclose(grads[0], grads[2])
    with pytest.raises(LabsError, match="activation checkpointing '9'"):
        models.checkpoint_layers(hf, "9")


def test_stock_checkpointing_is_hfs_own_without_its_deprecation_warning():
    """The stock reference turns on HF's checkpointing by the name the installed transformers offers: no FutureWarning
    from the old alias (which v6 removes), the model's own flag set, and an older transformers' name still used."""
    import warnings

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(models.qwen2_config("tiny"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        models.hf_checkpointing(hf)
    assert getattr(hf, "is_activation_checkpointing", None) or hf.is_gradient_checkpointing   # the old name warns

    class Older:                          # transformers before the rename: only gradient_checkpointing_enable
        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs):
            self.kwargs = gradient_checkpointing_kwargs

    older = Older()
    models.hf_checkpointing(older)
    assert older.kwargs == {"use_reentrant": False}


def test_model_path_must_exist(tmp_path):
    with pytest.raises(LabsError, match="does not exist"):
        models.check_model_path(tmp_path / "nowhere")
