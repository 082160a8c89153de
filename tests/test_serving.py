"""Serving a converted SmolLM2-135M-Instruct AttnRes checkpoint the ways Transformers serves models: continuous
batching (`generate_batch`) and the OpenAI-compatible server (`attnres serve`, which runs `transformers serve`),
each against `generate`'s greedy output."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


from conftest import free_port, wait_until_healthy
from test_transformers_integration import CACHE_PAGES, generate_batch_equals_generate


QUESTIONS = ["Who wrote Hamlet?", "What is the capital of France?", "Name three colours."]
MAX_NEW_TOKENS = 16


@pytest.fixture(scope="module")
def model_and_tokenizer(converted_smollm2):
    model = AutoModelForCausalLM.from_pretrained(converted_smollm2, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(converted_smollm2)


def chat_prompt(tokenizer, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]


def greedy_answer(model, tokenizer, question: str) -> str:
    prompt = torch.tensor([chat_prompt(tokenizer, question)])
    output = model.generate(prompt, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    return tokenizer.decode(output[0, prompt.shape[1] :], skip_special_tokens=True)


def test_continuous_batching_equals_generate_on_converted_smollm2(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    generate_batch_equals_generate(model, [chat_prompt(tokenizer, q) for q in QUESTIONS], MAX_NEW_TOKENS)


def start_server(checkpoint: Path, port: int, options: tuple[str, ...]) -> subprocess.Popen:
    command = [sys.executable, "-m", "attnres_cli", "serve", str(checkpoint), "--host", "127.0.0.1"]
    command += ["--port", str(port), "--device", "cpu", "--dtype", "float32", *options]
    if "--continuous-batching" in options:  # a bounded paged cache, as `generate_batch_equals_generate` gives it
        command += ["--cb-num-blocks", str(CACHE_PAGES)]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_until_healthy(server, port, 180, lambda: server.stdout.read())
    return server


@pytest.mark.parametrize(
    "options", [(), ("--trust-remote-code", "--continuous-batching")], ids=["installed", "remote-code-cb"]
)
def test_served_chat_completion_equals_generate(converted_smollm2, model_and_tokenizer, options):
    import openai

    model, tokenizer = model_and_tokenizer
    port = free_port()
    server = start_server(converted_smollm2, port, options)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        request = dict(model=str(converted_smollm2), max_tokens=MAX_NEW_TOKENS, temperature=0)
        question = QUESTIONS[0]
        messages = [{"role": "user", "content": question}]
        answer = client.chat.completions.create(messages=messages, **request).choices[0].message.content
        chunks = client.chat.completions.create(messages=messages, stream=True, **request)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    expected = greedy_answer(model, tokenizer, question)
    assert answer == expected
    assert streamed == expected


def test_serve_refuses_a_missing_folder_in_one_line(tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    result = subprocess.run(
        [sys.executable, "-m", "attnres_cli", "serve", str(missing)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert result.stderr.strip() == f"attnres serve: error: MODEL={str(missing)!r}: no such folder"
