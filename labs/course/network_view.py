"""Chapter 6's view of the communication model (labs.network): a sweep over node counts, plotted (also with
ipywidgets controls); a step's compute time taken from a recorded H200 run; and the model's bytes next to what the
comm instrument counted on emulated nodes.

    network_view.sweep_plot()                        # the default cluster, every scheme, 1..32 nodes
    network_view.calculator()                        # the same with sliders (in Jupyter)
    Table(network_view.byte_check(run, "ZeRO++ hpZ", regathered=...))
"""
from __future__ import annotations

import matplotlib.pyplot as plt

from labs import memory, models, network, resolve
from labs.bench import results
from labs.instruments import comm
from labs.runfolder import Run

# The recorded run a step's computing time comes from: labs' ZeRO-3 on 2 x H200, Qwen2.5-7B, micro-batch 2 x 4096.
RECORDED = ("2026-11-30_e_zero3_final_2xh200", "labs-zero3")
# Nominal link rates (specifications, not measurements): NVLink 4 sends 450 GB/s per GPU each way; eight 400 Gb/s
# NICs per node send 400 GB/s. Change them: they are the model's inputs.
DEFAULTS = dict(preset="qwen2.5-7b", gpus_per_node=8, intra_gbps=450.0, inter_gbps=400.0,
                nodes=(1, 2, 4, 8, 16, 32))
COLORS = dict(zip(network.SCHEMES, ("#4c72b0", "#55a868", "#8172b3", "#c44e52", "#dd8452")))


def recorded_compute() -> dict:
    """The recorded step: its time, its tokens per GPU, where and when. The time is a whole measured ZeRO-3 step on
    2 GPUs, its own NVLink collectives included, so it overstates pure computing (how much is not measured).
    The sweep keeps these tokens per GPU at every node count: weak scaling, the global batch grows with the GPUs."""
    row = next(r for r in results.rows(results.load_all()) if (r["run"], r["case"]) == RECORDED)
    return dict(run=row["run"], case=row["case"], gpu=row["gpu"], gpus=row["gpus"], step_s=row["step_s"],
                tokens_per_gpu=row["tokens_per_step"] // row["gpus"], tokens_per_s_per_gpu=row["tokens_per_s_per_gpu"],
                date=row["date"])


def sweep_rows(inter_gbps=None, intra_gbps=None, gpus_per_node=None, nodes=None, preset=None) -> list[dict]:
    v = _values(inter_gbps, intra_gbps, gpus_per_node, nodes, preset)
    return network.sweep(v["params"], v["gpus_per_node"], list(v["nodes"]), v["intra_gbps"], v["inter_gbps"],
                         recorded_compute()["step_s"])


def fsdp2_against_zero3(nodes=(2, 4, 8, 32), gpus_per_node=None, preset=None) -> list[dict]:
    """GB leaving each node per step: ZeRO-3 against FSDP2 hybrid with its gradients reduced in fp32 (labs'
    setting) and in bf16, at each node count."""
    v = _values(None, None, gpus_per_node, nodes, preset)

    def out_gb(scheme, n, reduce_bytes=network.FP32):
        cluster = network.Cluster(v["gpus_per_node"], n, v["intra_gbps"], v["inter_gbps"])
        return network.step_time(scheme, v["params"], cluster, 0, reduce_bytes=reduce_bytes)["node_out_bytes"] / 1e9

    return [dict(nodes=n, zero3=out_gb("ZeRO-3", n), fsdp2_fp32=out_gb("FSDP2 hybrid", n),
                 fsdp2_bf16=out_gb("FSDP2 hybrid", n, network.BF16)) for n in v["nodes"]]


