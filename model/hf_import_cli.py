"""``kvserve import-hf HF_DIR --out CKPT``: flags and entry point (the importer, which needs
torch, is ``model/hf_import.py`` and is imported only when the command runs)."""
from __future__ import annotations

import argparse
import sys

from .hf_support import supported_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = supported_table()
    parser.add_argument("hf_dir", metavar="HF_DIR",
                        help="local Hugging Face model directory (config.json + safetensors)")
    parser.add_argument("--out", required=True, metavar="CKPT",
                        help="kvserve checkpoint directory to write")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing checkpoint at --out")
    parser.add_argument("--allow-unknown-config-keys", action="store_true",
                        help="warn about, instead of refusing, config.json keys import-hf "
                             "does not know")


def main(args: argparse.Namespace) -> int:
    from .hf_import import HFImportError, import_hf  # torch

    try:
        out = import_hf(args.hf_dir, args.out, overwrite=args.overwrite,
                        allow_unknown_keys=args.allow_unknown_config_keys)
    except (HFImportError, OSError) as e:
        print(f"kvserve import-hf: error: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0
