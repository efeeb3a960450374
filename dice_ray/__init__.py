"""dice-ray: DICE's bi-phase RL (arXiv 2602.11715) of diffusion LLMs writing CUDA kernels, on Ray."""

__version__ = "0.1.0"
