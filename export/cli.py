"""``kvserve export CKPT --out ARTIFACTS``. The exporter (torch) is imported only when the
command runs, so ``kvserve export --help`` answers at once."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from kvserve.artifact.manifest import MANIFEST

from .logs import quiet_exporter_logs

# == pipeline.PRECISIONS (tests/test_cli_startup.py checks); not imported from there: torch
PRECISIONS = ("fp32", "fp16", "int8", "int4")
BLOCKS = (16, 32, 64, 128, 256)  # == precision.BLOCKS (tests check)


def add_arguments(parser) -> None:
    parser.add_argument("checkpoint", help="checkpoint directory (kvserve train / import-hf)")
    parser.add_argument("--out", required=True, help="artifact directory to write")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                        help="fp32 (default), fp16 (CUDA provider; float16 KV cache), int8 "
                             "(CPU, integer MatMuls: int8 weights per output column, "
                             "activations quantized per row), int4 (CPU, 4-bit weight blocks: "
                             "MatMulNBits; fused graphs)")
    parser.add_argument("--int4-block-size", type=int, default=None, choices=BLOCKS,
                        metavar="N", help="int4: weights per 4-bit block, one float32 scale "
                                          "each (16, 32 (default), 64, 128, 256): 64 stores "
                                          "4.5 bits a weight (llama.cpp q4_0's size), 128 "
                                          "4.25; larger blocks decode faster and move the "
                                          "logits a little more")
    parser.add_argument("--int8-block-size", type=int, default=None, choices=BLOCKS,
                        metavar="N", help="int8 in 8-bit MatMulNBits blocks of N weights, one "
                                          "float32 scale each (fused graphs; 64 stores 8.5 "
                                          "bits a weight, llama.cpp q8_0's size): faster at "
                                          "batch 1, slower batched, logits move a little with "
                                          "the batch. Default: per-row int8 in standard ops, "
                                          "the same logits in any batch")
    parser.add_argument("--paired-attention", action="store_true",
                        help="feed each GroupQueryAttention one more query row per row, so "
                             "every row takes its multi-token path and a token's logits are "
                             "the same bit for bit from any call: the server then runs the "
                             "prefix cache, speculation and constraint fast-forward exactly "
                             "(on by default) on int8 (per row, or blocks up to 64) and int4 "
                             "(blocks up to 32) artifacts, where they are otherwise off. "
                             "Costs the op's multi-token path on every step, most at long "
                             "contexts in large batches (docs/speed.md)")
    parser.add_argument("--portable", action="store_true",
                        help="standard ONNX ops only (prefill + decode graphs with the optimum "
                             "/ genai I/O names) for other runtimes, instead of the fused "
                             "GroupQueryAttention graph")
    parser.add_argument("--no-attention", action="store_true",
                        help="skip the attention-diagnostics graph(s)")
    parser.add_argument("--parity-steps", type=int, default=64,
                        help="decode steps in the parity gate (>= 64; fewer where the "
                             "model's context is shorter)")
    parser.add_argument("--eval-text", default=None,
                        help="text file for the perplexity figures (default: a stdlib source)")
    parser.add_argument("--max-ppl-increase", type=float, default=0.10,
                        help="fail fp16/int8/int4 when validation perplexity rises more than "
                             "this fraction (default %(default)s; without a tokenizer: on "
                             "text the fp32 model samples)")
    parser.add_argument("--optimize", action="store_true",
                        help="store onnxruntime's offline-optimised graphs (tied to this "
                             "machine's CPU features and onnxruntime version; recorded in the "
                             "manifest)")
    parser.add_argument("--threads", type=int, default=None, help="onnxruntime threads")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    parser.add_argument("--sign-key", default=None,
                        help="Ed25519 private key (PEM): sign the manifest (manifest.sig); "
                             "see `kvserve sign --help`")


def main(args) -> int:
    quiet_exporter_logs()
    from .parity import ParityError
    from .pipeline import export_artifacts
    from .precision import PrecisionError
    from kvserve.artifact.signing import SignatureError, load_private_key, sign_manifest

    try:  # the key is read first: a bad key fails before minutes of export
        key = load_private_key(args.sign_key) if args.sign_key else None
    except SignatureError as e:
        print(f"kvserve export: {e}", file=sys.stderr)
        return 2
    try:
        out = export_artifacts(args.checkpoint, args.out, precision=args.precision,
                               attention=not args.no_attention, portable=args.portable,
                               parity_steps=args.parity_steps,
                               eval_text=args.eval_text, max_ppl_increase=args.max_ppl_increase,
                               optimize=args.optimize,
                               overwrite=args.overwrite, threads=args.threads,
                               int4_block=args.int4_block_size,
                               int8_block=args.int8_block_size,
                               paired=args.paired_attention)
    except (ParityError, PrecisionError) as e:
        print(f"kvserve export: FAILED: {e}; no artifact written", file=sys.stderr)
        return 1
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"kvserve export: {e}", file=sys.stderr)
        return 2
    if key is not None:
        sign_manifest(out, key)
    m = json.loads((Path(out) / MANIFEST).read_text())
    p = m["parity"]["fp32"]
    print(f"exported {out} ({m['kind']} graph, {m['precision']}): parity fp32 max |Δlogit| prefill "
          f"{p['max_abs_logit_prefill']:.2e}, decode {p['max_abs_logit_decode']:.2e} over "
          f"{p['decode_steps']} steps x {p['batch']} rows, greedy tokens equal: "
          f"{p['greedy_tokens_equal']}")
    for label, q in m["parity"].items():  # the transformed graphs' ("int8", "int8+optimized")
        if label == "fp32":
            continue
        worst = max(q["max_abs_logit_prefill"], q["max_abs_logit_decode"])
        print(f"  {label}: max |Δlogit| {worst:.2e}, greedy agreement {q['token_agreement']:.3f}"
              + (f", blocks of {m['quantization']['block_size']}" if "quantization" in m else ""))
    if "perplexity" in m:
        print("  perplexity: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, (int, float))
                                           else f"{k}: {v}"
                                           for k, v in m["perplexity"].items()))
    if key is not None:
        print(f"  signed: {Path(out) / 'manifest.sig'}")
    return 0
