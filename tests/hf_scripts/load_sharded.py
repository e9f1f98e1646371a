"""Transformers' sharded loading at ZeRO-3: TrainingArguments(deepspeed=ds.json) first, then from_pretrained.

argv: MODEL_DIR DS_CONFIG OUT_JSON. Every rank writes OUT_JSON.rank<N>: its peak RSS (KiB) before and after
from_pretrained, whether the parameters are partitioned, and their full sizes (ds_numel) and local element counts.
"""

import json
import resource
import sys

import torch
from transformers import AutoModelForCausalLM, TrainingArguments


def main():
    model_dir, ds_config, out = sys.argv[1:4]
    torch.set_num_threads(1)
    args = TrainingArguments(output_dir="/tmp/unused-load-sharded", deepspeed=ds_config, ddp_backend="gloo",
                             use_cpu=True, report_to="none")
    args.world_size  # sets up the process group (Accelerate's PartialState) before loading
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    params = list(model.parameters())
    record = {"before_kib": before, "after_kib": after,
              "partitioned": all(hasattr(p, "ds_id") for p in params),
              "full_numel": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in params),
              "local_numel": sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in params),
              "largest_numel": max(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in params)}
    with open(f"{out}.rank{args.process_index}", "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
