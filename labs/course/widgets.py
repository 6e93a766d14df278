"""The chapter-01 memory calculator: a stacked bar of the memory per GPU with the fit verdict, drawn by
one function that both a plain call and the ipywidgets controls use (so a headless run draws the same
chart as the widget's default state).

    from labs.course import widgets
    widgets.memory_bar()              # the default setting, as a plain figure
    widgets.calculator()              # the same, with controls (in Jupyter)

Settings DeepSpeed refuses are refused here too: offload needs ZeRO-1 or more, parameter offload ZeRO-3. The
controls never offer them (`offload_options`); a plain call with one raises LabsError (one line, no traceback
in the widget).
"""
from __future__ import annotations

import matplotlib.pyplot as plt

from labs import config, memory, models, resolve
from labs.errors import LabsError, check_choice

# The chart's first setting. Micro-batch, sequence length and precision are what `labs train` would use for the
# preset (labs.resolve), so the calculator's default describes the default run. The card is an 80 GB H100, on
# which this setting does not fit: a static page then shows the advice, not only a bar.
GPUS_PER_NODE = 8
DEFAULTS = dict(preset="qwen2.5-7b", stage=3, gpus=8, offload="none",
                precision=config.precision(resolve.default_config(3)),
                micro_batch=resolve.run_defaults("qwen2.5-7b")["micro_batch"],
                seq_len=resolve.run_defaults("qwen2.5-7b")["seq_len"], checkpointing="none", loss="hf", gpu="H100")
OFFLOADS = resolve.OFFLOAD_LEVELS
PARTS = (("params", "parameters", "#4c72b0"), ("grads", "gradients", "#dd8452"),
         ("optimizer", "optimizer states", "#55a868"), ("activations", "activations + loss", "#c44e52"),
         ("buffers", "DeepSpeed buffers", "#8172b3"))


def offload_options(stage: int) -> list[str]:
    """The offload levels DeepSpeed accepts at a ZeRO stage: none at stage 0, the optimizer from stage 1 on, the
    parameters too only at stage 3."""
    return [level for level, (optimizer, param) in OFFLOADS.items()
            if (optimizer is None or stage >= 1) and (param is None or stage == 3)]


