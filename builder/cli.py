"""build_engine: HF checkpoint or TensorRT-LLM checkpoint -> engine directory.

Flags follow TensorRT-LLM's (`trtllm-build`, `convert_checkpoint.py`, the LLM API). Everything is
validated before any work starts; user errors exit with code 2 and one line on stderr; the
output directory appears only when the build is complete.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from builder.convert import convert_checkpoint
from builder.native_engine import TrtllmCheckpoint, build_engine, check_matches_checkpoint
from builder.trtllm_engine import TrtllmOptions, build_trtllm_engine
from builder.trtllm_layout import QUANTIZED
from builder.validation import (NO_QUANT, BuildError, check_tokenizer, machine_memory, memory_notes,
                                open_hf_checkpoint, plan_text, quant_algo_flag, quant_algo_of_flag, validate_build)
from runtime.io.atomic import (OutputDirError, check_not_replacing, check_output_dir, os_error_text, owned_tempdir,
                               release_owned, remove_stale)
from runtime.io.checkpoint import CheckpointError, HFCheckpoint
from runtime.io.engine_format import (BACKENDS, DEFAULT_MAX_DRAFT_LEN, DTYPES, GUIDED_DECODING_BACKENDS, HF_MAX_SEQ_LEN,
                                     QUANT_ALGOS, BuildConfig, EngineError, default_max_seq_len,
                                     max_draft_len_allowed, released_quant_algo)
from runtime.model.config import ConfigError, ModelConfig
from runtime.cli import interrupt_on_sigterm, show_defaults


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 0")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not in (0, 1]")
    return value


def _unit_interval(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:  # NaN too
        raise argparse.ArgumentTypeError(f"{text!r} is not in [0, 1]")
    return value


def _gib(text: str) -> float:
    value = float(text)
    if not 0 < value < math.inf:  # NaN too
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of GiB")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="build_engine", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint_dir", type=Path, help="TensorRT-LLM checkpoint (from builder.convert)")
    src.add_argument("--model_dir", type=Path, help="HF DeepSeek-V3 checkpoint (converted on the fly)")
    p.add_argument("--output_dir", type=Path, help="required unless --dry_run (which writes nothing there)")
    p.add_argument("--tokenizer_dir", type=Path, help="default: the input directory")
    p.add_argument("--dtype", choices=list(DTYPES),
                   help="default: the checkpoint's; from --model_dir float32 (native) or bfloat16 (trtllm)")
    p.add_argument("--max_batch_size", type=_positive, default=BuildConfig.max_batch_size)
    p.add_argument("--max_seq_len", type=_positive,
                   help=f"default: the model's max_position_embeddings, at most {HF_MAX_SEQ_LEN} (as a checkpoint "
                        "directory is served)")
    p.add_argument("--max_num_tokens", type=_positive, default=BuildConfig.max_num_tokens)
    p.add_argument("--max_draft_len", type=_non_negative,
                   help=f"default: {DEFAULT_MAX_DRAFT_LEN}, or less where the MTP layers allow less")
    p.add_argument("--kv_block_size", type=_positive, default=BuildConfig.kv_block_size)
    p.add_argument("--tp_size", type=_positive, help="default: 1, or the checkpoint's")
    p.add_argument("--ep_size", type=_positive, help="default: 1, or the checkpoint's")
    p.add_argument("--quant_algo", choices=[quant_algo_flag(a) for a in QUANT_ALGOS],
                   help="default: as the checkpoint is (FP8_BLOCK_SCALES for the FP8 release)")
    p.add_argument("--backend", choices=BACKENDS, default=BuildConfig.backend)
    p.add_argument("--force", action="store_true", help="replace an existing output directory")
    p.add_argument("--dry_run", action="store_true",
                   help="write nothing: print each rank's weight bytes, the KV cache bytes per token and the tokens "
                        "that fit, from --model_dir's config.json alone (no weights needed)")
    p.add_argument("--device_memory_gib", type=_gib,
                   help="--dry_run: memory of each rank's device (default: this machine's); the KV cache gets "
                        "--free_gpu_memory_fraction of it, less the weights")
    t = p.add_argument_group("--backend trtllm (LLM API options)")
    t.add_argument("--enable_attention_dp", action="store_true")
    t.add_argument("--kv_cache_dtype", choices=["auto", "fp8"], default=TrtllmOptions.kv_cache_dtype)
    t.add_argument("--free_gpu_memory_fraction", type=_fraction, default=TrtllmOptions.free_gpu_memory_fraction)
    t.add_argument("--enable_block_reuse", action=argparse.BooleanOptionalAction, default=TrtllmOptions.enable_block_reuse)
    t.add_argument("--cuda_graph_padding", action=argparse.BooleanOptionalAction, default=TrtllmOptions.cuda_graph_padding)
    t.add_argument("--use_mtp_vanilla", action="store_true")
    t.add_argument("--use_relaxed_acceptance_for_thinking", action="store_true")
    t.add_argument("--relaxed_topk", type=_positive, default=TrtllmOptions.relaxed_topk)
    t.add_argument("--relaxed_delta", type=_unit_interval, default=TrtllmOptions.relaxed_delta)
    t.add_argument("--guided_decoding_backend", choices=GUIDED_DECODING_BACKENDS,
                   help="serve structured output (GuidedDecodingParams) with this grammar engine; default: off")
    return p


def main(argv: list[str] | None = None) -> int:
    args = show_defaults(parser()).parse_args(argv)
    interrupt_on_sigterm()
    try:
        run(args)
    except (BuildError, OutputDirError, EngineError, CheckpointError, ConfigError) as e:
        print(f"build_engine: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the file system's own refusals: no space, no permission, a file in the way
        print(f"build_engine: error: {os_error_text(e, args.output_dir)}; no output directory was written", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        release_owned()
        print("build_engine: interrupted; no output directory was written", file=sys.stderr)
        return 130
    if not args.dry_run:
        print(f"build_engine: wrote {args.output_dir}", file=sys.stderr)
    return 0


def dry_run(args: argparse.Namespace) -> None:
    """Print the plan for --model_dir's config.json at the flags' layout (see validation.plan_text)."""
    if args.model_dir is None:
        raise BuildError("--dry_run plans from --model_dir's config.json; give --model_dir")
    source = args.model_dir / "config.json"
    cfg = ModelConfig.from_json(source)
    build = build_config(args, cfg, dtype=default_dtype(args.backend), tp_size=1, ep_size=1,
                         quant_algo=released_quant_algo(cfg.quantization_config is not None), notes=False)
    validate_build(cfg, build, str(source), use_mtp_vanilla=args.use_mtp_vanilla)
    memory = int(args.device_memory_gib * 2**30) if args.device_memory_gib else machine_memory()
    print(plan_text(cfg, build, str(source), memory, args.free_gpu_memory_fraction))


def check_flags(args: argparse.Namespace) -> TrtllmOptions:
    """The flags against each other, before any file is read; the same for a build and a --dry_run, so that a
    plan is never made for a build that would be refused. Returns the LLM-API options."""
    if args.dry_run and args.force:
        raise BuildError("--force replaces an existing --output_dir; --dry_run writes nothing (leave it out)")
    if not args.dry_run and args.output_dir is None:
        raise BuildError("--output_dir is required (or --dry_run)")
    if not args.dry_run and args.device_memory_gib is not None:
        raise BuildError("--device_memory_gib sizes --dry_run's plan; a build reads no device memory (leave it out)")
    options = TrtllmOptions(
        enable_attention_dp=args.enable_attention_dp, kv_cache_dtype=args.kv_cache_dtype,
        free_gpu_memory_fraction=args.free_gpu_memory_fraction, enable_block_reuse=args.enable_block_reuse,
        cuda_graph_padding=args.cuda_graph_padding, use_mtp_vanilla=args.use_mtp_vanilla,
        use_relaxed_acceptance_for_thinking=args.use_relaxed_acceptance_for_thinking,
        relaxed_topk=args.relaxed_topk, relaxed_delta=args.relaxed_delta,
        guided_decoding_backend=args.guided_decoding_backend,
    )
    if args.backend == "native" and options != TrtllmOptions():
        raise BuildError("the LLM API options (--enable_attention_dp, --kv_cache_dtype, ...) apply to --backend trtllm only")
    if args.max_draft_len == 0 and (args.use_relaxed_acceptance_for_thinking or args.use_mtp_vanilla):
        raise BuildError("--use_relaxed_acceptance_for_thinking and --use_mtp_vanilla change how drafts are made or "
                         "accepted; --max_draft_len 0 drafts none")
    if args.checkpoint_dir is not None and args.backend == "trtllm":
        raise BuildError("--backend trtllm needs --model_dir: TensorRT-LLM's PyTorch backend loads the HF layout")
    return options


def run(args: argparse.Namespace) -> None:
    options = check_flags(args)
    if args.dry_run:
        dry_run(args)
        return
    check_output_dir(args.output_dir, args.force)
    for note in remove_stale(args.output_dir):
        print(f"build_engine: {note}", file=sys.stderr)
    check_not_replacing(args.output_dir, "--output_dir", {
        "--model_dir": args.model_dir, "--checkpoint_dir": args.checkpoint_dir, "--tokenizer_dir": args.tokenizer_dir,
        "the current directory": Path.cwd()})
    if args.checkpoint_dir is not None:
        ckpt = TrtllmCheckpoint.read(args.checkpoint_dir)
        given = {name: getattr(args, name) for name in ("dtype", "tp_size", "ep_size") if getattr(args, name)}
        if args.quant_algo is not None:
            given["quant_algo"] = quant_algo_of_flag(args.quant_algo)
        check_matches_checkpoint(ckpt, given)  # before BuildConfig's own rules could name a mix of the two
        b = ckpt.build
        build = build_config(args, ckpt.model_config, dtype=b.dtype, tp_size=b.tp_size, ep_size=b.ep_size,
                             quant_algo=b.quant_algo)
        tokenizer_dir = args.tokenizer_dir or args.checkpoint_dir
        check_tokenizer(tokenizer_dir, ckpt.model_config.vocab_size)
        build_engine(args.checkpoint_dir, args.output_dir, build, tokenizer_dir=tokenizer_dir, force=args.force)
        return
    hf_ckpt = HFCheckpoint(args.model_dir)
    cfg = hf_ckpt.config
    if hf_ckpt.mtp_missing and args.max_draft_len:
        raise BuildError(f"--max_draft_len {args.max_draft_len}: {args.model_dir} stores no MTP weights although its "
                         "config.json declares MTP layers (as transformers' save_pretrained leaves a fine-tuned "
                         "model), so there is nothing to draft with; build with --max_draft_len 0")
    build = build_config(args, cfg, dtype=default_dtype(args.backend), tp_size=1, ep_size=1,
                         quant_algo=released_quant_algo(hf_ckpt.stored_fp8))
    open_hf_checkpoint(hf_ckpt, build)
    wide = [n for n in hf_ckpt.wide_weights if n.endswith(QUANTIZED)]  # the weights an FP8 engine stores as FP8
    if args.quant_algo is None and build.quant_algo is not None and args.backend == "native" and wide:
        print(f"build_engine: {len(wide)} weight(s) of {args.model_dir} stored wider than FP8 ({', '.join(wide[:3])}"
              f"{', ...' if len(wide) > 3 else ''}) are quantized to FP8 blocks, as an FP8 engine stores them (the "
              f"session on the checkpoint reads them as stored); --quant_algo {NO_QUANT} keeps every weight "
              "unquantized", file=sys.stderr)
    tokenizer_dir = args.tokenizer_dir or args.model_dir
    check_tokenizer(tokenizer_dir, cfg.vocab_size)
    if args.backend == "trtllm":
        build_trtllm_engine(hf_ckpt, args.output_dir, build, options, tokenizer_dir=tokenizer_dir, force=args.force)
        return
    validate_build(cfg, build, str(args.model_dir / "config.json"), use_mtp_vanilla=args.use_mtp_vanilla)
    with owned_tempdir(args.output_dir.parent, f".{args.output_dir.name}.ckpt-") as tmp:
        convert_checkpoint(hf_ckpt, tmp / "ckpt", build)
        build_engine(tmp / "ckpt", args.output_dir, build, tokenizer_dir=tokenizer_dir, force=args.force)


def default_dtype(backend: str) -> str:
    """The compute dtype a backend builds for without --dtype: TensorRT-LLM's GPUs bfloat16, the native CPU float32."""
    return "bfloat16" if backend == "trtllm" else "float32"


