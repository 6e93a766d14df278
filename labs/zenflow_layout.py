"""A fix for DeepSpeed 0.19.8's ZenFlow under ZeRO-1/2: it scrambles every 2-D weight when the engine is built.

ZenFlow stores each matrix transposed in ZeRO's flat bf16 buffer (runtime/zenflow/zenflow_utils.py:
`_flatten_dense_tensors` transposes 2-D tensors, so a top-k "column" is contiguous), and its `_unflatten_dense_tensors`
gives the matching transposed views back. But DeepSpeedZeroOptimizer._update_model_bit16_weights
(runtime/zero/stage_1_and_2.py), which points the model's parameters at the buffer at start-up and after steps,
views each slice with the parameter's own shape: a [out, in] weight then reads the buffer's [in, out] bytes row by
row, a permutation of its values. From then on the forward uses scrambled weights (step 1's loss is not the model's)
and every update lands on the wrong elements; the loss barely falls. With a pretrained `--model-path` the model is
lost at step 0. `tools/repro_zenflow_layout.py` shows it with DeepSpeed alone.

The fix views each 2-D slice the way ZenFlow's own unflatten does ([in, out] then transposed). Checked: the built
model's forward equals the plain model's, and with update_interval 1 (a full CPU update every step) ZenFlow's
per-step losses equal plain ZeRO-2 offload's (tests/test_zenflow.py).

A second consequence, fixed here too: DeepSpeed links each parameter to its piece of the fp32 master partition
(utils/tensor_fragment.py: get_hp_fragment_mapping) through `lp_param.flatten()`, meant as a view into the bf16 flat
buffer. A transposed view is not contiguous, so there `flatten()` copies: round 15's allocator record of the 3B
(results/gpu/zenflow_1xh200/zf_alloc) found 5.75 GiB of such copies alive on the GPU, one per matrix, never read
(DeepSpeed only reads `lp_fragment` in tensor_fragment.update_hp/update_lp, which nothing calls), and in the wrong
element order for the master partition, which stores matrices transposed. `fragment_views` points each one at the
buffer in the buffer's own order: a view, no copy.

A third: checkpoints keep the layout. The fp32 master partition is a copy of the flat buffer, so DeepSpeed saves each matrix
transposed, while zero_to_fp32 cuts the flat groups into the parameters' own shapes. Consolidated as they are, a
ZenFlow checkpoint's matrices are permutations of the model's (an export held no model: on the tiny model every matrix
off by up to 0.15 while the weights are under 0.11, and a higher loss than at step 1). labs.export reads them back
(`untransposed`). A resume reloads the flat partitions as saved, so it is right only into the same layout: labs.resume
refuses to drop or add ZenFlow (`transposed` on both configs).
"""
from __future__ import annotations

_PATCHED = "_labs_zenflow_layout"
_LINKED = "_labs_zenflow_fragments"


def views(flat, params_meta_offsets):
    """(parameter, view) pairs: each parameter's slice of ZenFlow's flat buffer with the parameter's shape, read back
    through the transpose the buffer stores 2-D tensors in."""
    for param, meta, offset in params_meta_offsets:
        chunk = flat.narrow(0, offset, meta.numel())
        yield param, (chunk.view(meta.shape[1], meta.shape[0]).t() if meta.dim() == 2 else chunk.view(meta.shape))


def install() -> None:
    """Both fixes: the parameters' views (install_weight_views) and the master-weight links (install_fragment_views)."""
    install_weight_views()
    install_fragment_views()


def install_weight_views() -> None:
    """Replace DeepSpeedZeroOptimizer._update_model_bit16_weights with one that honours ZenFlow's layout (ZenFlow
    only; without ZenFlow the original runs). Idempotent."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    original = DeepSpeedZeroOptimizer._update_model_bit16_weights
    if getattr(original, _PATCHED, False):
        return

    def update_model_bit16_weights(self, group_index):
        if not getattr(self, "zenflow", False):
            return original(self, group_index)
        for param, view in views(self.bit16_groups_flat[group_index],
                                 zip(self.round_robin_bit16_groups[group_index],
                                     self.round_robin_bit16_meta[group_index],
                                     self.round_robin_bit16_offsets[group_index])):
            param.data = view
        # as the original: the model's parameters take the (round-robin reordered) views
        for index, param in enumerate(self.bit16_groups[group_index]):
            param.data = self.round_robin_bit16_groups[group_index][self.round_robin_bit16_indices[group_index][index]].data

    setattr(update_model_bit16_weights, _PATCHED, True)
    DeepSpeedZeroOptimizer._update_model_bit16_weights = update_model_bit16_weights


def fragment_views(params) -> int:
    """Re-point each transposed matrix's `_hp_mapping.lp_fragment` from DeepSpeed's copy to a view of the same
    elements in ZenFlow's buffer order (the parameter's [in, out] storage, flattened). Returns how many it re-pointed."""
    count = 0
    for param in params:
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is None or param.dim() != 2 or param.is_contiguous() or not param.t().is_contiguous():
            continue
        address = mapping.lp_fragment_address
        mapping.lp_fragment = param.data.t().flatten().narrow(0, address.start, address.numel)   # no autograd view
        count += 1
    return count


def install_fragment_views() -> None:
    """Run fragment_views after every DeepSpeedZeroOptimizer._link_all_hp_params (at start-up and after a checkpoint
    load), for ZenFlow only. Idempotent."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    original = DeepSpeedZeroOptimizer._link_all_hp_params
    if getattr(original, _LINKED, False):
        return

    def link_all_hp_params(self):
        original(self)
        if getattr(self, "zenflow", False):
            for group in self.bit16_groups:
                fragment_views(group)

    setattr(link_all_hp_params, _LINKED, True)
    DeepSpeedZeroOptimizer._link_all_hp_params = link_all_hp_params


def transposed(ds_config: dict) -> bool:
    """Whether a run with this DeepSpeed config keeps matrices transposed in its flat buffers and checkpoints: ZenFlow
    under ZeRO-1/2 (ZeRO-3's ZenFlow lays parameters out its own way: engine_stage3.py, not handled here)."""
    zero = ds_config.get("zero_optimization") or {}
    return bool(zero.get("zenflow")) and int(zero.get("stage", 0)) in (1, 2)


def untransposed(state: dict) -> dict:
    """A state dict that zero_to_fp32 consolidated from a `transposed` checkpoint, with each matrix read back the way
    ZenFlow stored it: the slice of [out, in] values is the matrix's [in, out] transpose, row by row."""
    return {name: (t.reshape(t.shape[1], t.shape[0]).t().contiguous() if t.dim() == 2 else t)
            for name, t in state.items()}
