"""The native kernels the models run on: C for CPU, Triton for CUDA, and their Python wrappers.

``csrc/`` holds the C sources (shipped with the package): one shared library, built once per
machine with its compiler (``-march=native``) and cached by the sources' hash (``build.py``),
loaded once per process by ``library.py``, which declares every function's ctypes signature.
A module per kernel wraps its functions for tensors and says whether it is in use:
``paged_decode`` (decode attention over the paged KV cache), ``fused_ops`` (RMSNorm, rotary
embedding, SiLU-and-mul, the KV-cache write, the greedy pick; float32 and bfloat16),
``small_batch_gemm`` (matmuls of a few rows), ``quant_gemm`` and ``bf16_gemm`` (the same on
quantized and on bfloat16 weights; their load state is one ``panel_kernel.PanelKernel``
each), ``decode_stack`` (a decode step's layers in one call);
``gemm`` picks the matmul kernel for every linear layer (MKL, oneDNN, the small-batch kernels).
The C code picks its vector paths by the CPU's flags (the ones ``-march=native`` found;
``bf16_gemm`` also at run time, among the variants compiled); without a compiler, or with a
kernel's off switch, the models use their torch code.

``triton_paged_attention`` holds the CUDA attention kernels; importing it imports triton (a test
extra), so only the Triton attention backend does, when chosen (``triton_support`` answers what
Triton can do without importing it).

Nothing here knows a model: the models hand the kernels tensors (``models/`` imports this
package, never the other way).
"""
