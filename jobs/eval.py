"""`ray job submit ... -- python jobs/eval.py --tasks SPEC (--model PATH | --solutions DIR) [--out DIR] [key=value ...]`.

A thin entry point: inside a Ray job RAY_ADDRESS is set, so a cluster with GPUs verifies through a
VerifierPool (see ``dice_ray.eval.run``).
"""

import sys

from dice_ray.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", *sys.argv[1:]]))
