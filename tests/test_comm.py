"""labs.comm: the accounting is pure arithmetic; the counter is checked on a real (single-process) gloo group."""
import pytest
import torch

from labs.instruments import comm


def test_volume_counts_all_reduce_twice_and_wire_bytes_take_the_ring_share():
    counts = {"all_reduce": {"calls": 2, "bytes": 100}, "all_gather": {"calls": 1, "bytes": 50},
              "reduce_scatter": {"calls": 3, "bytes": 50}}
    assert comm.volume_bytes(counts) == 300
    assert comm.wire_bytes(counts, 2) == 150 and comm.wire_bytes(counts, 4) == 225


def test_paper_volumes():
    assert [comm.paper_volume_elements(s, 10) for s in (0, 1, 2, 3)] == [20, 20, 20, 30]
    with pytest.raises(ValueError):
        comm.paper_volume_elements(4, 10)


def test_zero3_reuse_model_on_a_trace():
    """The reuse rule on Qwen2.5-7B's trace (untied): at distance 0 every partitioned parameter is gathered in forward
    and again in backward; at the default 1e9 only the output head, whose backward follows its forward at once,
    stays; a distance larger than the whole step keeps everything. Persistent tensors count once (re-gathered
    after the optimizer step)."""
    from labs import models
    from labs.memory import layout

    dims = models.shape("qwen2.5-7b")
    sizes = [n for _, n in layout.param_layout(dims)]
    threshold = 10 * dims["hidden_size"]
    persistent = sum(n for n in sizes if n <= threshold)
    partitioned = sum(sizes) - persistent
    head = models.param_counts(dims)["lm_head"]
    assert comm.zero3_gathered_elements(dims, 0, threshold) == 2 * partitioned + persistent
    assert comm.zero3_gathered_elements(dims, 1e9, threshold) == 2 * partitioned - head + persistent
    assert comm.zero3_gathered_elements(dims, 1e12, threshold) == partitioned + persistent
    trace = comm.zero3_module_trace(models.shape("tiny"))
    uses = [name for module in trace for name, _ in module].count("model.embed_tokens.weight")
    assert uses == 4 and trace == trace[::-1]          # tied: input embedding and head, forward and backward


def test_per_step_means_skip_the_first_step():
    records = [{"step": 1, "comm": {"all_gather": {"calls": 9, "bytes": 400}}},
               {"step": 2, "comm": {"all_gather": {"calls": 2, "bytes": 100}}},
               {"step": 3, "comm": {"all_gather": {"calls": 4, "bytes": 100}, "reduce": {"calls": 1, "bytes": 8}}}]
    assert comm.per_step(records) == {"all_gather": {"calls": 3, "bytes": 100}, "reduce": {"calls": 0.5, "bytes": 4}}
    assert comm.per_step(records, skip=0)["all_gather"]["bytes"] == 200


def test_payload_bytes_of_tensors_and_lists():
    assert comm.payload_bytes(torch.zeros(10, dtype=torch.bfloat16)) == 20
    assert comm.payload_bytes([torch.zeros(3), [torch.zeros(2, dtype=torch.float64)]]) == 28
    assert comm.payload_bytes(None) == 0


def test_counter_counts_each_collective_once_by_its_full_payload():
    import single_process_group

    dist = single_process_group.ensure()
    original = dist.all_reduce
    counter = comm.CollectiveCounter().install()
    try:
        x = torch.ones(1000)                                       # 4,000 bytes
        dist.all_reduce(x)
        dist.all_gather_into_tensor(torch.empty(1000), x)          # counted by its (whole) output
        dist._all_gather_base(torch.empty(1000), x)                # a torch wrapper over the above: counted once
        dist.reduce_scatter_tensor(torch.empty(1000), x)           # counted by its (whole) input
        assert counter.take() == {"all_reduce": {"calls": 1, "bytes": 4000},
                                  "all_gather": {"calls": 2, "bytes": 8000},
                                  "reduce_scatter": {"calls": 1, "bytes": 4000}}
        dist.broadcast(x, 0)
        counter.drop()
        dist.reduce(torch.ones(4, dtype=torch.bfloat16), 0)
        assert counter.take() == {"reduce": {"calls": 1, "bytes": 8}}
        assert counter.totals["all_gather"] == {"calls": 2, "bytes": 8000} and "broadcast" not in counter.totals
    finally:
        counter.uninstall()
    assert dist.all_reduce is original
