"""The files of a Hugging Face model directory: their names, config.json and the index read as
JSON, safetensors shards opened and written, and the tokenizer files an export copies.

Only `config.json`, `model.safetensors.index.json` and `*.safetensors` are ever read from a model
directory: never a pickle (`pytorch_model.bin`).
"""

import json
import os
import shutil

import ml_dtypes
import numpy as np

from megatrain_jax.errors import HFError


CONFIG_FILE, INDEX_FILE, SINGLE_FILE = "config.json", "model.safetensors.index.json", "model.safetensors"
FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}
# What an export copies from the source model's directory beside the weights, when present, so
# that AutoTokenizer and generate() work on the export as on the source.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja", "chat_template.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")


def read_json(path: str, what: str) -> dict:
    """The JSON object in `path`; `what` names the file's role when it is missing."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise HFError(f"{what}: {path} not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise HFError(f"{path}: expected a JSON object")
    return data


def read_hf_config(model_dir: str) -> dict:
    if not os.path.isdir(model_dir):
        raise HFError(f"model.from_hf: {model_dir} is not a directory")
    return read_json(os.path.join(model_dir, CONFIG_FILE), f"model.from_hf {model_dir}")


def open_safetensors(path: str):
    """A safe_open handle (numpy) on the safetensors file `path`."""
    from safetensors import safe_open
    try:
        return safe_open(path, framework="numpy")
    except Exception as e:  # the Rust side raises its own error types
        raise HFError(f"{path}: not a readable safetensors file ({e})") from None


def save_safetensors(tensors: dict, out_dir: str, file_name: str):
    """Writes {name: array} as out_dir/file_name, in the metadata format transformers expects."""
    from safetensors.numpy import save_file
    try:
        save_file(tensors, os.path.join(out_dir, file_name), metadata={"format": "pt"})
    except Exception as e:  # safetensors raises its own type for a full disk
        raise HFError(f"writing {file_name} of the export failed ({e})") from None


def all_finite(x: np.ndarray) -> bool:
    """No NaN or inf in x: min and max, since NaN propagates and inf shows; no temporary array."""
    return bool(np.isfinite(x.min()) and np.isfinite(x.max()))


def copy_tokenizer_files(run_config: dict, out_dir: str) -> str:
    """Copies TOKENIZER_FILES from the run's model.from_hf directory into out_dir (and, when that
    holds no tokenizer.json, the run's data.tokenizer file if it is one); returns a line saying
    what was copied from where."""
    source = run_config.get("model", {}).get("from_hf") or ""
    copied = []
    if source and os.path.isdir(source):
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(source, name)):
                shutil.copyfile(os.path.join(source, name), os.path.join(out_dir, name))
                copied.append(name)
    tokenizer = run_config.get("data", {}).get("tokenizer") or ""
    extra = ("tokenizer.json" not in copied and tokenizer.endswith(".json")
             and os.path.isfile(tokenizer))
    if extra:
        shutil.copyfile(tokenizer, os.path.join(out_dir, "tokenizer.json"))
    found = [f"{', '.join(copied)} from {source}"] if copied else []
    found += [f"tokenizer.json from data.tokenizer={tokenizer}"] if extra else []
    if found:
        return f"copied {'; '.join(found)}"
    if source and not os.path.isdir(source):
        return (f"no tokenizer files copied: model.from_hf={source} of the run is not there "
                f"(copy them from the source model by hand)")
    return "no tokenizer files copied: the run names no HF model directory or tokenizer.json"
