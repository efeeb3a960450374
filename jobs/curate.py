"""`ray job submit ... -- python jobs/curate.py --tasks SPEC [--min-speedup 2.0] --out FILE [key=value ...]`.

A thin entry point: inside a Ray job RAY_ADDRESS is set, so the job's GPUs verify through a
VerifierPool (see ``dice_ray.eval.curate``).
"""

import sys

from dice_ray.cli import main

if __name__ == "__main__":
    sys.exit(main(["curate", *sys.argv[1:]]))
