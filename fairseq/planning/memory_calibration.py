"""The calibration of the memory model (fairseq.planning.memory_model): what this fork's allocations cost in
bytes, and what FSDP2, DDP, flash attention and the caching allocator keep beside them. Every assumption that
a measurement could correct is a named constant here, apart from the arithmetic that uses them
(memory_model re-exports them under their names).
"""

GIB = 2**30

# Caching-allocator headroom: reserved memory above the peak of allocated memory (fragmentation, blocks
# cached for other streams), as a fraction of the peak. FSDP.md measured reserved/allocated = 1.24 for plain
# FSDP2 without expandable segments; fairseq's launcher sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,
# which issue 5 targets at <= 1.15. 0.10 is a middle value until the 2 x H200 benchmark says otherwise.
ALLOCATOR_MARGIN_FRACTION = 0.10
# Device memory outside PyTorch's allocator: CUDA context, cuBLAS/NCCL workspaces and communicator buffers.
NON_PYTORCH_OVERHEAD_GIB = 1.0

MASTER_PARAM_BYTES = 4  # fp32 parameters (FSDP2 keeps the sharded parameters in their original dtype)
GRAD_BYTES = 4  # sharded gradients: FSDP2's fp32 reduce-scatter output becomes the .grad (no cast back)
REDUCE_BYTES = 4  # FSDP2 reduce-scatter input buffer: reduce_dtype is fp32 (fairseq.distributed.fsdp)
ADAM_STATE_BYTES = 8  # torch.optim.AdamW: exp_avg and exp_avg_sq in fp32; fused kernel, no temporaries
# fp32 chunks of logits rows that the loss holds beside the logits and their gradient: an upper bound. The chunked
# eager loss (fairseq.criterions.cross_entropy, where Triton is missing) holds one in backward (the recomputed
# probabilities) and two in forward (upcast rows, their log-softmax); on CUDA with Triton the fused kernels
# (fairseq.kernels.cross_entropy) hold none, so a plan whose peak is the loss errs high there by 512 MiB.
LOSS_FP32_CHUNK_COPIES = 2

# FSDP2 (torch 2.13, _fsdp_param_group.py) in forward keeps the previous layer's flat all-gather output alive
# until the next all-gather has been copied out, so a layer in forward holds its unsharded parameters plus
# one flat all-gather buffer: two layer-sized buffers; each explicit prefetch (--fsdp-forward-prefetch,
# depth d) adds one more. In backward: the layer's unsharded parameters plus what it prefetches
# (fairseq.distributed.fsdp.FSDPSettings.backward_prefetch_layers).
FSDP_FORWARD_BUFFERS = 2
# FSDP2 keeps the previous unit's reduce-scatter input (fp32, one layer) until the next unit reduces
# (reduce_scatter_max_input_buffers = 1).
FSDP_RETAINED_REDUCE_BUFFERS = 1
# DDP (gradient_as_bucket_view=False, the default) keeps flat fp32 buckets beside the .grad tensors.
DDP_GRADIENT_BUCKET_COPY = True
# Flash attention's backward accumulates dq in fp32 (4 bytes per element of q).
FLASH_DQ_ACCUM_BYTES = 4

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
FLOAT8_BYTES = 1
# torchao (0.18, torchao/float8/fsdp_utils.py) keeps no amax history for dynamic scaling: the only float8 state
# that outlives a step is, with --fp8-fsdp-all-gather, one fp32 scale per float8 weight
# (WeightWithDynamicFloat8CastTensor._precomputed_scale, set by precompute_float8_dynamic_scale_for_fsdp).
FLOAT8_SCALE_BYTES = 4
