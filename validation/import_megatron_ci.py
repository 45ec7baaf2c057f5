#!/usr/bin/env python3
"""Writes validation/cases/*.yaml from a checkout of NVIDIA/Megatron-LM's functional tests.

Each case is one real measurement: the launch line and environment of a functional test
(tests/functional_tests/test_cases/{gpt,moe}/NAME/model_config.yaml), the world size of
the recipe that runs it on the platform (tests/test_utils/recipes/{h100,gb200}/*.yaml:
nodes x gpus), and the memory its golden values recorded there (golden_values_dev_PLATFORM.json:
TensorBoard's mem-max-allocated-bytes and mem-allocated-bytes, logged by the last rank),
and its iteration time (TensorBoard's iteration-time, seconds per iteration).

Usage (a developer's tool; needs python3-yaml, which memsim itself does not):
  git -C MEGATRON_MIRROR archive COMMIT tests | tar -x -C /tmp/mlm
  validation/import_megatron_ci.py /tmp/mlm COMMIT [--platform dgx_h100|dgx_gb200] \
      [--history MEGATRON_MIRROR]

With --history (a Megatron-LM git directory holding COMMIT), each case also records when
its golden values were last regenerated (measured.recorded) and, where that was before the
dev container's PyTorch gave Blackwell a 32 MiB default cuBLAS workspace, the older default
(stack.default_cublas_workspace_config; Note [Software of a measurement] in
tools/lib/validate.h), and whether it was regenerated on Megatron-LM code that kept every
microbatch's batch on the GPU (stack.keeps_microbatch_batches) or on Megatron-FSDP before
two changes (stack.fsdp_final_norm_gathers_every_forward, stack.fsdp_reset_releases_non_unit).

Cases of H100 runs are named after the test case; the other platforms' get "@a100" or
"@gb200" after it (file NAME__gb200.yaml), so one test measured on two GPUs is two cases.

Tolerances are not written here: validation/tolerances.yaml holds them, by hand, each
with the reason the case is not yet closer.
"""
import argparse
import glob
import json
import os
import subprocess
import sys

import yaml

GPU_OF_PLATFORM = {"dgx_h100": "H100-80GB", "dgx_a100": "A100-80GB", "dgx_gb200": "GB200-186GB"}
# The recipe folder that runs each platform's tests (h100/ runs A100 and H100 alike).
RECIPES_OF_PLATFORM = {"dgx_h100": "h100", "dgx_a100": "h100", "dgx_gb200": "gb200"}
# Pretraining runs only (the other recipes run inference, RL or performance sweeps that
# log no training memory of this kind); gb200/ splits them into 2-node and 1-node files.
PRETRAINING_RECIPES = ("gpt.yaml", "moe.yaml", "gpt-1node.yaml", "moe-1node.yaml")


def runs_dev_on(product, spec, platform):
    """Whether a recipe's test-case entry runs in the dev environment on `platform` (a
    variant without `platforms` runs on the spec's: dgx_a100 in h100/), so that its
    golden_values_dev_PLATFORM.json is still regenerated."""
    def listed(value):
        return value if isinstance(value, list) else [value]
    for variant in product.get("products", []):
        platforms = listed(variant.get("platforms", spec.get("platforms", [])))
        if "dev" in listed(variant.get("environment", [])) and platform in platforms:
            return True
    return False


def world_sizes(root, platform):
    """test_case -> (nodes * gpus, recipe path) from the recipes that run gpt/moe cases."""
    sizes = {}
    folder = RECIPES_OF_PLATFORM[platform]
    for path in sorted(glob.glob(os.path.join(root, f"tests/test_utils/recipes/{folder}/*.yaml"))):
        if os.path.basename(path) not in PRETRAINING_RECIPES:
            continue
        with open(path) as f:
            recipe = yaml.safe_load(f)
        spec = recipe.get("spec", {})
        for product in recipe.get("products", []):
            if not runs_dev_on(product, spec, platform):
                continue
            nodes = product.get("nodes", spec.get("nodes", 1))
            gpus = product.get("gpus", spec.get("gpus", 8))
            for case in product.get("test_case", []):
                sizes.setdefault((spec["model"], case), (nodes * gpus, os.path.relpath(path, root)))
    return sizes


# PyTorch's default cuBLAS workspace on Blackwell before pytorch/pytorch#175344, and the day
# the CI's dev container moved to NGC PyTorch 26.04, which has the 32 MiB default
# (docker/.ngc_version.dev, Megatron-LM commit 5fe3f06658).
OLD_BLACKWELL_CUBLAS_DEFAULT = ":4096:2:16:8"
FIRST_32MIB_BLACKWELL_DAY = "2026-05-07"
# Until this day (Megatron-LM commit adfe9e11d9) Megatron-FSDP kept the gradients of bf16
# runs in fp32 (grad_reduce_in_fp32, on for bf16); since then 'auto' means the parameters'.
FIRST_AUTO_FSDP_GRADS_DAY = "2026-07-01"
# RerunDataIterator kept every microbatch's batch on the GPU from the first commit to the
# second (Note [Software of a measurement] in tools/lib/validate.h).
BATCHES_KEPT_FROM, BATCHES_KEPT_UNTIL = "5e4fc931ba", "bf32f4415e"
# Megatron-FSDP from these commits on: the final norm's hook gathers the layers again in the
# first forward only; reset() keeps the non-unit buckets.
FSDP_FIRST_FORWARD_ONLY, FSDP_NON_UNIT_PRESERVED = "41f3b6f308", "378d81fbd3"
FSDP_GRAD_ARGS = ("--megatron-fsdp-main-grads-dtype", "--megatron-fsdp-grad-comm-dtype")


