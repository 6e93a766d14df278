"""The peak_allocations instrument's replay (labs.instruments.allocations), on allocator records written by hand in
the format of torch.cuda.memory._snapshot()'s device traces. The GPU run it exists for is in results/gpu/."""
from labs.instruments import allocations

SITE = "/opt/venv/lib/python3.12/site-packages/"


def frame(path, line, name):
    return {"filename": path, "line": line, "name": name}


TRAIN = frame("/work/main/labs/train.py", 80, "main")
FORWARD = [frame(SITE + "transformers/models/qwen2/modeling_qwen2.py", 296, "forward"),
           frame(SITE + "torch/nn/modules/module.py", 1790, "_call_impl"), TRAIN]
AUTOGRAD = [frame(SITE + "torch/autograd/graph.py", 829, "_engine_run_backward"),
            frame(SITE + "torch/autograd/__init__.py", 364, "backward"), TRAIN]
GATHER = [frame(SITE + "torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py", 300, "unshard"), TRAIN]


def event(action, addr, size, frames=()):
    return {"action": action, "addr": addr, "size": size, "frames": list(frames), "stream": 0}


def test_the_peak_is_the_moment_the_live_blocks_add_up_to_the_most():
    events = [event("alloc", 1, 100, FORWARD), event("alloc", 2, 50, GATHER),
              event("free_requested", 1, 100, FORWARD),       # another stream still uses it: still held
              event("alloc", 3, 30, AUTOGRAD),                  # 180 live
              event("free_completed", 1, 100, FORWARD),       # 80
              event("alloc", 4, 120, FORWARD),                  # 200 live: the peak
              event("free_completed", 2, 50, GATHER), event("alloc", 5, 40, GATHER)]     # 190 live
    found = allocations.peak_groups(events)
    assert (found["peak_bytes"], found["peak_event"]) == (200, 5)
    assert sorted(b["size"] for b in found["blocks"]) == [30, 50, 120]
    by_label = {g["label"]: g["bytes"] for g in found["groups"]}
    assert by_label["transformers/models/qwen2/modeling_qwen2.py:296 forward < labs/train.py:80 main"] == 120
    assert by_label["(autograd engine) labs/train.py:80 main"] == 30
    assert found["groups"][0]["bytes"] == 120                     # largest first
    assert found["peak_moment"].startswith("transformers/")


def test_a_free_that_waits_for_another_stream_still_holds_its_bytes():
    held = allocations.peak_groups([event("alloc", 1, 100), event("free_requested", 1, 100), event("alloc", 2, 10)])
    released = allocations.peak_groups([event("alloc", 1, 100), event("free_completed", 1, 100),
                                        event("alloc", 2, 10)])
    assert (held["peak_bytes"], released["peak_bytes"]) == (110, 100)


def test_blocks_of_the_autograd_thread_have_no_frames_and_share_one_label():
    found = allocations.peak_groups([event("alloc", 1, 8), event("alloc", 2, 4), event("alloc", 3, 2, GATHER)])
    assert found["groups"][0] == {"label": allocations.NO_FRAMES, "bytes": 12, "blocks": 2}


def test_bytes_from_before_the_record_and_frees_it_never_saw_are_kept_apart():
    found = allocations.peak_groups([event("free_completed", 7, 40), event("alloc", 1, 25, GATHER)], before_bytes=1000)
    assert found["peak_bytes"] == 1025 and found["unmatched_free_bytes"] == 40
    assert found["groups"][0] == {"label": "(allocated before the record started)", "bytes": 1000, "blocks": 1}


def test_a_cpu_run_records_nothing_and_says_why():
    instrument = allocations.PeakAllocations()
    instrument.before_engine()
    instrument.finished(engine=None)
    assert "no CUDA device" in instrument.summary()["skipped"]
