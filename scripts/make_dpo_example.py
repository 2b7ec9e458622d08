"""Writes the bundled preference set (deterministic; run from the repo root):

    megatrain_jax/texts/dpo_tiny.jsonl   320 preference pairs: a prompt, a chosen (right) and a
                                         rejected (wrong) answer

The facts are those of scripts/make_sft_example.py (capitals, arithmetic, spelling, letter
counts), each pair's answers alike in form and differing in the fact, in the three shapes
data.format=preference reads: prompt/chosen/rejected as text, as message lists (some with a
system message), and as two whole conversations sharing their prompt. It uses the bundled SFT
tokenizer (megatrain_jax/texts/sft_tokenizer); configs/dpo_tiny.yaml trains on it.
"""

import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_sft_example import CAPITALS, SYSTEMS, TEXTS, WORDS  # noqa: E402


def pairs(rng: random.Random) -> list:
    out = []
    for _ in range(80):  # text
        (country, capital), (_, wrong) = rng.sample(CAPITALS, 2)
        out.append({"prompt": f"What is the capital of {country}?",
                    "chosen": f"The capital of {country} is {capital}.",
                    "rejected": f"The capital of {country} is {wrong}."})
    for _ in range(80):  # message lists, some with a system message
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        wrong = a + b + rng.choice([-10, -2, -1, 1, 2, 10])
        prompt = [{"role": "user", "content": f"What is {a} + {b}?"}]
        if rng.random() < 0.3:
            prompt.insert(0, {"role": "system", "content": rng.choice(SYSTEMS)})
        out.append({"prompt": prompt,
                    "chosen": [{"role": "assistant", "content": f"{a} + {b} = {a + b}."}],
                    "rejected": [{"role": "assistant", "content": f"{a} + {b} = {wrong}."}]})
    for _ in range(80):  # whole conversations: the shared first message is the prompt
        word = rng.choice(WORDS)
        user = {"role": "user", "content": f"Spell \"{word}\" backwards."}
        scrambled = "".join(rng.sample(word, len(word)))
        if scrambled == word[::-1]:
            scrambled = word
        out.append({"chosen": [user, {"role": "assistant",
                                      "content": f"\"{word}\" backwards is \"{word[::-1]}\"."}],
                    "rejected": [user, {"role": "assistant",
                                        "content": f"\"{word}\" backwards is \"{scrambled}\"."}]})
    for _ in range(80):
        word = rng.choice(WORDS)
        wrong = len(word) + rng.choice([-2, -1, 1, 2])
        out.append({"prompt": f"How many letters are in the word \"{word}\"?",
                    "chosen": f"The word \"{word}\" has {len(word)} letters.",
                    "rejected": f"The word \"{word}\" has {wrong} letters."})
    rng.shuffle(out)
    return out


def main():
    data = pairs(random.Random(0))
    with open(os.path.join(TEXTS, "dpo_tiny.jsonl"), "w", encoding="utf-8") as f:
        for pair in data:
            f.write(json.dumps(pair, ensure_ascii=False) + "\n")
    print(f"wrote {len(data)} preference pairs to {TEXTS}/dpo_tiny.jsonl")


if __name__ == "__main__":
    main()