def sweep_plot(inter_gbps=None, intra_gbps=None, gpus_per_node=None, nodes=None, preset=None, ax=None):
    """Communication seconds per step against nodes, one line per scheme, and the recorded step's compute time:
    above that line, communication can no longer hide behind computing."""
    v = _values(inter_gbps, intra_gbps, gpus_per_node, nodes, preset)
    rows = sweep_rows(**{k: v[k] for k in ("inter_gbps", "intra_gbps", "gpus_per_node", "nodes", "preset")})
    ax = ax or plt.subplots(figsize=(7.5, 4))[1]
    for scheme in network.SCHEMES:
        mine = [r for r in rows if r["scheme"] == scheme]
        ax.plot([r["nodes"] for r in mine], [r["comm_s"] for r in mine], marker="o", label=scheme,
                color=COLORS[scheme])
    compute = recorded_compute()
    ax.axhline(compute["step_s"], color="black", ls="--", lw=1,
               label=f"recorded step on {compute['gpus']} x H200 ({compute['step_s']:.2f} s)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(v["nodes"]), [str(n) for n in v["nodes"]])
    ax.set(xlabel=f"nodes of {v['gpus_per_node']} GPUs", ylabel="communication per step (s)",
           title=f"{v['preset']}: {v['intra_gbps']:g} GB/s per GPU in a node, {v['inter_gbps']:g} GB/s per node out")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def calculator():
    """sweep_plot with sliders for the bandwidths and GPUs per node."""
    import ipywidgets as widgets

    def draw(inter_gbps, intra_gbps, gpus_per_node):
        sweep_plot(inter_gbps=inter_gbps, intra_gbps=intra_gbps, gpus_per_node=gpus_per_node)
        plt.show()

    return widgets.interactive(
        draw, inter_gbps=widgets.FloatLogSlider(value=DEFAULTS["inter_gbps"], base=2, min=3, max=10, step=0.5,
                                                description="inter GB/s"),
        intra_gbps=widgets.FloatSlider(value=DEFAULTS["intra_gbps"], min=25, max=900, step=25,
                                       description="intra GB/s"),
        gpus_per_node=widgets.IntSlider(value=DEFAULTS["gpus_per_node"], min=1, max=8, description="GPUs/node"))


def _values(inter_gbps, intra_gbps, gpus_per_node, nodes, preset) -> dict:
    given = dict(inter_gbps=inter_gbps, intra_gbps=intra_gbps, gpus_per_node=gpus_per_node, nodes=nodes,
                 preset=preset)
    v = {**DEFAULTS, **{k: x for k, x in given.items() if x is not None}}
    v["params"] = models.param_counts(models.shape(v["preset"]))["total"]
    return v


# ---------------------------------------------------------------------------------------------- against counts
def regathered(run: Run) -> dict:
    """Parameters a run fetches again after their first fetch of a step, when every module releases its
    parameters after use (stage3_max_reuse_distance 0): every parameter above the persistence threshold once more
    for backward, and a tied embedding twice more (its second use as the output head, in forward and backward).
    Counted from the real model."""
    dims, threshold = run.spec["dims"], run.ds_config["zero_optimization"]["stage3_param_persistence_threshold"]
    model = models.build(run.spec["preset"], dtype=models.DTYPES["fp32"], device="cpu", seed=0)
    sizes = [p.numel() for p in model.parameters()]
    persistent = sum(n for n in sizes if n <= threshold)
    embedding = dims["vocab_size"] * dims["hidden_size"] if dims.get("tie_word_embeddings") else 0
    return dict(params=sum(sizes), persistent=persistent, tied_embedding=embedding,
                regathered=sum(sizes) - persistent + 2 * embedding)


def reuse_regathered(dims: dict, knobs: dict) -> dict:
    """Chapter 2's reuse model (labs.instruments.comm.zero3_gathered_elements: DeepSpeed releases a module's
    parameters after it runs unless a module within stage3_max_reuse_distance elements uses them again) for one
    step, prefetching left out: the elements a rank gathers, and how many of them it fetches again after their first
    fetch, labs.network's `regathered`. `knobs`: a resolved config's (labs.resolve.zero_knobs)."""
    params = models.param_counts(dims)["total"]
    gathered = comm.zero3_gathered_elements(dims, knobs["stage3_max_reuse_distance"],
                                            knobs["stage3_param_persistence_threshold"])
    return dict(params=params, reuse_distance=knobs["stage3_max_reuse_distance"], gathered=gathered,
                regathered=gathered - params)


def qwen_regathered(preset="qwen2.5-7b", gpus_per_node=8) -> dict:
    """reuse_regathered for `preset` with zero3.json resolved as a run would (bf16, `gpus_per_node` GPUs): DeepSpeed's
    default reuse distance, the `auto` persistence threshold."""
    knobs = memory.estimate(preset, stage=3, gpus_per_node=gpus_per_node).breakdown["knobs"]
    return reuse_regathered(models.shape(preset), knobs)


def byte_check(run: Run, scheme: str, nodes: int, gpus_per_node: int, regathered: float) -> list[dict]:
    """Per kind of collective, within a node and across nodes: what rank 0 counted per step (the first step left
    out) and what labs.network predicts, in bytes and in bytes per parameter."""
    params = run.summary["params"]
    counted = comm.per_step(run.metrics)
    model = network.counted(network.collectives(scheme, params, network.Cluster(gpus_per_node, nodes, 1, 1),
                                                regathered))
    rows = []
    for kind in sorted(set(model) | {k for k in counted if counted[k]["bytes"] > 1000}):
        got, want = counted.get(kind, {}), model.get(kind, {})
        for where, field in (("within a node", None), ("across nodes", "bytes_across_nodes")):
            measured = got.get(field, 0) if field else got.get("bytes", 0) - got.get("bytes_across_nodes", 0)
            predicted = want.get(field, 0) if field else want.get("bytes", 0) - want.get("bytes_across_nodes", 0)
            if measured or predicted:
                rows.append(dict(kind=kind, where=where, counted=measured, model=predicted,
                                 counted_per_param=measured / params, model_per_param=predicted / params,
                                 ratio=measured / predicted if predicted else None))
    return rows


def stage3_knobs(run: Run) -> dict:
    """The ZeRO-3 knobs that decide what is fetched again (labs.resolve fills the "auto" ones)."""
    zero = run.ds_config["zero_optimization"]
    keys = ("zero_hpz_partition_size", "stage3_max_reuse_distance", "stage3_max_live_parameters",
            "stage3_param_persistence_threshold")
    return {k: zero.get(k, resolve.ZERO_DEFAULTS.get(k)) for k in keys}