def bar_data(**values) -> dict:
    """The numbers the bar shows, for a setting (DEFAULTS overridden by `values`)."""
    v = {**DEFAULTS, **values}
    offload_optimizer, offload_param = OFFLOADS[check_choice("offload", v["offload"], OFFLOADS)]
    if v["offload"] not in offload_options(v["stage"]):
        raise LabsError(f"offload '{v['offload']}' needs ZeRO stage {'3' if offload_param else '1 or more'} (got "
                        f"stage {v['stage']}); at this stage choose: {', '.join(offload_options(v['stage']))}")
    checkpointing = int(v["checkpointing"]) if str(v["checkpointing"]).isdigit() else v["checkpointing"]
    if v["gpus"] > GPUS_PER_NODE and v["gpus"] % GPUS_PER_NODE:
        raise LabsError(f"gpus {v['gpus']}: above {GPUS_PER_NODE} the calculator counts whole nodes of "
                        f"{GPUS_PER_NODE} GPUs; give a multiple of {GPUS_PER_NODE}")
    per_node = min(v["gpus"], GPUS_PER_NODE)    # more GPUs than a node holds: nodes of 8, as clusters have
    est = memory.estimate(v["preset"], stage=v["stage"], gpus_per_node=per_node, nodes=-(-v["gpus"] // per_node),
                          precision=v["precision"],
                          offload_optimizer=offload_optimizer, offload_param=offload_param,
                          micro_batch=v["micro_batch"], seq_len=v["seq_len"], activation_checkpointing=checkpointing,
                          loss=v["loss"])
    advice = memory.advise(v["gpu"], **est.inputs)
    peak = est.phases[est.peak_phase]
    card = advice.gpu_memory_bytes
    return dict(setting=v, parts_gib={key: peak[key] / memory.GiB for key, _, _ in PARTS},
                total_gib=est.total_per_gpu_bytes / memory.GiB,
                fit_gib=est.fit_bytes_on(card) / memory.GiB, fit_phase=est.fit_phase_on(card),
                start_up_host_gib=est.start_up_host_per_node_bytes_on(card) / memory.GiB,
                paper_gib=est.paper_model_states_per_gpu_bytes / memory.GiB,
                deepspeed_gib=est.model_states_per_gpu_bytes / memory.GiB,
                host_gib=est.host_per_node_bytes / memory.GiB, peak_phase=est.peak_phase,
                gpu_gib=advice.gpu_memory_bytes / memory.GiB, usable_gib=advice.usable_bytes / memory.GiB,
                fits=advice.fits_as_is, verdict=str(advice))


def memory_bar(ax=None, **values):
    """Draw the stacked bar for a setting; returns (axes, bar_data and, under "drawn", what the axes show)."""
    data = bar_data(**values)
    ax = ax or plt.subplots(figsize=(8, 2.8))[1]
    left = 0.0
    for key, label, color in PARTS:
        width = data["parts_gib"][key]
        ax.barh(1, width, left=left, color=color, label=f"{label} {width:.1f}")
        left += width
    ax.barh(0, data["paper_gib"], color="#999999", label=f"paper: model states only {data['paper_gib']:.1f}")
    s, verdict = data["setting"], "FITS" if data["fits"] else "DOES NOT FIT"
    verdict_line = f"{verdict}: peak {data['total_gib']:.1f} GiB of {data['usable_gib']:.1f} GiB usable on {s['gpu']}"
    if data["fit_phase"] != data["peak_phase"]:     # the start-up flatten, the peak, is made on the CPU on this card
        ax.plot([data["fit_gib"]] * 2, [0.55, 1.45], color="black", ls=":", lw=1.5,
                label=f"what the fit weighs ({data['fit_phase']}) {data['fit_gib']:.1f}")
        verdict_line = (f"{verdict}: {data['fit_gib']:.1f} GiB at {data['fit_phase']} of {data['usable_gib']:.1f} GiB "
                   f"usable on {s['gpu']}; peak {data['total_gib']:.1f} GiB at {data['peak_phase']}, the start-up "
                   f"flatten,\nmade on the CPU on this card ({data['start_up_host_gib']:.0f} GiB of host memory per "
                   f"node of {min(s['gpus'], GPUS_PER_NODE)} GPUs while the ranks start)")
    ax.axvline(data["gpu_gib"], color="black", lw=1.5)
    ax.axvline(data["usable_gib"], color="black", ls="--", lw=1)
    ax.text(data["gpu_gib"], 1.45, f" {data['setting']['gpu']}", va="center", fontsize=8)
    ax.set(yticks=[0, 1], yticklabels=["paper", f"peak ({data['peak_phase']})"], xlabel="GiB per GPU",
           xlim=(0, max(data["total_gib"], data["gpu_gib"]) * 1.15), ylim=(-0.6, 1.7),
           title=f"{s['preset']}, ZeRO-{s['stage']}, {s['gpus']} GPUs, offload {s['offload']}, {s['precision']}, "
                 f"{s['micro_batch']} x {s['seq_len']} tokens, checkpointing {s['checkpointing']}, loss {s['loss']}\n"
                 f"{verdict_line}")
    ax.title.set_fontsize(8)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="GiB")
    return ax, dict(data, drawn=drawing(ax))


def drawing(ax) -> dict:
    """What the axes show, read back from matplotlib: each bar (y, left, width, colour), each vertical line, the
    title and the legend (rounded to what the eye can tell apart). Two charts that agree here look the same."""
    bars = [(round(float(p.get_y() + p.get_height() / 2), 2), round(float(p.get_x()), 3),
             round(float(p.get_width()), 3), tuple(round(float(c), 3) for c in p.get_facecolor())) for p in ax.patches]
    lines = [(round(float(line.get_xdata()[0]), 3), line.get_linestyle()) for line in ax.get_lines()]
    legend = ax.get_legend()
    return dict(bars=bars, lines=lines, title=ax.get_title(),
                legend=[t.get_text() for t in legend.get_texts()] if legend else [])