def memory_series(history, commit, path):
    """The golden file's two memory series at `commit`, as comparable text (None: unreadable)."""
    shown = subprocess.run(["git", "-C", history, "show", f"{commit}:{path}"],
                           capture_output=True, text=True)
    if shown.returncode != 0:
        return None
    golden = json.loads(shown.stdout)
    return json.dumps([golden.get(m, {}).get("values")
                       for m in ("mem-max-allocated-bytes", "mem-allocated-bytes")], sort_keys=True)


def regeneration(history, commit, path):
    """The last commit up to `commit` that changed the file's memory values, and its day
    (commits that only reformat it or touch other metrics are skipped): (sha, day)."""
    log = subprocess.run(["git", "-C", history, "log", "--format=%H %ad", "--date=short", commit,
                          "--", path], capture_output=True, text=True, check=True).stdout.split()
    commits = list(zip(log[0::2], log[1::2]))
    values = memory_series(history, commit, path)
    for (sha, day), (parent, _) in zip(commits, commits[1:] + [(None, None)]):
        if parent is None or memory_series(history, parent, path) != values:
            return sha, day
    return None, None


def contains(history, ancestor, commit):
    """Whether `commit`'s code includes `ancestor`."""
    return subprocess.run(["git", "-C", history, "merge-base", "--is-ancestor", ancestor, commit],
                          capture_output=True).returncode == 0


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
    parser.add_argument("--history", help="Megatron-LM git directory: record regeneration days")
    opts = parser.parse_args()
    sizes = world_sizes(opts.megatron_root, opts.platform)
    suffix = "" if opts.platform == "dgx_h100" else opts.platform.replace("dgx_", "")
    written = 0
    pattern = f"tests/functional_tests/test_cases/[gm][po][te]/*/golden_values_dev_{opts.platform}.json"
    for golden_path in sorted(glob.glob(os.path.join(opts.megatron_root, pattern))):
        case_dir = os.path.dirname(golden_path)
        model, test_case = case_dir.split(os.sep)[-2:]
        with open(golden_path) as f:
            golden = json.load(f)
        if (model, test_case) not in sizes:
            print(f"skipped {test_case}: no {RECIPES_OF_PLATFORM[opts.platform]} recipe gives its "
                  "world size", file=sys.stderr)
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
            "name": f"{test_case}@{suffix}" if suffix else test_case,
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
        if opts.history:
            sha, day = regeneration(opts.history, opts.commit, rel(golden_path))
            case["measured"]["recorded"] = day
            stack = {}
            if (opts.platform == "dgx_gb200" and day < FIRST_32MIB_BLACKWELL_DAY
                    and "CUBLAS_WORKSPACE_CONFIG" not in case["env"]):
                stack["default_cublas_workspace_config"] = OLD_BLACKWELL_CUBLAS_DEFAULT
            if (model_args.get("--use-megatron-fsdp") and model_args.get("--bf16")
                    and day < FIRST_AUTO_FSDP_GRADS_DAY
                    and not model_args.get("--grad-reduce-in-bf16")):
                old_defaults = {a: "fp32" for a in FSDP_GRAD_ARGS if a not in model_args}
                if old_defaults:
                    stack["args"] = old_defaults
            if (contains(opts.history, BATCHES_KEPT_FROM, sha)
                    and not contains(opts.history, BATCHES_KEPT_UNTIL, sha)):
                stack["keeps_microbatch_batches"] = True
            if model_args.get("--use-megatron-fsdp"):
                if not contains(opts.history, FSDP_FIRST_FORWARD_ONLY, sha):
                    stack["fsdp_final_norm_gathers_every_forward"] = True
                if not contains(opts.history, FSDP_NON_UNIT_PRESERVED, sha):
                    stack["fsdp_reset_releases_non_unit"] = True
            if stack:
                case["stack"] = stack
        iteration_time = steady_iteration_time(golden, last_step)
        if iteration_time is not None:
            case["measured"]["iteration_time_s"] = iteration_time
        out = os.path.join(opts.out, f"{model}__{test_case}" + (f"__{suffix}" if suffix else "") + ".yaml")
        with open(out + ".tmp", "w") as f:
            f.write("# Generated by validation/import_megatron_ci.py; do not edit by hand.\n")
            yaml.safe_dump(case, f, sort_keys=False, width=100)
        os.replace(out + ".tmp", out)
        written += 1
    print(f"wrote {written} cases to {opts.out}")


if __name__ == "__main__":
    main()