def build_config(args: argparse.Namespace, cfg: ModelConfig, *, dtype: str, tp_size: int, ep_size: int,
                 quant_algo: str | None, notes: bool = True) -> BuildConfig:
    """The flags over the source's own dtype, tp_size, ep_size and quant_algo (given as keywords);
    the draft length defaults to DEFAULT_MAX_DRAFT_LEN capped by what the checkpoint allows, max_seq_len to
    default_max_seq_len (an explicit value above the model's is refused later, naming the flag); with `notes`,
    what the limits ask of this machine's memory is printed."""
    if args.quant_algo is not None:
        quant_algo = quant_algo_of_flag(args.quant_algo)
    max_draft_len = args.max_draft_len
    if max_draft_len is None:
        max_draft_len = min(DEFAULT_MAX_DRAFT_LEN, max_draft_len_allowed(cfg, args.backend, args.use_mtp_vanilla)[0])
    build = BuildConfig(
        max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len or default_max_seq_len(cfg),
        max_num_tokens=args.max_num_tokens,
        max_draft_len=max_draft_len, dtype=args.dtype or dtype, kv_block_size=args.kv_block_size,
        tp_size=args.tp_size or tp_size, ep_size=args.ep_size or ep_size, quant_algo=quant_algo, backend=args.backend,
    )
    for note in memory_notes(cfg, build) if notes else []:
        print(f"build_engine: {note}", file=sys.stderr)
    return build


if __name__ == "__main__":
    sys.exit(main())
