"""`ray job submit ... -- python jobs/train.py [--config FILE] [key=value ...] [--resume RUN_DIR] [--dry-run]`.

A thin entry point: inside a Ray job, RAY_ADDRESS is set, so the trainer joins the job's cluster.
"""

import sys

from dice_ray.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
