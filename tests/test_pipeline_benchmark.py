"""The pipeline benchmark's baseline (benchmarks/pipeline.py): Llama split into stages of its own modules computes
what `LlamaForCausalLM` computes, so that the benchmark compares AttnRes with Llama pipelined alike."""

import torch
from conftest import TINY_SHAPE
from transformers import LlamaConfig, LlamaForCausalLM

from attnres import AttnResConfig, AttnResForCausalLM
from attnres.training.pipeline import PipelineLayout
from benchmarks.pipeline import LlamaStage


def test_llama_stages_chained_equal_the_whole_model():
    shape = dict(TINY_SHAPE, num_hidden_layers=4, tie_word_embeddings=False)
    llama = LlamaForCausalLM(LlamaConfig(**shape)).eval()
    layout = PipelineLayout.of(AttnResForCausalLM(AttnResConfig(**shape)), num_ranks=2, stages_per_rank=2)
    last = layout.num_stages - 1
    stages = [LlamaStage(llama, layout.stage_layers[s], s == 0, s == last) for s in range(layout.num_stages)]
    ids = torch.randint(3, TINY_SHAPE["vocab_size"], (2, 16))
    with torch.no_grad():
        hidden = ids
        for stage in stages:
            hidden = stage(hidden)
        assert torch.equal(hidden, llama(input_ids=ids).logits)
    # Every parameter in exactly one stage, under the model's own name.
    names = [name for stage in stages for name, _ in stage.named_parameters()]
    assert sorted(names) == sorted(name for name, _ in llama.named_parameters())
