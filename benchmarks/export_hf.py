"""Write a GGUF model as a Hugging Face checkpoint directory (config.json, model.safetensors,
tokenizer files), dequantized into one dtype with pdserve's own GGUF loader.

Servers that no longer read GGUF files can then serve exactly the weights pdserve serves, so
`serve_throughput.py --model DIR --compare-url ...` compares two servers on one checkpoint.

    python benchmarks/export_hf.py --out /tmp/smollm2-hf            # the bundled SmolLM2-135M
    python benchmarks/export_hf.py --gguf model.gguf --out DIR --dtype float32
"""
import argparse
import json
import sys
from pathlib import Path

import torch
from pdserve.common.model_source import default_model_path
from pdserve.engine.loading.gguf_loader import load_gguf
from safetensors.torch import save_file

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def export(gguf: str, out: Path, dtype: str) -> Path:
    """Write `gguf` to `out` as an HF Llama checkpoint of `dtype`; returns `out`."""
    from transformers import AutoTokenizer

    config, tensors = load_gguf(gguf, DTYPES[dtype])
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": dtype}, indent=2) + "\n")
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    path = Path(gguf)
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", help="GGUF file (default: the bundled SmolLM2-135M)")
    parser.add_argument("--out", required=True, help="directory to write")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    args = parser.parse_args(argv)
    print(export(args.gguf or default_model_path(), Path(args.out), args.dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
