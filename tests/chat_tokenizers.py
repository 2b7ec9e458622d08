"""Tiny Hugging Face tokenizer directories in the style of real chat models, for the SFT tests.

Each is a BPE trained on a slice of the bundled text, with the pre-tokenizer, special tokens and
chat template (tests/chat_templates/, copied verbatim from the models' tokenizer_config.json) of:

    qwen     Qwen2.5-Instruct: byte-level BPE, ChatML (<|im_start|>/<|im_end|>), no BOS
    llama3   Llama-3.3-Instruct: byte-level BPE, <|begin_of_text|> written by the template,
             a post-processor that would add it (not with add_special_tokens=False)
    mixtral  Mixtral-8x7B-Instruct: SentencePiece-style BPE (Metaspace, byte fallback), [INST]
"""

import json
import os

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers.trainers import BpeTrainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATES = os.path.join(ROOT, "tests", "chat_templates")
CORPUS = os.path.join(ROOT, "megatrain_jax", "texts", "devils_dictionary.txt")

# The split patterns of Qwen2 and Llama 3 (tokenizer.json's pre_tokenizer)
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

STYLES = {
    "qwen": dict(template="qwen2_5.jinja", special=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                 config={"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                         "unk_token": None}),
    "llama3": dict(template="llama3_3.jinja",
                   special=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                            "<|end_header_id|>", "<|eot_id|>"],
                   config={"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    "mixtral": dict(template="mixtral.jinja", special=["<unk>", "<s>", "</s>"],
                    config={"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}),
}


def _text(chars: int = 60_000) -> list:
    with open(CORPUS, encoding="utf-8") as f:
        return f.read()[:chars].splitlines()


def make_tokenizer_dir(directory, style: str, vocab_size: int = 400) -> str:
    """Writes tokenizer.json and tokenizer_config.json of `style` into directory; returns the
    tokenizer.json path."""
    spec = STYLES[style]
    if style == "mixtral":
        tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
        alphabet = [f"<0x{b:02X}>" for b in range(256)]
        trainer = BpeTrainer(vocab_size=vocab_size + 256, special_tokens=spec["special"] + alphabet,
                             show_progress=False)
    else:
        split = QWEN_SPLIT if style == "qwen" else LLAMA3_SPLIT
        tok = Tokenizer(models.BPE())
        if style == "qwen":
            tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        trainer = BpeTrainer(vocab_size=vocab_size, special_tokens=spec["special"],
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_text(), trainer)
    if style == "qwen":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    elif style == "llama3":
        bos = "<|begin_of_text|>"
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=True),
            processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                          special_tokens=[(bos, tok.token_to_id(bos))])])
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "tokenizer.json")
    tok.save(path)
    with open(os.path.join(TEMPLATES, spec["template"]), encoding="utf-8") as f:
        template = f.read()
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template,
              "model_max_length": 4096, **spec["config"]}
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return path
