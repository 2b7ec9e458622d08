"""Writes the bundled SFT example set and its tokenizer (deterministic; run from the repo root):

    megatrain_jax/texts/sft_tiny.jsonl             ~400 short conversations
    megatrain_jax/texts/sft_tokenizer/tokenizer.json, tokenizer_config.json
                                                   a 512-token byte-level BPE trained on them,
                                                   with a ChatML chat template (Qwen1.5's)

The conversations are generated from The Devil's Dictionary (bundled) and small facts: word
definitions, arithmetic with a follow-up turn, capitals (as prompt/completion pairs), letter
counts and sorting, some with a system message. configs/sft_tiny.yaml trains on them.
"""

import json
import os
import random
import re

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers.trainers import BpeTrainer

TEXTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                     "megatrain_jax", "texts")
VOCAB_SIZE = 512
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen1.5-Chat's template: ChatML with a default system message.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")  # Qwen2's pre-tokenizer pattern

CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Portugal", "Lisbon"), ("Austria", "Vienna"), ("Poland", "Warsaw"), ("Greece", "Athens"),
    ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"), ("Denmark", "Copenhagen"),
    ("Ireland", "Dublin"), ("Hungary", "Budapest"), ("Egypt", "Cairo"), ("Kenya", "Nairobi"),
    ("Japan", "Tokyo"), ("China", "Beijing"), ("India", "New Delhi"), ("Thailand", "Bangkok"),
    ("Canada", "Ottawa"), ("Mexico", "Mexico City"), ("Peru", "Lima"), ("Chile", "Santiago"),
    ("Argentina", "Buenos Aires"), ("Brazil", "Brasilia"), ("Australia", "Canberra"),
    ("Turkey", "Ankara"), ("Russia", "Moscow"), ("Belgium", "Brussels"),
]
SYSTEMS = ["You are a concise assistant.", "Answer in one sentence.",
           "You are a witty lexicographer.", "Be brief and exact."]
WORDS = ["apple", "river", "mountain", "candle", "library", "whisper", "garden", "thunder",
         "pencil", "harbor", "lantern", "meadow", "violin", "compass", "blanket", "orchard"]


def definitions(path: str) -> list:
    """(WORD, first sentence of its definition) from The Devil's Dictionary."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    out = []
    for para in text.split("\n\n"):
        m = re.match(r"([A-Z][A-Z' -]+), ([a-z.]+)\s+(.*)", " ".join(para.split()))
        if not m:
            continue
        sentence = re.match(r"(.+?[.!?])(\s|$)", m.group(3))
        if sentence and 20 <= len(sentence.group(1)) <= 140:
            out.append((m.group(1).title(), sentence.group(1)))
    return out


def conversations(rng: random.Random, defs: list) -> list:
    out = []
    asks = ["What does the Devil's Dictionary say {w} means?", "Define {w}, cynically.",
            "{w}?", "How would Ambrose Bierce define {w}?"]
    for word, definition in rng.sample(defs, 160):
        msgs = [{"role": "user", "content": rng.choice(asks).format(w=word.lower())},
                {"role": "assistant", "content": f"{word}: {definition}"}]
        if rng.random() < 0.3:
            msgs.insert(0, {"role": "system", "content": rng.choice(SYSTEMS)})
        out.append({"messages": msgs})
    for _ in range(80):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        follow = rng.choice([("Now double it.", 2, "Doubled"), ("And times three?", 3, "Tripled")])
        out.append({"messages": [
            {"role": "user", "content": f"What is {a} + {b}?"},
            {"role": "assistant", "content": f"{a} + {b} = {a + b}."},
            {"role": "user", "content": follow[0]},
            {"role": "assistant", "content": f"{follow[2]}, {a + b} becomes {(a + b) * follow[1]}."}]})
    for _ in range(60):
        country, capital = rng.choice(CAPITALS)
        out.append({"prompt": f"What is the capital of {country}?",
                    "completion": f"The capital of {country} is {capital}."})
    for _ in range(60):
        word = rng.choice(WORDS)
        if rng.random() < 0.5:
            out.append({"messages": [
                {"role": "user", "content": f"How many letters are in the word \"{word}\"?"},
                {"role": "assistant", "content": f"The word \"{word}\" has {len(word)} letters."}]})
        else:
            out.append({"messages": [
                {"role": "user", "content": f"Spell \"{word}\" backwards."},
                {"role": "assistant", "content": f"\"{word}\" backwards is \"{word[::-1]}\"."}]})
    for _ in range(40):
        nums = [rng.randint(1, 99) for _ in range(rng.randint(3, 6))]
        out.append({"messages": [
            {"role": "system", "content": rng.choice(SYSTEMS)},
            {"role": "user", "content": f"Sort these numbers: {', '.join(map(str, nums))}"},
            {"role": "assistant", "content": f"In ascending order: {', '.join(map(str, sorted(nums)))}."}]})
    rng.shuffle(out)
    return out


def texts(convs: list):
    for c in convs:
        for m in c.get("messages", []):
            yield m["content"]
        if "prompt" in c:
            yield c["prompt"]
            yield c["completion"]
    yield from SYSTEMS + ["You are a helpful assistant.", "system", "user", "assistant"]


def tokenizer(convs: list) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL, show_progress=False,
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(texts(convs)), trainer)
    return tok


def main():
    rng = random.Random(0)
    convs = conversations(rng, definitions(os.path.join(TEXTS, "devils_dictionary.txt")))
    with open(os.path.join(TEXTS, "sft_tiny.jsonl"), "w", encoding="utf-8") as f:
        for c in convs:
            f.write(json.dumps(c, ensure_ascii=False) + "\n")
    directory = os.path.join(TEXTS, "sft_tokenizer")
    os.makedirs(directory, exist_ok=True)
    tokenizer(convs).save(os.path.join(directory, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
              "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "model_max_length": 2048}
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    print(f"wrote {len(convs)} conversations and a {VOCAB_SIZE}-token tokenizer to {TEXTS}")


if __name__ == "__main__":
    main()
