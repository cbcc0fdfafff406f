"""Hand-written GPU kernels (Triton) for the few places where eager PyTorch makes several passes over memory
that one kernel makes once. Each has an eager fallback where Triton or CUDA is not available; nothing here is
imported until a kernel is used."""