def checkpointing_options(preset: str) -> list[str]:
    """Every setting labs accepts for the preset: none, each number of layers, full (so any advice can be set)."""
    layers = models.shape(preset)["num_hidden_layers"]
    return ["none"] + [str(k) for k in range(1, layers)] + ["full"]


class Calculator:
    """ipywidgets controls around `memory_bar`. `.data` holds what the bar currently shows (with `drawn`, what the
    chart draws); `.first` what it showed when it was built (the default setting), so a check against the plain
    call stays true while the reader plays. The offload control offers only what the stage allows."""

    def __init__(self, **values):
        import ipywidgets as w

        v = {**DEFAULTS, **values}
        self.controls = dict(
            preset=w.Dropdown(options=list(models.PRESETS), value=v["preset"], description="preset"),
            stage=w.Dropdown(options=[0, 1, 2, 3], value=v["stage"], description="ZeRO stage"),
            gpus=w.Dropdown(options=[1, 2, 4, 8, 16, 32, 64, 128, 256], value=v["gpus"], description="GPUs"),
            offload=w.Dropdown(options=offload_options(v["stage"]), value=v["offload"], description="offload"),
            precision=w.Dropdown(options=list(config.PRECISIONS), value=v["precision"], description="dtype"),
            micro_batch=w.Dropdown(options=[1, 2, 4, 8, 16], value=v["micro_batch"], description="micro-batch"),
            seq_len=w.Dropdown(options=[512, 1024, 2048, 4096, 8192, 16384, 32768], value=v["seq_len"],
                               description="seq len"),
            checkpointing=w.Dropdown(options=checkpointing_options(v["preset"]), value=str(v["checkpointing"]),
                                     description="checkpoint"),
            loss=w.Dropdown(options=["hf", "chunked", "liger"], value=v["loss"], description="loss"),
            gpu=w.Dropdown(options=list(memory.GPUS), value=v["gpu"], description="GPU"))
        self.output = w.Output()
        self.controls["preset"].observe(self._preset_changed, names="value")
        self.controls["stage"].observe(self._stage_changed, names="value")     # before the redraw below
        for control in self.controls.values():
            control.observe(lambda change: self.draw(), names="value")
        self.widget = w.VBox([w.HBox(list(self.controls.values())[:5]), w.HBox(list(self.controls.values())[5:]),
                              self.output], layout=w.Layout(flex_flow="column"))
        for box in self.widget.children[:2]:
            box.layout.flex_flow = "row wrap"
        self.data = None
        self.draw()
        self.first = self.data

    def _preset_changed(self, change):
        """The checkpointing choices follow the preset's number of layers (keeping none / full as they were)."""
        control = self.controls["checkpointing"]
        value = control.value if control.value in ("none", "full") else "none"
        control.options = checkpointing_options(change["new"])
        control.value = value

    def _stage_changed(self, change):
        """Offload choices follow the stage (DeepSpeed refuses offload at stage 0, parameter offload below 3)."""
        control = self.controls["offload"]
        allowed = offload_options(change["new"])
        value = control.value if control.value in allowed else "none"
        control.options = allowed
        control.value = value

    def values(self) -> dict:
        return {name: control.value for name, control in self.controls.items()}

    def draw(self):
        from IPython.display import display

        with self.output:
            self.output.clear_output(wait=True)
            try:
                ax, self.data = memory_bar(**self.values())
            except LabsError as error:              # a setting labs refuses: one line, as the CLI prints it
                plt.close("all")
                print(f"labs: error: {error}")
                return
            display(ax.figure)
            plt.close(ax.figure)
            print(self.data["verdict"])

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)


def calculator(**values) -> Calculator:
    return Calculator(**values)
