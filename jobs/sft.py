"""`ray job submit ... -- python jobs/sft.py --data SPEC --out DIR [--config FILE] [--resume] [key=value ...]`.

A thin entry point of ``dice-ray sft`` (the masked-diffusion SFT warm start) for a Ray job; chain RL on
its output with ``python jobs/train.py model.path=DIR``.
"""

import sys

from dice_ray.cli import main

if __name__ == "__main__":
    sys.exit(main(["sft", *sys.argv[1:]]))
