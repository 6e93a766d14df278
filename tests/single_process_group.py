"""One gloo process group of world size 1 inside the pytest process, for tests that need torch.distributed
or DeepSpeed's comm layer without launching ranks. Initialised once; later calls reuse it."""
import os
import socket


def ensure():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch.distributed as dist

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        # A TCP address instead of MASTER_ADDR/RANK/... in os.environ: every process the test session starts later
        # inherits os.environ, and a RANK=0 there makes a launcher look like rank 0 (test_run_control finds ranks so).
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    import deepspeed

    from labs import env

    env.skip_shm_comm_op()                             # as the ranks do: a compile that nothing here uses
    deepspeed.init_distributed(dist_backend="gloo")    # DeepSpeed's comm layer on top of the same group
    return dist
