# Source this on the GPU host before anything builds or loads DeepSpeed's async I/O op (NVMe offload): it points the
# compiler, the linker and the loader at Debian's libaio unpacked under /tmp/aio (the host has no network and no
# libaio; see ../shared/gpu/README.md). Unpack first:  for f in .whl/deb/*.deb; do dpkg -x "$f" /tmp/aio; done
AIO_ROOT=${AIO_ROOT:-/tmp/aio}
aio_lib=$AIO_ROOT/usr/lib/x86_64-linux-gnu
# -lcuda at link time: the driver ships libcuda.so.1 only; CUDA's stub answers the link, the driver the load
cuda_stubs=$(python3 -c "import torch.utils.cpp_extension as e; print((e.CUDA_HOME or '') + '/lib64/stubs')" 2>/dev/null)
export CPATH="$AIO_ROOT/usr/include${CPATH:+:$CPATH}"
export LIBRARY_PATH="$aio_lib:$cuda_stubs${LIBRARY_PATH:+:$LIBRARY_PATH}"
export LD_LIBRARY_PATH="$aio_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export CFLAGS="-I$AIO_ROOT/usr/include${CFLAGS:+ $CFLAGS}" LDFLAGS="-L$aio_lib${LDFLAGS:+ $LDFLAGS}"
