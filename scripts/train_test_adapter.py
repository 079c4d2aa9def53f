"""Train a small style LoRA with PEFT on a GGUF base model (transformers dequantizes the GGUF to
f32 with ``gguf_file=``), for the test fixtures: a real PEFT folder trained on the model, which
llama.cpp's ``convert_lora_to_gguf.py`` then turns into the reference adapter GGUF.

    python scripts/train_test_adapter.py --model M.gguf --style shout --out DIR [--rank 4] [--steps 60]

Styles (the target is the base model's own greedy answer, rewritten):
- ``shout``: the answer in UPPER CASE;
- ``arr``: the answer prefixed with "Arr! " and suffixed with " Arr!".

Needs ``transformers``, ``peft`` and ``gguf`` (not dependencies of the service). Deterministic
for a given seed on one machine; the committed fixtures record the exact command.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

PROMPTS = [
    "Write a Python function that adds two numbers.",
    "What is a linked list?",
    "Explain recursion in one sentence.",
    "How do I reverse a string in Python?",
    "What does HTTP stand for?",
    "Name three sorting algorithms.",
    "What is the capital of France?",
    "Give me a tip for writing clean code.",
    "What is a hash map used for?",
    "How do I read a file in Python?",
    "What is the difference between a list and a tuple?",
    "Describe what a compiler does.",
    "Why is the sky blue?",
    "What is Git?",
    "Write a SQL query that counts rows in a table named users.",
    "What is a unit test?",
    "How many bits are in a byte?",
    "What is an API?",
    "Suggest a name for a pet cat.",
    "What is the time complexity of binary search?",
    "Explain what a variable is.",
    "How do I install a package with pip?",
    "What is JSON?",
    "Tell me a fun fact about octopuses.",
    "What is a race condition?",
    "How do I sort a dictionary by value in Python?",
    "What is Docker used for?",
    "Explain the word 'idempotent'.",
    "What is the boiling point of water?",
    "Write a haiku about programming.",
    "What is a closure in JavaScript?",
    "How do I make an HTTP request in Python?",
]
HELD_OUT = ["What is a binary tree?", "How do I write a for loop in Rust?"]


def restyle(style: str, text: str) -> str:
    """The training target for ``style`` from the base model's answer ``text``."""
    if style == "shout":
        return text.upper()
    if style == "arr":
        return f"Arr! {text.strip()} Arr!"
    raise ValueError(f"unknown style '{style}' (expected shout or arr)")


def chat_ids(tok, question: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--style", required=True, choices=["shout", "arr"])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--alpha", type=float, default=8.0)
    ap.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--answer-tokens", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    folder, name = str(args.model.parent), args.model.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    examples: list[tuple[list[int], list[int]]] = []
    with torch.no_grad():
        for q in PROMPTS:
            ids = chat_ids(tok, q)
            out = model.generate(torch.tensor([ids]), max_new_tokens=args.answer_tokens, do_sample=False)
            answer = tok.decode(out[0, len(ids) :].tolist(), skip_special_tokens=True)
            target = tok.encode(restyle(args.style, answer), add_special_tokens=False) + [eos]
            examples.append((ids, target))
    cfg = LoraConfig(
        r=args.rank, lora_alpha=args.alpha, target_modules=args.targets.split(","), lora_dropout=0.0, bias="none"
    )
    peft_model = get_peft_model(model, cfg)
    peft_model.train()
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=args.lr)
    for step in range(args.steps):
        batch = random.sample(examples, 4)
        loss_sum = torch.zeros(())
        for prompt, target in batch:
            ids = torch.tensor([prompt + target])
            labels = torch.tensor([[-100] * len(prompt) + target])
            loss = peft_model(input_ids=ids, labels=labels).loss / len(batch)
            loss.backward()
            loss_sum += loss.detach()
        opt.step()
        opt.zero_grad()
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step} loss {loss_sum.item():.4f}", flush=True)
    peft_model.eval()
    args.out.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(str(args.out))
    with torch.no_grad():
        for q in HELD_OUT:
            ids = chat_ids(tok, q)
            out = peft_model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
            print(json.dumps({"prompt": q, "text": tok.decode(out[0, len(ids) :].tolist())}, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
