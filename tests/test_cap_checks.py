"""Chapter 9's reading of PyTorch's out-of-memory messages (one_gpu_report.oom_figures) and its counts of what ran out
of memory or reserved more than a real H100 leaves PyTorch (labs.course.cap_checks), against results/gpu."""
import pytest

from labs.course import cap_checks, one_gpu_report

# Real messages from results/gpu: run b (a whole H200; its reserved-but-unused memory in KiB) and run h (the plain
# cap, "... allowed"; the request in MiB)
RUN_B = ("CUDA out of memory. Tried to allocate 112.00 MiB. GPU 0 has a total capacity of 139.80 GiB of which 3.06 MiB "
         "is free. Including non-PyTorch memory, this process has 139.72 GiB memory in use. Of the allocated memory "
         "138.43 GiB is allocated by PyTorch, and 449.50 KiB is reserved by PyTorch but unallocated. If reserved but "
         "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
RUN_H = ("CUDA out of memory. Tried to allocate 296.00 MiB. GPU 0 has a total capacity of 139.80 GiB of which "
         "58.86 GiB is free. Including non-PyTorch memory, this process has 80.93 GiB memory in use. 79.65 GiB "
         "allowed; Of the allocated memory 79.04 GiB is allocated by PyTorch, and 331.63 MiB is reserved by PyTorch "
         "but unallocated. ")
KiB, MiB = 1 / 2**20, 1 / 2**10     # in GiB


def test_each_unit_pytorch_writes_is_read_at_its_scale():
    """c10's format_size writes "N bytes" up to 1 KiB, else KiB, MiB or GiB with two decimals: each is read, in GiB,
    and the figures derived from them (outside_pytorch) are kept whatever the unit."""
    b = one_gpu_report.oom_figures(RUN_B)
    assert b["requested"] == pytest.approx(112 * MiB) and b["reserved_unused"] == pytest.approx(449.5 * KiB)
    assert b["outside_pytorch"] == pytest.approx(139.72 - 138.43 - 449.5 * KiB)
    h = one_gpu_report.oom_figures(RUN_H)
    assert h == pytest.approx(dict(capacity=139.80, in_use=80.93, allocated=79.04, requested=296 * MiB,
                                   reserved_unused=331.63 * MiB, cap=79.65,
                                   outside_pytorch=80.93 - 79.04 - 331.63 * MiB))
    # run b's message as format_size would write smaller sizes: bytes and KiB
    small = RUN_B.replace("112.00 MiB", "20.00 KiB").replace("449.50 KiB", "512 bytes")
    said = one_gpu_report.oom_figures(small)
    assert said["requested"] == pytest.approx(20 * KiB) and said["reserved_unused"] == pytest.approx(512 / 2**30)
    with pytest.raises(ValueError, match="TiB"):
        one_gpu_report.oom_figures(RUN_B.replace("112.00 MiB", "1.00 TiB"))


def test_every_recorded_failure_is_read_whole_and_counted_by_configuration():
    """Every out-of-memory case in results/gpu yields its figures (run b's KiB included); failure_counts counts a
    run's case and a configuration apart, and the configurations predicted to fit list every run they failed in."""
    found = cap_checks.failures()
    assert all(f["reserved_unused_gib"] > 0 for f in found)
    counts = cap_checks.failure_counts(found)
    assert counts["failures"] == len(found) == counts["over_failures"] + counts["fit_failures"]
    assert counts["configurations"] == len({(f["case"], f["preset"], f["gpus"]) for f in found}) < counts["failures"]
    fit = counts["fit_configurations"]
    assert sum(map(len, fit.values())) == counts["fit_failures"]
    zero2 = fit[("stock-zero2-cknone-mb1-ga8", "qwen2.5-3b", 1)]
    assert [f["run"] for f in zero2] == ["y3", "y4", "y5", "y6"]
    assert cap_checks.places(zero2) == ("a real H100 (runs y3, y4), an H200 under labs.card_cap's H100 cap (run y5) "
                                        "and a real H100 under labs.card_cap's H100 cap (run y6)")
    assert cap_checks.places(fit[("labs-zero3-ckfull-mb8-ga1", "qwen2.5-7b", 2)]) == \
        "an H200 under the plain H100 cap (run i)"


def test_over_card_repeats_configurations_across_runs():
    """over_card lists a run's case; runs h and i, and y and y2, share configurations, so it lists fewer
    configurations than rows. Both of run h's best cases are among them (the README's caveat on its row)."""
    from labs.course import gpu_report
    over = cap_checks.over_card()
    assert cap_checks.configurations(over) < len(over)
    best = {gpu_report.best(gpu_report.RUNS["cap"], side)["case"] for side in ("labs", "stock")}
    assert best <= {r["case"] for r in over if r["run"] == "h"}
