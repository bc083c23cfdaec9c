"""Fill `${key}` placeholders of a Triton config.pbtxt template, like TensorRT-LLM's
tools/fill_template.py, so the same deployment scripts work on our model repository.

    fill_template -i triton_repo/tensorrt_llm/config.pbtxt \
        "engine_dir:/engines/x,triton_max_batch_size:64,decoupled_mode:true"

Values containing ',' or ':' escape them with '\\'. Placeholders not named are left as they
are (string.Template.safe_substitute), so a template can be filled in several passes; a key the
file does not contain is an error (a typo would otherwise be silently ignored), except the keys of
upstream's templates that this repository has no use for (GPU memory, beam search, LoRA, logits
outputs, ...): those are accepted and reported as ignored, so upstream's documented commands run
unchanged. A key given twice is refused (upstream's keeps the last), and so is a value a server would
not load: one that leaves its string or number in config.pbtxt (`check_value`).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from string import Template

from runtime.io.atomic import atomic_write

# Upstream fills these two when not given: max_queue_size is tensorrt_llm's load-shedding parameter (0: no bound),
# max_queue_delay_microseconds a dynamic_batching block's delay.
DEFAULTS = {"max_queue_size": "0", "max_queue_delay_microseconds": "0"}
BOOLEANS = ("decoupled_mode",)  # bare booleans: true or false in any case (upstream writes False); protobuf text
# would also read 0x0, 0 or f as false, so those are refused rather than guessed at
# bare integers of config.pbtxt's own fields (protobuf text would refuse anything else, and the server with it)
INTEGERS = ("triton_max_batch_size", "max_queue_delay_microseconds", "preprocessing_instance_count",
            "postprocessing_instance_count", "bls_instance_count")
BARE_VALUE = re.compile(r"[A-Za-z0-9_.,+-]+")  # numbers and lists of them: no space, quote, brace or colon

# Keys of TensorRT-LLM backend's inflight_batcher_llm templates that upstream's documented commands pass and ours
# need not have (some of our templates have a few of them): accepted and reported, never a refusal.
UPSTREAM_ONLY = frozenset({
    "triton_backend", "batching_strategy", "max_beam_width", "max_attention_window_size", "sink_token_length",
    "batch_scheduler_policy", "cross_kv_cache_fraction",
    "kv_cache_host_memory_bytes", "kv_cache_onboard_blocks", "enable_trt_overlap", "iter_stats_max_iterations",
    "request_stats_max_iterations", "enable_kv_cache_reuse", "normalize_log_probs", "enable_chunked_context",
    "gpu_device_ids", "participant_ids", "lora_cache_optimal_adapter_size", "lora_cache_max_adapter_size",
    "lora_cache_gpu_memory_fraction", "lora_cache_host_memory_bytes", "lora_prefetch_dir", "decoding_mode",
    "medusa_choices", "eagle_choices", "gpu_weights_percent", "enable_context_fmha_fp32_acc", "multi_block_mode",
    "cuda_graph_mode", "cuda_graph_cache_size", "speculative_decoding_fast_logits", "encoder_engine_dir",
    "encoder_input_features_data_type", "logits_datatype", "prompt_embedding_table_data_type", "accumulate_tokens",
    "tensorrt_llm_model_name", "tensorrt_llm_draft_model_name", "multimodal_encoders_name",
    "guided_decoding_backend", "xgrammar_tokenizer_info_path", "lookahead_window_size", "lookahead_ngram_size",
    "lookahead_verification_set_size", "tokenizer_dir", "num_nodes", "tokenizer_type", *DEFAULTS,
})


def split_escaped(text: str, delimiter: str, maxsplit: int = -1, unescape: bool = True) -> list[str]:
    """Split on `delimiter` at most `maxsplit` times (-1: no limit); `\\x` is a literal x (kept
    escaped in the parts with unescape=False, for a second split)."""
    parts: list[str] = []
    current: list[str] = []
    escape = False
    for ch in text:
        if escape:
            current.append(ch if unescape else "\\" + ch)
            escape = False
        elif ch == "\\":
            escape = True
        elif ch == delimiter and maxsplit != len(parts):
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return parts


def parse_substitutions(text: str) -> dict[str, str]:
    """"k1:v1,k2:v2" -> {k1: v1, k2: v2}; a value may hold further ':' (URLs); "" gives {}."""
    subs: dict[str, str] = {}
    for item in split_escaped(text, ",", unescape=False):
        if not item.strip():
            continue
        parts = split_escaped(item, ":", maxsplit=1)
        if len(parts) != 2 or not parts[0].strip():
            raise ValueError(f"substitution {item!r}: expected key:value")
        key = parts[0].strip()
        if key in subs:  # which one was meant?
            raise ValueError(f"substitution {key!r} given twice")
        subs[key] = parts[1]
    return subs


def placeholders(template_text: str) -> set[str]:
    tmpl = Template(template_text)
    return {m.group("named") or m.group("braced") for m in tmpl.pattern.finditer(template_text)} - {None}


def quoted_placeholders(template_text: str) -> set[str]:
    """Placeholders that stand inside a "..." string of the protobuf text; the others stand bare (numbers,
    booleans)."""
    quoted = set()
    for m in Template.pattern.finditer(template_text):
        name = m.group("named") or m.group("braced")
        line_start = template_text.rfind("\n", 0, m.start()) + 1
        if name and template_text.count('"', line_start, m.start()) % 2:
            quoted.add(name)
    return quoted


def check_value(key: str, value: str, quoted: bool, source: str, low: int = 0) -> None:
    """A value must stay inside its place in config.pbtxt: a quote or a line break would end the string and add
    settings of its own (a `backend:` line, parameters), so values are refused, never escaped into meaning."""
    if quoted:
        bad = next((c for c in value if c in '"\\' or ord(c) < 0x20 or c == "\x7f"), None)
        if bad is not None:
            raise ValueError(f"{source}: {key}:{value!r}: a quote, backslash or control character ({bad!r}) cannot "
                             "stand inside a config.pbtxt string")
    elif key in BOOLEANS:
        if value.lower() not in ("true", "false"):
            raise ValueError(f"{source}: {key}:{value!r}: expected true or false")
    elif key in INTEGERS:
        if not (value.isascii() and value.isdigit() and low <= int(value) < 2**31):
            raise ValueError(f"{source}: {key}:{value!r}: expected an integer in [{low}, {2**31 - 1}]")
    elif not BARE_VALUE.fullmatch(value):
        raise ValueError(f"{source}: {key}:{value!r}: expected a number or a list of them (letters, digits and "
                         "'.,_+-' only: a space, quote, brace or colon would add settings of its own)")


def fill(template_text: str, substitutions: dict[str, str], source: str = "template") -> str:
    """Return the template with `substitutions` (plus DEFAULTS) applied."""
    tmpl = Template(template_text)
    present = placeholders(template_text)
    missing = sorted(set(substitutions) - present - UPSTREAM_ONLY)
    if missing:
        raise KeyError(f"{source}: no placeholder ${{{missing[0]}}} (keys not found: {', '.join(missing)})")
    quoted = quoted_placeholders(template_text)
    for key, value in substitutions.items():
        if key in present:  # a dynamic batch's preferred size must be positive (Triton's rule)
            low = 1 if re.search(r"preferred_batch_size:\s*\[\s*\$\{" + key + "}", template_text) else 0
            check_value(key, value, key in quoted, source, low)
    return tmpl.safe_substitute({**DEFAULTS, **substitutions})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file_path", type=Path, help="config.pbtxt template")
    parser.add_argument("substitutions", help="key:value,key:value,...")
    parser.add_argument("-i", "--in_place", action="store_true", help="rewrite the file instead of printing")
    args = parser.parse_args(argv)
    try:
        try:
            template = args.file_path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{args.file_path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
        subs = parse_substitutions(args.substitutions)
        text = fill(template, subs, str(args.file_path))
        if args.in_place:
            atomic_write(args.file_path.resolve(), text)  # through a link, as upstream writes it
    except (KeyError, ValueError, OSError) as e:
        print(f"fill_template: {e.args[0] if isinstance(e, KeyError) else e}", file=sys.stderr)
        return 2
    ignored = sorted(set(subs) - placeholders(template))
    if ignored:
        print(f"fill_template: {args.file_path}: ignored (not used by this repository): {', '.join(ignored)}",
              file=sys.stderr)
    if not args.in_place:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
