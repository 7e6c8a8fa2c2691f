"""Launch machinery shared by the kernels: programmatic dependent launch and tuner timing."""
