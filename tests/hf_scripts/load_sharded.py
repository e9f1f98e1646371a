"""Transformers' sharded loading at ZeRO-3: TrainingArguments(deepspeed=ds.json) first, then from_pretrained.

argv: MODEL_DIR DS_CONFIG OUT_JSON (DS_CONFIG "none": no DeepSpeed, the plain load). Every rank writes
OUT_JSON.rank<N>: its memory growth while ``from_pretrained`` ran, whether the parameters are partitioned, their
full sizes (``ds_numel``), local element counts and the largest parameter.

Memory: large allocations go to mmap (``mallopt(M_MMAP_THRESHOLD, 64 KiB)``) so a freed tensor leaves the resident
set at once, and the peak is taken two ways:

* ``peak_anon_bytes``: the highest anonymous resident memory (``RssAnon``, the process's own tensors) above the
  value before loading, sampled every millisecond by a thread. safetensors files are read through mmap; their pages
  are file-backed page cache (shared, reclaimable, the same for every library), so they are not the model's memory;
* ``peak_hwm_bytes``: the kernel's high-water mark of the whole RSS (``VmHWM``, reset through
  ``/proc/self/clear_refs``) above the RSS before loading: it also counts the mapped file pages rank 0 reads.
"""

import ctypes
import json
import sys
import threading
import time

import torch
from transformers import AutoModelForCausalLM, TrainingArguments


def _status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_hwm():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class AnonSampler(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.peak = _status("RssAnon")
        self.done = threading.Event()

    def run(self):
        while not self.done.is_set():
            self.peak = max(self.peak, _status("RssAnon"))
            time.sleep(0.001)


def main():
    model_dir, ds_config, out = sys.argv[1:4]
    torch.set_num_threads(1)
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: freed tensors leave the RSS
    args = TrainingArguments(output_dir="/tmp/unused-load-sharded", ddp_backend="gloo", use_cpu=True,
                             report_to="none", deepspeed=None if ds_config == "none" else ds_config)
    args.world_size  # sets up the process group (Accelerate's PartialState) before loading
    anon_before, rss_before = _status("RssAnon"), _status("VmRSS")
    resettable = _reset_hwm()
    sampler = AnonSampler()
    sampler.start()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    sampler.done.set()
    sampler.join()
    sampler.peak = max(sampler.peak, _status("RssAnon"))
    params = list(model.parameters())
    record = {"peak_anon_bytes": sampler.peak - anon_before, "peak_hwm_bytes": _status("VmHWM") - rss_before,
              "resettable": resettable, "rank": args.process_index, "world": args.world_size,
              "partitioned": all(hasattr(p, "ds_id") for p in params),
              "full_numel": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in params),
              "local_numel": sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in params),
              "largest_numel": max(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in params)}
    with open(f"{out}.rank{args.process_index}", "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
