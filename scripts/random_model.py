"""Write a model folder with the architecture and tokenizer of another but random weights.

Used where the real weights cannot travel (the lent GPU machine accepts 64 MiB): speed
depends only on shapes, so with EOS ignored the figures equal those of the real weights.

    python scripts/random_model.py SRC_FOLDER OUT_FOLDER
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

KEEP = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
        "special_tokens_map.json", "generation_config.json")


def main(src: Path, out: Path) -> None:
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(src, local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    for name in KEEP:
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    print(f"random-weight {config.model_type} written to {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
