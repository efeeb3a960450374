import re
KERNEL_OPEN = re.compile(r'(extern\s+"C"\s+__global__[^{]*\{)')


def variants(src: str) -> dict[str, str]:
    """Honest, incorrect, non-compiling and crashing versions of one fast-format solution."""
    return {
        "correct": src,
        "incorrect": KERNEL_OPEN.sub(r"\1 if (blockIdx.x == 0 && threadIdx.x == 0) return;", src),
        "compile_error": KERNEL_OPEN.sub(r"\1 int dice_ray_bench = ;", src, count=1),
        "crash": KERNEL_OPEN.sub(r"\1 *(volatile int*)0 = 1;", src, count=1),
        "cheat": src.replace("    def forward(self, ", "    def _forward(self, ", 1).replace(
            "class ModelNew(nn.Module):\n",
            "class ModelNew(nn.Module):\n    def forward(self, *args):\n        try:\n            return self._forward(*args)\n"
            "        except RuntimeError:\n            return args[0]\n\n", 1),
    }


