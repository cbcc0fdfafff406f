"""Upstream's `quant_noise(module, p, block_size)` wrapper of Linear/Embedding/Conv modules. This fork has no
quantization noise (transformer_lm refuses --quant-noise-pq): with p = 0, upstream's default, the module comes
back unchanged; p > 0 is refused."""


def quant_noise(module, p: float, block_size: int):
    if p <= 0:
        return module
    raise ValueError(
        f"quant_noise(p={p}): quantization noise (iterative product quantization) is not part of this "
        "fairseq fork; pass p=0 (upstream's default)"
    )
