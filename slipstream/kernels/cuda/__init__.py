"""CUDA C++ kernels compiled with NVRTC at run time, for what Triton cannot express."""
