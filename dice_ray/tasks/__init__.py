"""dice_ray.tasks: the task model, its loaders (built-in suite, DICE JSON, KernelBench), infill
scaffolds and prompt templates.  Sources are parsed, never executed, here."""

from dice_ray.tasks.loaders import LoadReport, Rejection, load_reference_file, load_tasks
from dice_ray.tasks.prompts import assemble_candidate, build_prompt, sft_pairs
from dice_ray.tasks.scaffold import Scaffold, ScaffoldError, make_scaffold
from dice_ray.tasks.task import Task
from dice_ray.tasks.validate import TaskError

__all__ = [
    "LoadReport",
    "Rejection",
    "Scaffold",
    "ScaffoldError",
    "Task",
    "TaskError",
    "assemble_candidate",
    "build_prompt",
    "load_reference_file",
    "load_tasks",
    "make_scaffold",
    "sft_pairs",
]
