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
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        dist.init_process_group("gloo", rank=0, world_size=1)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")    # DeepSpeed's comm layer on top of the same group
    return dist
