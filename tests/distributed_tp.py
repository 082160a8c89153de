"""Tensor parallelism through the config's `base_model_tp_plan`, for `test_training.py`'s tensor-parallel test.

    python tests/distributed_tp.py --checkpoint DIR --output single.pt
    torchrun --nproc_per_node 2 tests/distributed_tp.py --checkpoint DIR --output tp.pt --tp

With `--tp` every process loads the checkpoint with `tp_plan="auto"` (Transformers shards the attention and MLP or
expert weights by the plan, over gloo on a CPU) and process 0 saves the logits of a fixed batch and the names of the
sharded parameters; without it one process computes them unsharded.
"""

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import attnres  # noqa: F401  (registers the AttnRes classes with the Auto classes)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--tp", action="store_true")
    args = parser.parse_args()

    options = dict(tp_plan="auto") if args.tp else {}
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32, **options).eval()
    input_ids = torch.randint(3, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=input_ids, use_cache=False).logits
    if not args.tp or dist.get_rank() == 0:
        sharded = sorted(name for name, p in model.named_parameters() if type(p.data).__name__ == "DTensor")
        torch.save({"logits": logits, "sharded": sharded}, args.output)
    if args.tp:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
