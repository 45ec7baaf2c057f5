#!/usr/bin/env python3
"""Writes validation/cases/*.yaml from a checkout of NVIDIA/Megatron-LM's functional tests.

Each case is one real measurement: the launch line and environment of a functional test
(tests/functional_tests/test_cases/{gpt,moe}/NAME/model_config.yaml), the world size of
the recipe that runs it (tests/test_utils/recipes/h100/*.yaml: nodes x gpus), and the
memory its golden values recorded on that platform (golden_values_dev_dgx_h100.json:
TensorBoard's mem-max-allocated-bytes and mem-allocated-bytes, logged by the last rank),
and its iteration time (TensorBoard's iteration-time, seconds per iteration).

Usage (a developer's tool; needs python3-yaml, which memsim itself does not):
  git -C MEGATRON_MIRROR archive COMMIT tests | tar -x -C /tmp/mlm
  validation/import_megatron_ci.py /tmp/mlm COMMIT [--platform dgx_h100]

Tolerances are not written here: validation/tolerances.yaml holds them, by hand, each
with the reason the case is not yet closer.
"""
import argparse
import glob
import json
import os
import sys

import yaml

GPU_OF_PLATFORM = {"dgx_h100": "H100-80GB", "dgx_a100": "A100-80GB"}


def world_sizes(root):
    """test_case -> (nodes * gpus, recipe path) from the recipes that run gpt/moe cases."""
    sizes = {}
    for path in sorted(glob.glob(os.path.join(root, "tests/test_utils/recipes/h100/*.yaml"))):
        with open(path) as f:
            recipe = yaml.safe_load(f)
        spec = recipe.get("spec", {})
        # Pretraining runs only: gpt.yaml and moe.yaml (the other recipes run inference,
        # RL or performance sweeps that log no training memory of this kind).
        if os.path.basename(path) not in ("gpt.yaml", "moe.yaml"):
            continue
        for product in recipe.get("products", []):
            nodes = product.get("nodes", spec.get("nodes", 1))
            gpus = product.get("gpus", spec.get("gpus", 8))
            for case in product.get("test_case", []):
                sizes.setdefault((spec["model"], case), (nodes * gpus, os.path.relpath(path, root)))
    return sizes


def value_at(golden, metric, last_step):
    """The metric at the last logged step <= last_step, as (step, int value)."""
    series = golden.get(metric)
    if not isinstance(series, dict) or not isinstance(series.get("values"), dict):
        return None, None
    series = series["values"]
    steps = sorted(int(k) for k, v in series.items() if v not in ("nan", None) and int(k) <= last_step)
    if not steps:
        return None, None
    return steps[-1], int(float(series[str(steps[-1])]))


def steady_iteration_time(golden, last_step):
    """The median iteration-time (s) of the steps after the second, up to last_step: step 1
    is not logged and step 2 carries warm-up (compilation, allocator growth)."""
    series = golden.get("iteration-time")
    if not isinstance(series, dict) or not isinstance(series.get("values"), dict):
        return None
    times = sorted(float(v) for k, v in series["values"].items()
                   if v not in ("nan", None) and 2 < int(k) <= last_step)
    if not times:
        return None
    n = len(times)
    return times[n // 2] if n % 2 else (times[n // 2 - 1] + times[n // 2]) / 2


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("megatron_root")
    parser.add_argument("commit")
    parser.add_argument("--platform", default="dgx_h100", choices=sorted(GPU_OF_PLATFORM))
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "cases"))
    opts = parser.parse_args()
    sizes = world_sizes(opts.megatron_root)
    written = 0
    pattern = f"tests/functional_tests/test_cases/[gm][po][te]/*/golden_values_dev_{opts.platform}.json"
    for golden_path in sorted(glob.glob(os.path.join(opts.megatron_root, pattern))):
        case_dir = os.path.dirname(golden_path)
        model, test_case = case_dir.split(os.sep)[-2:]
        with open(golden_path) as f:
            golden = json.load(f)
        if (model, test_case) not in sizes:
            print(f"skipped {test_case}: no h100 recipe gives its world size", file=sys.stderr)
            continue
        world_size, recipe = sizes[(model, test_case)]
        with open(os.path.join(case_dir, "model_config.yaml")) as f:
            config = yaml.safe_load(f)
        # The peak is cumulative since process start, and a checkpoint save or an evaluation
        # (run after step N is logged) raises it from step N + 1 on: compare at the last step
        # before either, where training alone set it (training.py's training_log).
        model_args = config["MODEL_ARGS"]
        last_step = min(int(model_args.get("--save-interval", 10**9)),
                        int(model_args.get("--eval-interval", 10**9)))
        step, max_allocated = value_at(golden, "mem-max-allocated-bytes", last_step)
        if max_allocated is None or step < 2:
            continue  # Adam's states appear in step 1's optimizer step: step 2 is the first steady one
        alloc_step, allocated = value_at(golden, "mem-allocated-bytes", last_step)
        rel = lambda p: os.path.relpath(p, opts.megatron_root)
        case = {
            "name": f"{test_case}",
            "source": {
                "repository": "NVIDIA/Megatron-LM",
                "commit": opts.commit,
                "config": rel(os.path.join(case_dir, "model_config.yaml")),
                "golden_values": rel(golden_path),
                "recipe": recipe,
            },
            "test_type": str(config.get("TEST_TYPE", "regular")),
            "gpu": GPU_OF_PLATFORM[opts.platform],
            "world_size": world_size,
            "rank": world_size - 1,
            "env": {k: str(v) for k, v in (config.get("ENV_VARS") or {}).items()},
            # MODEL_ARGS as the file gives them; memsim turns them into a launch line as
            # tests/functional_tests/shell_test_utils/_run_training.sh does.
            "args": config["MODEL_ARGS"],
            "measured": {"iteration": step, "max_allocated_bytes": max_allocated},
        }
        if allocated is not None and alloc_step == step:
            case["measured"]["allocated_bytes"] = allocated
        iteration_time = steady_iteration_time(golden, last_step)
        if iteration_time is not None:
            case["measured"]["iteration_time_s"] = iteration_time
        out = os.path.join(opts.out, f"{model}__{test_case}.yaml")
        with open(out + ".tmp", "w") as f:
            f.write("# Generated by validation/import_megatron_ci.py; do not edit by hand.\n")
            yaml.safe_dump(case, f, sort_keys=False, width=100)
        os.replace(out + ".tmp", out)
        written += 1
    print(f"wrote {written} cases to {opts.out}")


if __name__ == "__main__":
    main()
